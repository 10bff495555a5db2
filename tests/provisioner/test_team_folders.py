"""Team folders in the portal (docs/STORAGE.md, "Team folders"): which folders a launch mounts and how,
what the heartbeat stores of the agents' measurements, and what the pages show."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone, translation

from billing.models import Account
from billing.services.pricing import price_set
from core.errors import Forbidden
from portal.models import Membership
from portal.services import team_create, team_member_folder_access_set
from provisioner.models import Session, SessionEvent, StopWarning, TeamFolderUsage
from provisioner.quotas import quota_set
from provisioner.selectors import workload_spec
from provisioner.services.limits import sessions_preempt_due
from provisioner.services.sessions import session_launch
from tests.provisioner.conftest import A100, ENV, beat, fund, make_node, make_user, workload_status
from tests.provisioner.test_heartbeat_api import enrolled, gpu, heartbeat_body, post  # noqa: F401

pytestmark = pytest.mark.django_db


def _launch(user, account=None) -> Session:
    return session_launch(
        user=user,
        account=account or user.account,
        gpu_model="",
        profile="cpu",
        environment=ENV,
        max_hours=None,
        idle_minutes=None,
        idempotency_key=None,
    ).session


@pytest.fixture
def lab(catalog):
    """Vision Lab: alice owns it, bob writes, carol only reads; dave is in no team. One node, so that
    the launches' environment is on some node."""
    make_node(gpus=[])  # no GPU: the preemption test keeps its one A100 contended
    alice, bob, carol, dave = (make_user(n) for n in ("alice", "bob", "carol", "dave"))
    team = team_create(creator=alice, name="Vision Lab")
    Membership.objects.create(team=team, user=bob)
    Membership.objects.create(team=team, user=carol, folder_read_only=True)
    return {"team": team, "alice": alice, "bob": bob, "carol": carol, "dave": dave}


def _folder(team, read_only: bool) -> dict:
    return {"key": str(team.account_id), "name": team.slug, "read_only": read_only}


def test_a_launch_mounts_the_folders_of_the_users_teams_as_their_access_says(lab):
    team = lab["team"]
    other = team_create(creator=lab["bob"], name="Other Lab")
    assert _launch(lab["alice"]).team_folders == [_folder(team, False)]
    team_account = Account.objects.get(pk=team.account_id)
    fund(team_account, 100_000_000)
    bobs = _launch(lab["bob"], team_account)  # on the team's account
    assert bobs.team_folders == [_folder(other, False), _folder(team, False)]  # every team of his
    carols = _launch(lab["carol"])
    assert carols.team_folders == [_folder(team, True)]
    assert workload_spec(carols)["teams"] == [_folder(team, True)]
    daves = _launch(lab["dave"])
    assert daves.team_folders == [] and "teams" not in workload_spec(daves)  # the spec agents knew
    assert not SessionEvent.objects.filter(kind="storage").exists()


def test_a_folder_over_its_quota_is_mounted_read_only_for_members_and_the_launch_goes_on(lab, settings):
    team = lab["team"]
    settings.TEAM_FOLDER_QUOTA_FILES = 100
    TeamFolderUsage.objects.create(
        account_id=team.account_id, bytes=5 << 20, files=101, measured_at=timezone.now()
    )
    bobs = _launch(lab["bob"])
    assert bobs.state in (Session.State.PLACING, Session.State.QUEUED)
    assert bobs.team_folders == [_folder(team, True)]
    warned = SessionEvent.objects.get(session=bobs, kind="storage")
    assert "Vision Lab" not in warned.message and team.slug in warned.message
    assert "101 files" in warned.message and "read-only" in warned.message
    # its owner still writes, to delete files, and is told
    alices = _launch(lab["alice"])
    assert alices.team_folders == [_folder(team, False)]
    assert "As a team owner or admin" in SessionEvent.objects.get(session=alices, kind="storage").message
    # at the limit exactly is not over; the team's own row overrides the settings
    TeamFolderUsage.objects.filter(account_id=team.account_id).update(files=100)
    assert _launch(lab["bob"]).team_folders == [_folder(team, False)]
    quota_set(account=Account.objects.get(pk=team.account_id), limits={"max_home_bytes": 4 << 20})
    assert _launch(lab["bob"]).team_folders == [_folder(team, True)]
    assert TeamFolderUsage.objects.get(account_id=team.account_id).bytes == 5 << 20  # nothing deleted


