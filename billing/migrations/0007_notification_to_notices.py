"""Notifications moved to the notices app (its 0002 copies them, one per person): the table goes."""

from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [
        ("billing", "0006_ledger_guard_stripe_lifecycle"),
        ("notices", "0002_from_billing_notifications"),
    ]

    operations = [migrations.DeleteModel(name="Notification")]
