"""Every user has their own paying account: users made before the ``post_save`` receiver (by
``createsuperuser`` or the admin) get one now. Historical models, so the service is not called; it
does the same (an Account of kind "user" named after the user)."""

from django.db import migrations


def accounts_for_users_without(apps, schema_editor):
    user_model = apps.get_model("portal", "User")
    account_model = apps.get_model("billing", "Account")
    for user in user_model.objects.filter(account__isnull=True).order_by("pk"):
        account = account_model.objects.create(kind="user", name=user.username)
        user_model.objects.filter(pk=user.pk, account__isnull=True).update(account=account)


class Migration(migrations.Migration):
    dependencies = [
        ("portal", "0002_access_tokens"),
        ("billing", "0006_ledger_guard_stripe_lifecycle"),
    ]

    # reversing keeps the accounts: an account may already hold money and ledger history
    operations = [migrations.RunPython(accounts_for_users_without, migrations.RunPython.noop)]