def test_the_warning_is_in_the_readers_language(lab, settings):
    settings.TEAM_FOLDER_QUOTA_BYTES = 1
    TeamFolderUsage.objects.create(
        account_id=lab["team"].account_id, bytes=4096, files=1, measured_at=timezone.now()
    )
    session = _launch(lab["bob"])
    with translation.override("zh-hans"):
        if translation.gettext("Team folder") == "Team folder":
            pytest.skip("the Chinese catalog is compiled at merge (locale/zh_Hans: compilemessages)")
        line = SessionEvent.objects.get(session=session, kind="storage").message_display
    assert "团队文件夹" in line and "只读" in line


def test_only_managers_set_a_members_access_and_never_their_own_kind_read_only(lab):
    team, alice, bob, carol = lab["team"], lab["alice"], lab["bob"], lab["carol"]
    team_member_folder_access_set(team=team, actor=alice, member=bob, read_only=True)
    assert _launch(bob).team_folders == [_folder(team, True)]
    with pytest.raises(Forbidden):
        team_member_folder_access_set(team=team, actor=carol, member=bob, read_only=False)
    with pytest.raises(Forbidden):
        team_member_folder_access_set(team=team, actor=alice, member=alice, read_only=True)
    team_member_folder_access_set(team=team, actor=alice, member=bob, read_only=False)
    assert _launch(bob).team_folders == [_folder(team, False)]


def _figures(key, *, bytes_=1000, files=3, at="2026-12-05T10:00:00Z") -> dict:
    return {"team": key, "bytes": bytes_, "files": files, "measured_at": at}


def test_measured_team_folders_are_stored_and_the_newest_measurement_wins(enrolled, lab):  # noqa: F811
    node, token = enrolled
    key = str(lab["team"].account_id)
    body = heartbeat_body([gpu(0, "GPU-a-0")])
    body["team_folders"] = [_figures(key, bytes_=7 << 30, files=40, at="2026-12-05T10:05:00Z")]
    assert post(token, body).status_code == 200
    body["team_folders"] = [_figures(key, bytes_=1, files=1, at="2026-12-05T10:01:00Z")]  # older, late
    assert post(token, body).status_code == 200
    usage = TeamFolderUsage.objects.get(account_id=lab["team"].account_id)
    assert (usage.bytes, usage.files, usage.node) == (7 << 30, 40, node)


@pytest.mark.parametrize(
    "garbage",
    [
        "not a list",
        ["a string"],
        {"team": 7, "bytes": 1, "files": 1, "measured_at": "2026-12-05T10:00:00Z"},
        {"team": "../7", "bytes": 1, "files": 1, "measured_at": "2026-12-05T10:00:00Z"},
        {"team": "PERSONAL", "bytes": 1, "files": 1, "measured_at": "2026-12-05T10:00:00Z"},
        {"team": "999999999", "bytes": 1, "files": 1, "measured_at": "2026-12-05T10:00:00Z"},
        {"team": "TEAM", "bytes": -1, "files": 1, "measured_at": "2026-12-05T10:00:00Z"},
        {"team": "TEAM", "bytes": 2**64, "files": 1, "measured_at": "2026-12-05T10:00:00Z"},
        {"team": "TEAM", "bytes": 1, "files": "1", "measured_at": "2026-12-05T10:00:00Z"},
        {"team": "TEAM", "bytes": 1, "files": 1, "measured_at": "yesterday"},
        {"team": "TEAM", "bytes": 1, "files": 1},
    ],
)
def test_a_garbage_team_folder_entry_is_dropped_and_the_heartbeat_recorded(enrolled, lab, garbage):  # noqa: F811
    node, token = enrolled
    other = team_create(creator=lab["dave"], name="Other Lab")
    if isinstance(garbage, dict) and garbage["team"] == "TEAM":
        garbage = {**garbage, "team": str(lab["team"].account_id)}
    if isinstance(garbage, dict) and garbage["team"] == "PERSONAL":  # a user's account has no team folder
        garbage = {**garbage, "team": str(lab["alice"].account_id)}
    body = heartbeat_body([gpu(0, "GPU-a-0")])
    body["team_folders"] = (
        [garbage, _figures(str(other.account_id))] if isinstance(garbage, dict) else garbage
    )
    response = post(token, body)
    assert response.status_code == 200, response.content
    node.refresh_from_db()
    assert node.last_heartbeat_at is not None
    assert list(TeamFolderUsage.objects.exclude(account_id=other.account_id)) == []
    if isinstance(garbage, dict):
        assert TeamFolderUsage.objects.get(account_id=other.account_id).files == 3  # the good entry is kept


