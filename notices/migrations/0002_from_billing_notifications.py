"""Each billing Notification (one per account, English text) becomes a Notice for each person of the
account: the owner of a personal account, the owners and admins of a team's. Kept as its stored text
(no message key), read state and time kept. billing's next migration deletes the old table."""

from django.conf import settings
from django.db import migrations

KIND = {"card_expiry": "card_expiring"}
MANAGING_ROLES = ("owner", "admin")


def _people(apps, account) -> list[int]:
    if account.kind == "user":
        User = apps.get_model(*settings.AUTH_USER_MODEL.split("."))
        return list(User.objects.filter(account_id=account.id).values_list("id", flat=True))
    Membership = apps.get_model("portal", "Membership")
    return list(
        Membership.objects.filter(team__account_id=account.id, role__in=MANAGING_ROLES).values_list(
            "user_id", flat=True
        )
    )


def forwards(apps, schema_editor):
    Notification = apps.get_model("billing", "Notification")
    Notice = apps.get_model("notices", "Notice")
    people: dict[int, list[int]] = {}
    for old in Notification.objects.select_related("account").order_by("id").iterator():
        if old.account_id not in people:
            people[old.account_id] = _people(apps, old.account)
        Notice.objects.bulk_create(
            [
                Notice(
                    user_id=user_id,
                    kind=KIND.get(old.kind, old.kind),
                    message=old.message,
                    dedupe_key=old.dedupe_key,
                    created_at=old.created_at,
                    read_at=old.read_at,
                )
                for user_id in people[old.account_id]
            ],
            ignore_conflicts=True,
        )


class Migration(migrations.Migration):
    dependencies = [
        ("notices", "0001_initial"),
        ("billing", "0006_ledger_guard_stripe_lifecycle"),
        ("portal", "0004_user_sso_subject"),
    ]

    operations = [migrations.RunPython(forwards, migrations.RunPython.noop)]
