from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("portal", "0003_every_user_has_an_account"),
    ]

    operations = [
        migrations.AddField(
            model_name="user",
            name="sso_subject",
            field=models.CharField(
                blank=True,
                help_text=(
                    "The single sign-on identity (issuer#sub) this user signs in as; empty for local users."
                ),
                max_length=400,
                null=True,
                unique=True,
            ),
        ),
    ]
