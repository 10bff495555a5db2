from django.db import migrations

SLICES = [
    ("whole", "whole", 8, 8),
    ("1/2", "slice", 4, 4),
    ("1/4", "slice", 2, 2),
    ("1/8", "slice", 1, 1),
    ("cpu", "cpu", 0, 0),
]
MIG = [
    "1g.10gb",
    "1g.18gb",
    "1g.20gb",
    "2g.20gb",
    "2g.35gb",
    "3g.40gb",
    "3g.71gb",
    "4g.40gb",
    "4g.71gb",
    "7g.80gb",
    "7g.141gb",
]


def seed(apps, schema_editor):
    Profile = apps.get_model("provisioner", "Profile")
    for name, kind, eighths, quota in SLICES:
        Profile.objects.get_or_create(
            name=name, defaults={"kind": kind, "eighths": eighths, "quota_eighths": quota}
        )
    for name in MIG:
        slices = int(name.split("g.")[0])
        Profile.objects.get_or_create(
            name=name, defaults={"kind": "mig", "eighths": 8, "quota_eighths": max(1, round(slices * 8 / 7))}
        )


class Migration(migrations.Migration):
    dependencies = [("provisioner", "0001_initial")]
    operations = [migrations.RunPython(seed, migrations.RunPython.noop)]
