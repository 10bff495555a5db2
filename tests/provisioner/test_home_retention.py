"""The retention rule for homes (docs/STORAGE.md, "Retention"): who is planned, who is told and when
(once per stage, in their language), what a launch cancels, and what the hourly task removes: a real
folder on a shared root (never what a planted link points at), a real agent's local home, a node that is
down left for the next hour; a task run twice does nothing twice."""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
from django.core import mail
from django.utils import timezone

from notices.models import Notice
from provisioner.models import HomeRemoval, HomeUsage, Node, Session
from provisioner.sealing import seal, token_hash
from provisioner.selectors import workload_user
from provisioner.services.home_retention import (
    home_removals_due,
    home_removals_plan,
    home_removals_warn,
)
from provisioner.tasks import homes_retention_task
from tests.agents.conftest import NODE_TOKEN, start_agent, token_file  # noqa: F401  (fixtures)
from tests.provisioner.factories import (
    catalog_make,
    fleet_make,
    launch,
    no_start_task,
    node_make,
    profiles_ensure,
    session_row,
    user_make,
)

pytestmark = pytest.mark.django_db
S = Session.State
DAY = timedelta(days=1)


@pytest.fixture(autouse=True)
def _rule(settings):
    settings.HOMES_RETENTION_IDLE_DAYS = 180
    settings.HOMES_RETENTION_DELETED_DAYS = 30
    settings.HOMES_RETENTION_WARN_DAYS = 14
    profiles_ensure()


@pytest.fixture
def shared_root(settings, tmp_path):
    root = tmp_path / "homes"
    root.mkdir()
    settings.HOMES_BACKEND = "shared"
    settings.HOMES_SHARED_ROOT = str(root)
    return root


def _user(name: str, *, language: str = "en"):
    user = user_make(name)
    user.email, user.language = f"{name}@example.com", language
    user.save(update_fields=["email", "language"])
    return user


def _used(user, *, days_ago: float, node: Node | None = None, state: str = S.STOPPED) -> Session:
    """A session of ``user`` launched ``days_ago`` (on ``node``), now in ``state``."""
    session = session_row(user)
    Session.objects.filter(id=session.id).update(
        state=state, node=node, created_at=timezone.now() - timedelta(days=days_ago)
    )
    return session


def _home(root, name: str):
    home = root / name
    (home / "data" / "deep").mkdir(parents=True)
    (home / "data" / "deep" / "model.bin").write_bytes(b"m" * 8192)
    (home / "notes.txt").write_text("mine")
    return home


def _pending(**filters):
    return HomeRemoval.objects.filter(removed_at__isnull=True, cancelled_at__isnull=True, **filters)


def _due_now(*removals: HomeRemoval) -> None:
    """Time passes: the removals are due, their user told a day before."""
    ago = timezone.now() - timedelta(minutes=1)
    HomeRemoval.objects.filter(id__in=[r.id for r in removals]).update(
        due_at=ago, warned_at=ago - 13 * DAY, warned_final_at=ago - DAY
    )


# -- planning ------------------------------------------------------------------------------------------


def test_an_idle_users_homes_are_planned_on_every_node_and_an_active_users_are_not():
    now = timezone.now()
    node_a, node_b = node_make(), node_make()
    idle, active, nearly, recent = _user("idle"), _user("active"), _user("nearly"), _user("recent")
    _used(idle, days_ago=400, node=node_a)
    _used(idle, days_ago=200, node=node_b)
    _used(idle, days_ago=190)  # queued and never placed: no home anywhere
    _used(active, days_ago=300, node=node_a)
    _used(active, days_ago=3, node=node_a)  # the clock is the last launch
    _used(nearly, days_ago=170, node=node_a)  # due in 10 days: planned now, told 14 days ahead
    _used(recent, days_ago=160, node=node_a)  # due in 20 days: not yet

    assert home_removals_plan(now=now) == 3

    planned = {(r.user.username, r.node_id): r for r in _pending()}
    assert set(planned) == {("idle", node_a.id), ("idle", node_b.id), ("nearly", node_a.id)}
    for removal in planned.values():
        assert removal.reason == HomeRemoval.Reason.IDLE
        assert removal.name == workload_user(removal.user)
        assert removal.due_at == now + 14 * DAY  # never sooner than the warning's lead
    assert home_removals_plan(now=now) == 0  # a repeat plans nothing
    assert _pending().count() == 3


