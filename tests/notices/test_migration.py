"""notices 0002: each old billing Notification becomes a notice for each person of its account."""

from __future__ import annotations

import importlib

import pytest
from django.db import connection
from django.db.migrations.loader import MigrationLoader

from notices.models import Notice
from portal.models import Membership
from portal.services import team_create
from tests.notices.conftest import make_user

pytestmark = pytest.mark.django_db
moved = importlib.import_module("notices.migrations.0002_from_billing_notifications")


def test_old_notifications_become_notices_for_the_owner_or_the_team_managers():
    # the models as they were before billing dropped Notification; its table made again in this test's
    # transaction (PostgreSQL DDL is transactional: the rollback drops it)
    old = MigrationLoader(connection).project_state(
        ("notices", "0002_from_billing_notifications"), at_end=False
    )
    apps = old.apps
    Notification = apps.get_model("billing", "Notification")
    with connection.schema_editor() as editor:
        editor.create_model(Notification)
    ada, lead, helper, member = (make_user(n) for n in ("ada", "lead", "helper", "member"))
    team = team_create(creator=lead, name="Lab")
    Membership.objects.create(team=team, user=helper, role=Membership.Role.ADMIN)
    Membership.objects.create(team=team, user=member, role=Membership.Role.MEMBER)
    Notification.objects.create(account_id=ada.account_id, kind="card_expiry", message="Card 1 expires.",
                                dedupe_key="card:1:expiry:7d")  # fmt: skip
    Notification.objects.create(account_id=team.account_id, kind="ledger_hold", message="Hold 3.",
                                dedupe_key="hold:3")  # fmt: skip

    with connection.schema_editor() as editor:
        moved.forwards(apps, editor)

    got = sorted((n.user.username, n.kind, n.text) for n in Notice.objects.select_related("user"))
    assert got == [
        ("ada", "card_expiring", "Card 1 expires."),
        ("helper", "ledger_hold", "Hold 3."),
        ("lead", "ledger_hold", "Hold 3."),
    ]