def test_the_team_page_shows_the_folders_use_and_who_may_write(lab, settings):
    settings.TEAM_FOLDER_QUOTA_BYTES = 2 << 30
    team = lab["team"]
    browser = Client()
    browser.force_login(lab["alice"])
    page = browser.get(f"/teams/{team.slug}/").content.decode()
    assert "Team folder: not measured yet, at most 2.0\xa0GB" in page
    assert f"/home/teams/{team.slug}" in page
    TeamFolderUsage.objects.create(
        account_id=team.account_id, bytes=3 << 30, files=1234, measured_at=timezone.now()
    )
    page = browser.get(f"/teams/{team.slug}/").content.decode()
    assert "Team folder: 3.0\xa0GB of 2.0\xa0GB, 1,234 files" in page
    assert "members' new sessions see it read-only" in page
    # the owner may switch a member; carol's row says read-only
    assert page.count('name="action" value="folder"') == 2  # bob and carol, not the owner herself
    answer = browser.post(
        f"/teams/{team.slug}/", {"action": "folder", "member": lab["bob"].pk, "access": "ro"}
    )
    assert answer.status_code == 302
    assert Membership.objects.get(team=team, user=lab["bob"]).folder_read_only
    carols = Client()
    carols.force_login(lab["carol"])
    page = carols.get(f"/teams/{team.slug}/").content.decode()
    assert 'value="folder"' not in page  # a member sees who may write, and changes nothing
    cells = [cell.split("</td>")[0].strip() for cell in page.split('data-testid="folder-access">')[1:]]
    assert sorted(cells) == ["read-only", "read-only", "read-write"]  # bob (just switched), carol; alice
    refused = carols.post(
        f"/teams/{team.slug}/", {"action": "folder", "member": lab["bob"].pk, "access": "rw"}
    )
    assert refused.status_code == 302
    assert Membership.objects.get(team=team, user=lab["bob"]).folder_read_only  # unchanged


def test_the_dashboard_shows_each_teams_folder_beside_the_home(lab):
    team = lab["team"]
    browser = Client()
    browser.force_login(lab["bob"])
    assert 'data-testid="team-folder-use"' not in browser.get("/dashboard/").content.decode()  # not measured
    TeamFolderUsage.objects.create(
        account_id=team.account_id, bytes=3 << 30, files=1234, measured_at=timezone.now()
    )
    page = browser.get("/dashboard/").content.decode()
    assert "Team folder of Vision Lab: 3.0\xa0GB of 100.0\xa0GB, 1,234 files" in page
    browser = Client()
    browser.force_login(lab["dave"])
    assert 'data-testid="team-folder-use"' not in browser.get("/dashboard/").content.decode()


def test_the_team_api_shows_the_folder_and_each_members_access(lab, settings):
    settings.TEAM_FOLDER_QUOTA_FILES = 1000
    team = lab["team"]
    TeamFolderUsage.objects.create(
        account_id=team.account_id, bytes=4096, files=1001, measured_at=timezone.now()
    )
    browser = Client()
    browser.force_login(lab["bob"])
    body = browser.get(f"/api/v1/teams/{team.slug}").json()
    assert body["folder"] | {"measured_at": None} == {
        "path": f"/home/teams/{team.slug}",
        "bytes": 4096,
        "files": 1001,
        "measured_at": None,
        "max_bytes": settings.TEAM_FOLDER_QUOTA_BYTES,
        "max_files": 1000,
        "over": True,
    }
    access = {m["username"]: m["folder_read_only"] for m in body["members"]}
    assert access == {"alice": False, "bob": False, "carol": True}
    refused = browser.put(
        f"/api/v1/teams/{team.slug}/members/{lab['carol'].pk}/folder",
        {"read_only": False},
        "application/json",
    )
    assert refused.status_code == 403


def test_a_resumed_session_decides_its_team_folders_again(lab, settings, sent_tasks):
    settings.SESSION_PREEMPT_GRACE_SECONDS = 60
    price_set(
        gpu_model=A100,
        profile="whole",
        price_micros_per_hour=12_000_000,
        interruptible_price_micros_per_hour=4_000_000,
    )
    node, _token = make_node("node-p", [gpu(0, "GPU-p-0")])
    bob, team = lab["bob"], lab["team"]
    args = {"gpu_model": A100, "profile": "whole", "environment": ENV, "max_hours": 2, "idle_minutes": 60}
    victim = session_launch(
        user=bob, account=bob.account, idempotency_key=None, tier="interruptible", resume=True, **args
    ).session
    assert victim.team_folders == [_folder(team, False)]
    beat(node, [workload_status(victim, "running")])
    Membership.objects.filter(team=team, user=bob).update(folder_read_only=True)  # changed meanwhile
    session_launch(user=lab["dave"], account=lab["dave"].account, idempotency_key=None, **args)
    warning = StopWarning.objects.get(session=victim, kind="preempt", cleared_at__isnull=True)
    sessions_preempt_due(now=warning.due_at + timedelta(seconds=1))
    beat(node, [])
    resumed = Session.objects.get(resumed_from=victim)
    assert resumed.team_folders == [_folder(team, True)]