def test_on_the_shared_root_only_a_folder_that_is_there_is_planned(shared_root):
    with_home, without = _user("kept-files"), _user("never-placed")
    _used(with_home, days_ago=300)
    _used(without, days_ago=300)
    _home(shared_root, workload_user(with_home))

    assert home_removals_plan(now=timezone.now()) == 1
    assert _pending().get().user == with_home and _pending().get().node is None


def test_zero_idle_days_keeps_homes_forever(settings):
    user = _user("keeper")
    _used(user, days_ago=5000, node=node_make())
    settings.HOMES_RETENTION_IDLE_DAYS = 0
    assert home_removals_plan(now=timezone.now()) == 0
    assert not HomeRemoval.objects.exists()


def test_a_deactivated_users_home_is_planned_and_reactivation_cancels_it():
    now = timezone.now()
    user = _user("gone")
    _used(user, days_ago=2, node=node_make())
    user.is_active = False
    user.save(update_fields=["is_active"])

    assert home_removals_plan(now=now) == 1
    removal = _pending().get()
    assert (removal.reason, removal.due_at) == (HomeRemoval.Reason.INACTIVE, now + 30 * DAY)
    assert home_removals_warn(now=now) == 0  # cannot sign in: not told
    user.is_active = True
    user.save(update_fields=["is_active"])
    home_removals_plan(now=now + DAY)
    assert HomeRemoval.objects.get(id=removal.id).cancelled_at == now + DAY


def test_a_deleted_users_home_is_planned_by_name_and_removed_30_days_on(shared_root):
    user = user_make("leaver")
    name = workload_user(user)
    home = _home(shared_root, name)  # files uploaded from the portal: no session ever ran

    user.delete()

    removal = HomeRemoval.objects.get()
    assert (removal.user, removal.name, removal.reason) == (None, name, HomeRemoval.Reason.DELETED)
    assert timedelta(days=29) < removal.due_at - timezone.now() <= timedelta(days=30)
    assert homes_retention_task()["warned"] == 0 and home.exists()  # nobody to tell; not due yet
    HomeRemoval.objects.filter(id=removal.id).update(due_at=timezone.now() - DAY)
    assert homes_retention_task()["removed"] == 1
    assert not home.exists()
    assert HomeRemoval.objects.get(id=removal.id).removed_at is not None


# -- warnings ------------------------------------------------------------------------------------------


def test_the_user_is_told_14_days_before_and_1_day_before_once_each_in_their_language(
    django_capture_on_commit_callbacks,
):
    now = timezone.now()
    user = _user("lin", language="zh-hans")
    _used(user, days_ago=300, node=node_make())
    _used(user, days_ago=250, node=node_make())  # two homes, one notice per warning
    home_removals_plan(now=now)

    with django_capture_on_commit_callbacks(execute=True):
        assert home_removals_warn(now=now) == 1
        assert home_removals_warn(now=now + timedelta(hours=1)) == 0
        assert home_removals_warn(now=now + 12 * DAY) == 0  # not yet a day before
        assert home_removals_warn(now=now + 13 * DAY - timedelta(minutes=30)) == 1  # the last run before
        assert home_removals_warn(now=now + 13 * DAY + timedelta(hours=1)) == 0

    notices = list(Notice.objects.filter(user=user, kind="home_removal").order_by("id"))
    assert len(notices) == 2
    assert len(mail.outbox) == 2 and {m.to[0] for m in mail.outbox} == {"lin@example.com"}
    due = (now + 14 * DAY).strftime("%Y-%m-%d %H:%M")
    for sent in mail.outbox:
        assert "主目录" in sent.body and due in sent.body, sent.body
        assert "/files/" in sent.body
    assert all(r.warned_at == now and r.warned_final_at for r in _pending(user=user))


def test_a_late_warning_moves_the_removal_back_so_the_user_always_has_the_days_promised():
    now = timezone.now()
    user = _user("late")
    _used(user, days_ago=300, node=node_make())
    home_removals_plan(now=now)
    later = now + 14 * DAY + timedelta(hours=5)  # the beat was down: already past due, never told

    assert home_removals_warn(now=later) == 1
    removal = _pending().get()
    assert removal.due_at == later + DAY and removal.warned_at == later
    assert home_removals_due(now=later) == []


# -- cancellation --------------------------------------------------------------------------------------


def test_a_launch_cancels_the_pending_removal(monkeypatch):
    no_start_task(monkeypatch)
    model = catalog_make()
    fleet_make(model)
    now = timezone.now()
    user = _user("back")
    _used(user, days_ago=300, node=node_make())
    home_removals_plan(now=now)
    removal = _pending(user=user).get()

    launch(user)

    assert not _pending(user=user).exists()
    assert HomeRemoval.objects.get(id=removal.id).cancelled_at is not None
    assert home_removals_plan(now=now) == 0  # the clock starts again from this launch


