"""Every page and every API list in a bounded number of queries that does not grow with the rows behind
it: measured on the demo as `make run` seeds it, then again after each user has more of everything
(notices, ledger transfers, sessions, team members, GPUs)."""

from __future__ import annotations

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from billing.services.topups import wallet_credit_promotion
from notices.services import notify
from portal.models import Membership, Team, User
from portal.services import user_create
from provisioner.demo import ENVIRONMENT
from provisioner.models import HomeUsage, TeamFolderUsage
from provisioner.services.sessions import session_launch
from tests.provisioner.conftest import gpu, make_node

pytestmark = pytest.mark.django_db

PAGE_MOST = 9  # "under 10 queries"
PAGES = {
    "student": [
        "/", "/dashboard/", "/launch/", "/launch/?profile=cpu", "/wallet/", "/cards/", "/sessions/",
        "/profile/", "/teams/", "/notices/", "/notices/settings/", "/live/funds", "/live/sessions", "/live/dashboard", "/files/",
    ],
    "teamlead": ["/dashboard/", "/wallet/", "/teams/", "/teams/vision-lab/", "/teams/vision-lab/usage/"],
    "admin": ["/operations/", "/operations/usage/", "/operations/audit/"],
}  # fmt: skip
API_LISTS = {
    "student": [
        "/api/v1/me", "/api/v1/catalog", "/api/v1/sessions", "/api/v1/quota", "/api/v1/wallet",
        "/api/v1/ledger", "/api/v1/cards", "/api/v1/notices/", "/api/v1/teams",
        "/api/v1/tokens",
    ],
    "teamlead": ["/api/v1/teams", "/api/v1/teams/vision-lab"],
    "admin": ["/api/v1/admin/nodes", "/api/v1/admin/quotas", "/api/v1/admin/prices", "/api/v1/admin/card-batches"],
}  # fmt: skip


@pytest.fixture
def demo(tmp_path, monkeypatch):
    from django.core.management import call_command

    monkeypatch.setenv("SUANLI_DATA_DIR", str(tmp_path))
    call_command("seed_demo", stdout=open("/dev/null", "w"))  # noqa: SIM115
    return {name: User.objects.get(username=name) for name in PAGES}


def _grow(users: dict[str, User], rounds: int) -> None:
    """More of every kind of row each page lists, for every demo user."""
    for name, user in users.items():
        # a measured home: the dashboard's and the files page's line (read with the request's user)
        HomeUsage.objects.update_or_create(
            user=user,
            defaults={"bytes": 19 * 2**30, "files": 400_000 + rounds, "measured_at": timezone.now()},
        )
        for index in range(rounds):
            key = f"{name}-{rounds}-{index}"
            notify(users=[user], kind="session_started", key="session_started",
                   params={"session": f"T4 #{index}"}, dedupe_key=key, url="/sessions/")  # fmt: skip
            wallet_credit_promotion(account=user.account, amount_micros=1_000_000, idempotency_key=key)
            session_launch(
                user=user, account=user.account, gpu_model="", profile="cpu", environment=ENVIRONMENT,
                max_hours=None, idle_minutes=None, idempotency_key=key,
            )  # fmt: skip
    # two more GPUs in the fleet: the operations page and the nodes API list every device
    make_node(f"grow-{rounds}", gpus=[gpu(0, f"GPU-grow-{rounds}-0"), gpu(1, f"GPU-grow-{rounds}-1")])
    team = Team.objects.get(slug="vision-lab")
    # a measured team folder: the dashboard's line for each of the user's teams, and the team page's
    TeamFolderUsage.objects.update_or_create(
        account=team.account, defaults={"bytes": 2**30, "files": 1000 + rounds, "measured_at": timezone.now()}
    )
    for index in range(rounds):
        member = user_create(username=f"member-{rounds}-{index}", email=f"m{rounds}{index}@example.com",
                             password="pw-123456789")  # fmt: skip
        Membership.objects.create(team=team, user=member, role=Membership.Role.MEMBER)


def _counts(users: dict[str, User], urls: dict[str, list[str]]) -> dict[tuple[str, str], int]:
    found = {}
    for name, paths in urls.items():
        client = Client()
        client.force_login(users[name])
        for path in paths:
            client.get(path)  # warm: the catalog cache, the session's first read
            with CaptureQueriesContext(connection) as queries:
                answer = client.get(path)
            assert answer.status_code == 200, (name, path, answer.status_code)
            found[(name, path)] = len(queries)
    return found


@pytest.mark.parametrize("urls", [PAGES, API_LISTS], ids=["pages", "api-lists"])
def test_every_page_and_list_takes_few_queries_and_no_more_with_more_rows(demo, urls, settings):
    settings.QUOTA_DEFAULT_MAX_SESSIONS = settings.QUOTA_DEFAULT_MAX_EIGHTHS = 1000
    _grow(demo, rounds=2)  # a page with no rows at all skips the queries of its rows' details
    few = _counts(demo, urls)
    over = {key: n for key, n in few.items() if n > PAGE_MOST}
    assert not over, f"more than {PAGE_MOST} queries: {over}"
    _grow(demo, rounds=6)
    more = _counts(demo, urls)
    over = {key: n for key, n in more.items() if n > PAGE_MOST}
    assert not over, f"more than {PAGE_MOST} queries with more rows: {over}"
    grew = {key: (few[key], n) for key, n in more.items() if n > few[key]}
    assert not grew, f"queries grew with the rows (before, after): {grew}"