# -- removal -------------------------------------------------------------------------------------------


def test_removal_on_the_shared_root_never_follows_a_link_and_leaves_other_homes(shared_root, tmp_path):
    user, neighbour = _user("ann"), _user("ben")
    _used(user, days_ago=300)
    _used(neighbour, days_ago=3)
    home, other = _home(shared_root, workload_user(user)), _home(shared_root, workload_user(neighbour))
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("the operator's")
    (home / "to-outside").symlink_to(outside)
    (home / "data" / "to-neighbour").symlink_to(other)
    (home / "data" / "to-secret").symlink_to(outside / "secret.txt")
    os.mkfifo(home / "pipe")
    HomeUsage.objects.create(user=user, bytes=8192, files=6, measured_at=timezone.now())

    first = homes_retention_task()
    assert (first["planned"], first["warned"]) == (1, 1) and home.exists()
    _due_now(_pending(user=user).get())
    assert homes_retention_task()["removed"] == 1

    assert not home.exists()
    assert (outside / "secret.txt").read_text() == "the operator's"
    assert (other / "notes.txt").read_text() == "mine" and (other / "data" / "deep" / "model.bin").exists()
    assert sorted(os.listdir(shared_root)) == [".suanli", workload_user(neighbour)]
    assert os.listdir(shared_root / ".suanli" / "removing") == []
    removal = HomeRemoval.objects.get(user=user)
    assert removal.removed_at is not None and removal.attempts == 1
    assert not HomeUsage.objects.filter(user=user).exists()  # its figures went with it
    # run again: nothing planned, told or removed twice
    again = homes_retention_task()
    assert again == {"planned": 0, "warned": 0}
    assert HomeRemoval.objects.count() == 1 and Notice.objects.filter(user=user).count() == 1


def test_a_shared_home_is_not_removed_while_a_session_of_its_user_is_live(shared_root):
    user = _user("busy")
    _used(user, days_ago=300)
    home = _home(shared_root, workload_user(user))
    homes_retention_task()
    removal = _pending(user=user).get()
    _due_now(removal)
    node = node_make()
    live = _used(user, days_ago=0.1, node=node, state=S.RUNNING)
    Session.objects.filter(id=live.id).update(created_at=removal.last_launch_at)  # a launch that slipped by

    assert homes_retention_task().get("in_use") == 1

    assert (home / "notes.txt").read_text() == "mine"
    removal.refresh_from_db()
    assert removal.removed_at is None and removal.attempts == 1 and "live" in removal.last_error


def test_a_node_that_is_down_or_unreachable_is_tried_again_next_hour():
    down, silent = node_make(state=Node.State.DOWN), node_make()  # silent: its address answers nothing
    user = _user("far")
    _used(user, days_ago=300, node=down)
    _used(user, days_ago=300, node=silent)
    homes_retention_task()
    _due_now(*_pending(user=user))

    outcome = homes_retention_task()

    assert (outcome.get("node_down"), outcome.get("unreachable")) == (1, 1)
    assert _pending(user=user).count() == 2
    assert {r.node_id: r.attempts for r in _pending(user=user)} == {down.id: 1, silent.id: 1}
    assert len(home_removals_due(now=timezone.now())) == 2  # still due: the next run tries again


@pytest.mark.slow
def test_a_local_home_is_removed_by_its_nodes_agent(start_agent, tmp_path):  # noqa: F811
    agent = start_agent(tmp_path / "state", "--sandbox", "none", "--vgpu-lib", str(tmp_path / "no-vgpu.so"))
    node = Node.objects.create(
        name="gpu-real",
        address=agent.url,
        token_hash=token_hash(NODE_TOKEN),
        token_sealed=seal(NODE_TOKEN),
    )
    user, neighbour = _user("cy"), _user("di")
    _used(user, days_ago=300, node=node)
    home = _home(agent.state_dir / "homes", workload_user(user))
    other = _home(agent.state_dir / "homes", workload_user(neighbour))
    (home / "to-other").symlink_to(other)
    homes_retention_task()
    _due_now(_pending(user=user).get())

    assert homes_retention_task()["removed"] == 1

    assert not home.exists() and (other / "notes.txt").read_text() == "mine"
    assert HomeRemoval.objects.get(user=user).removed_at is not None
    assert homes_retention_task() == {"planned": 0, "warned": 0}
