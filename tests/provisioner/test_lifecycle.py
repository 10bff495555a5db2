"""The session lifecycle past launch: start timeouts, idle and longest-session stops, funds exhausted,
the queue dispatching when capacity frees, cancelling a queued session. The agent's side comes in
through the real heartbeat service, as the agent would send it."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone, translation

from billing.models import Meter
from billing.services.metering import metering_tick
from notices.models import Notice
from provisioner.models import Allocation, Session, SessionEvent, StopWarning
from provisioner.services.heartbeats import nodes_liveness_sweep
from provisioner.services.limits import sessions_enforce_limits
from provisioner.services.sessions import (
    queue_dispatch,
    session_end,
    session_launch,
    session_mark_running,
    session_stop,
)
from provisioner.tasks import session_start_task, sessions_enforce_limits_task
from tests.provisioner.conftest import A100, ENV, beat, fund, gpu, make_node, make_user, workload_status

pytestmark = pytest.mark.django_db


@pytest.fixture
def node(catalog):
    node, _token = make_node("node-a", [gpu(0, "GPU-a-0")])
    return node


def launch(user=None, **fields) -> Session:
    user = user or make_user()
    args = {
        "gpu_model": A100,
        "profile": "whole",
        "environment": ENV,
        "max_hours": 1,
        "idle_minutes": 30,
        "idempotency_key": None,
        **fields,
    }
    return session_launch(user=user, account=user.account, **args).session


def running(node, session: Session) -> Session:
    beat(node, [workload_status(session, "running")])
    session.refresh_from_db()
    assert session.state == "running"
    return session


def test_a_start_that_times_out_fails_and_frees_the_allocation(node, sent_tasks, settings):
    settings.SESSION_START_TIMEOUT_SECONDS = 60
    session = launch()
    assert Allocation.objects.filter(session=session).exists()
    Session.objects.filter(id=session.id).update(placed_at=timezone.now() - timedelta(seconds=61))
    assert session_start_task.apply(args=[str(session.id)]).get() == "timeout"
    session.refresh_from_db()
    assert session.state == "failed"
    assert "did not start within 60 s" in session.reason
    assert not Allocation.objects.filter(session=session).exists()
    assert ("workload_delete_task", (node.id, str(session.id))) in sent_tasks
    assert not Meter.objects.filter(session_ref=str(session.id)).exists()  # never ran: never billed


def test_a_heartbeat_timed_before_the_start_poll_does_not_move_the_last_alive_time_back(
    node, sent_tasks, settings
):
    """A heartbeat takes its time when it locks the node; the start poll may mark the session running,
    at the poll's later time, before that heartbeat reads the session and finds it running."""
    session = launch()
    polled_at = timezone.now() + timedelta(seconds=1)  # the poll's time, after the heartbeat's below
    session_mark_running(session_id=session.id, upstream="http://127.0.0.1:45678", at=polled_at)
    beat(node, [workload_status(session, "running")])
    session.refresh_from_db()
    assert session.last_alive_at == session.running_at == polled_at
    # the node then dies: the session is lost, billed no further than its last alive time
    assert nodes_liveness_sweep(now=polled_at + timedelta(seconds=settings.NODE_LIVENESS_SECONDS + 1))
    session.refresh_from_db()
    meter = Meter.objects.get(session_ref=str(session.id))
    assert session.state == "lost" and meter.state == "closed"
    assert meter.billed_until <= session.last_alive_at


def test_the_limits_sweep_fails_starts_that_hang(node, sent_tasks, settings):
    settings.SESSION_START_TIMEOUT_SECONDS = 60
    session = launch()
    beat(node, [workload_status(session, "starting")])
    assert Session.objects.get(id=session.id).state == "starting"
    Session.objects.filter(id=session.id).update(placed_at=timezone.now() - timedelta(seconds=120))
    sessions_enforce_limits_task.apply().get()
    assert Session.objects.get(id=session.id).state == "failed"
    assert not Allocation.objects.exists()


def test_an_idle_session_is_warned_then_stopped(node, sent_tasks, settings):
    settings.SESSION_STOP_WARN_SECONDS = 300
    session = running(node, launch(idle_minutes=10))
    start = session.last_active_at
    assert sessions_enforce_limits(now=start + timedelta(seconds=200)) == {
        "max_duration": 0,
        "idle": 0,
        "warned": 0,
    }
    assert sessions_enforce_limits(now=start + timedelta(seconds=320))["warned"] == 1
    warning = SessionEvent.objects.get(session=session, kind="idle_warning")
    assert "stops in about" in warning.message and "home folder is kept" in warning.message
    assert sessions_enforce_limits(now=start + timedelta(seconds=400))["warned"] == 0  # warned once
    assert sessions_enforce_limits(now=start + timedelta(seconds=601))["idle"] == 1
    session.refresh_from_db()
    assert session.state == "stopping" and "idle" in session.reason
    beat(node, [])  # the agent no longer runs it
    session.refresh_from_db()
    assert session.state == "stopped"
    assert not Allocation.objects.exists()
    assert Meter.objects.get(session_ref=str(session.id)).state == "closed"


def test_activity_resets_the_idle_clock_and_the_warning(node, sent_tasks, settings):
    settings.SESSION_STOP_WARN_SECONDS = 300
    session = running(node, launch(idle_minutes=10))
    Session.objects.filter(id=session.id).update(last_active_at=timezone.now() - timedelta(seconds=400))
    assert sessions_enforce_limits()["warned"] == 1
    beat(node, [workload_status(session, "running", gpu_util_percent=80)])
    assert not StopWarning.objects.filter(session=session, cleared_at__isnull=True).exists()
    assert sessions_enforce_limits()["idle"] == 0
    assert Session.objects.get(id=session.id).state == "running"


def test_the_longest_session_time_stops_it(node, sent_tasks):
    session = running(node, launch(max_hours=1))
    counts = sessions_enforce_limits(now=session.running_at + timedelta(hours=1, seconds=1))
    assert counts["max_duration"] == 1
    session.refresh_from_db()
    assert session.state == "stopping" and "longest session time" in session.reason


def test_funds_exhausted_stops_the_session(node, sent_tasks, django_capture_on_commit_callbacks):
    user = make_user(funds=2_100_000)  # 10.5 minutes of an A100 at 12/h
    session = running(node, launch(user))
    later = session.running_at + timedelta(minutes=20)
    Meter.objects.filter(session_ref=str(session.id)).update(alive_until=later)
    with django_capture_on_commit_callbacks(execute=True):
        result = metering_tick(now=later)
    assert str(session.id) in result.exhausted_session_refs
    session.refresh_from_db()
    assert session.state == "stopping" and "funds exhausted" in session.reason
    assert ("session_stop_task", (str(session.id),)) in sent_tasks


def test_a_queued_session_is_dispatched_when_capacity_frees(node, sent_tasks):
    first = running(node, launch())
    waiting = launch()
    assert waiting.state == "queued"
    assert queue_dispatch() == 0  # nothing free yet
    session_stop(session=first, actor=None, reason="done")
    beat(node, [])  # the agent confirms the first workload gone: its slots are freed
    assert Session.objects.get(id=first.id).state == "stopped"
    assert queue_dispatch() == 1
    waiting.refresh_from_db()
    assert waiting.state == "placing"
    assert waiting.device.uuid == "GPU-a-0"
    assert Allocation.objects.get().session_id == waiting.id


def test_the_queue_is_fair_between_accounts(node, sent_tasks):
    first = running(node, launch())
    greedy, polite = make_user(), make_user()
    greedy_one = launch(greedy)
    greedy_two = launch(greedy)
    polite_one = launch(polite)
    assert {s.state for s in (greedy_one, greedy_two, polite_one)} == {"queued"}
    from provisioner.selectors import queue_place

    assert [queue_place(session=s).position for s in (greedy_one, polite_one, greedy_two)] == [1, 2, 3]
    session_stop(session=first, actor=None, reason="done")
    beat(node, [])
    queue_dispatch()
    assert Session.objects.get(id=greedy_one.id).state == "placing"
    assert queue_place(session=Session.objects.get(id=polite_one.id)).position == 1


def test_a_queued_session_can_be_cancelled(node, sent_tasks):
    running(node, launch())
    waiting = launch()
    session_stop(session=waiting, actor=waiting.owner, reason="changed my mind")
    stopped = Session.objects.get(id=waiting.id)
    assert stopped.state == "stopped"
    assert stopped.reason.startswith("Cancelled")
    assert stopped.ended_at is not None
    assert queue_dispatch() == 0
    assert Session.objects.get(id=waiting.id).state == "stopped"
    assert not Allocation.objects.filter(session=waiting).exists()


def test_a_session_waiting_past_its_longest_wait_fails(node, sent_tasks):
    running(node, launch())
    waiting = launch()
    Session.objects.filter(id=waiting.id).update(queued_at=timezone.now() - timedelta(hours=2))
    queue_dispatch()
    waiting.refresh_from_db()
    assert waiting.state == "failed" and "queue" in waiting.reason


def test_a_workload_that_exits_ends_the_session_and_frees_its_slots(node, sent_tasks):
    session = running(node, launch())
    beat(node, [workload_status(session, "exited", exit_reason="exit code 1")])
    session.refresh_from_db()
    assert session.state == "stopped" and "exit code 1" in session.reason
    beat(node, [])
    assert not Allocation.objects.exists()


def test_the_owner_is_told_when_a_session_starts_ends_and_leaves_the_queue(
    node, sent_tasks, django_capture_on_commit_callbacks
):
    with django_capture_on_commit_callbacks(execute=True):
        first = running(node, launch())
        waiting = launch()
        session_stop(session=first, actor=None, reason="done")
        beat(node, [])  # the agent confirms it gone: "Stopped", for the reason it was asked to stop
        assert queue_dispatch() == 1
        beat(node, [workload_status(waiting, "running")])  # a repeat tells nobody twice
    told = sorted((n.user_id, n.kind) for n in Notice.objects.all())
    assert told == sorted(
        [
            (first.owner_id, "session_started"),
            (first.owner_id, "session_stopped"),
            (waiting.owner_id, "session_placed"),
            (waiting.owner_id, "session_started"),
        ]
    )
    ended = Notice.objects.get(kind="session_stopped")
    assert ended.text == "Your A100-SXM4-80GB whole session ended: Stop: done"
    assert ended.url == f"/sessions/{first.id}/"
    with translation.override("zh-hans"):
        assert ended.text != "Your A100-SXM4-80GB whole session ended: Stop: done"


def test_an_owner_who_stops_their_own_session_is_not_told_anyone_elses_stop_is(
    node, sent_tasks, django_capture_on_commit_callbacks
):
    """Their page shows the stop they clicked; a notice and an email about it are noise. A stop by
    someone else (an operator, a team's admin) is told, as every stop the portal makes."""
    operator = make_user("operator-on-call")
    with django_capture_on_commit_callbacks(execute=True):
        mine = running(node, launch())
        session_stop(session=mine, actor=mine.owner, reason="done for today")
        beat(node, [])  # the agent confirms it gone
        theirs = running(node, launch())
        session_stop(session=theirs, actor=operator, reason="maintenance")
        beat(node, [])
    ended = Notice.objects.filter(kind="session_stopped")
    assert [(n.user_id, n.text) for n in ended] == [
        (theirs.owner_id, "Your A100-SXM4-80GB whole session ended: Stop by operator-on-call: maintenance")
    ]
    queued = launch()
    with django_capture_on_commit_callbacks(execute=True):
        session_stop(session=queued, actor=queued.owner, reason="changed my mind")  # a cancel, too
    assert not Notice.objects.filter(user=queued.owner, kind="session_stopped").exists()


def test_a_cancelled_queued_session_tells_its_owner(node, sent_tasks, django_capture_on_commit_callbacks):
    running(node, launch())
    waiting = launch()
    with django_capture_on_commit_callbacks(execute=True):
        session_stop(session=waiting, actor=None, reason="changed my mind")
    assert Notice.objects.get(user=waiting.owner, kind="session_stopped").text.endswith(
        "ended: Cancelled: changed my mind"
    )


def test_runway_low_tells_the_payer_and_warns_the_session_owners(
    node, sent_tasks, settings, django_capture_on_commit_callbacks
):
    settings.BILLING_RUNWAY_WARN_SECONDS = 3600
    from portal.services import team_create

    lead, student = make_user(), make_user(funds=0)
    team = team_create(creator=lead, name="Lab")
    fund(team.account, 2_100_000)  # 10.5 minutes of an A100 at 12/h
    session = session_launch(
        user=lead, account=team.account, gpu_model=A100, profile="whole", environment=ENV,
        max_hours=1, idle_minutes=30, idempotency_key=None,
    ).session  # fmt: skip
    Session.objects.filter(id=session.id).update(owner=student)  # a member's session on the team wallet
    with django_capture_on_commit_callbacks(execute=True):
        running(node, Session.objects.get(id=session.id))
        started_at = Meter.objects.get(session_ref=str(session.id)).started_at
        metering_tick(now=started_at + timedelta(seconds=10))
        metering_tick(now=started_at + timedelta(seconds=20))  # warned once
    low = Notice.objects.filter(kind="runway_low")
    assert [n.user_id for n in low] == [lead.id]  # the payer, who can top up
    assert "Lab" in low[0].text and "minutes" in low[0].text
    (warned,) = Notice.objects.filter(kind="stop_warning")  # the owner: their session stops
    assert warned.user_id == student.id and "Funds are running out" in warned.text


# --- the queue's rule for multi-GPU requests ------------------------------------------------------------


@pytest.fixture
def two_nodes(catalog):
    """node-a with two A100s (room for a 2x), node-b with one."""
    node_a, _token = make_node("node-a", [gpu(0, "GPU-a-0"), gpu(1, "GPU-a-1")])
    node_b, _token = make_node("node-b", [gpu(0, "GPU-b-0")])
    return node_a, node_b


def _end(session: Session) -> None:
    session_end(session_id=session.id, to="stopped", reason="done")


def _waiting_2x_behind_a_full_fleet(two_nodes) -> tuple[Session, Session, dict]:
    """Three wholes fill both nodes; then a 2x and a whole wait, in that order; one whole on each node
    ends, so node-a has one free GPU (not enough for the 2x) and node-b one."""
    node_a, _node_b = two_nodes
    wholes = [launch() for _ in range(3)]
    assert {w.state for w in wholes} == {"placing"}
    large = launch(profile="2x")
    small = launch()
    assert (large.state, small.state) == ("queued", "queued")
    on_a = [w for w in wholes if w.node_id == node_a.id]
    _end(on_a[0])
    _end(next(w for w in wholes if w.node_id != node_a.id))
    return large, small, {"node_a": on_a[1]}


def test_a_small_request_passes_a_multi_gpu_one_that_does_not_fit(two_nodes, sent_tasks, settings):
    settings.QUEUE_LARGE_RESERVE_SECONDS = 600
    large, small, _held = _waiting_2x_behind_a_full_fleet(two_nodes)
    assert queue_dispatch() == 1
    large.refresh_from_db()
    small.refresh_from_db()
    assert (large.state, small.state) == ("queued", "placing")  # the whole went by the 2x
    assert large.reserved_node is None
    assert launch().state == "placing"  # nothing is held for the 2x yet: the last free GPU goes too


def test_a_multi_gpu_request_that_waited_reserves_its_node_until_it_fits(two_nodes, sent_tasks, settings):
    settings.QUEUE_LARGE_RESERVE_SECONDS = 600
    node_a, node_b = two_nodes
    large, small, held = _waiting_2x_behind_a_full_fleet(two_nodes)
    Session.objects.filter(id=large.id).update(queued_at=timezone.now() - timedelta(seconds=601))
    assert queue_dispatch() == 1
    large.refresh_from_db()
    small.refresh_from_db()
    assert large.state == "queued" and large.reserved_node_id == node_a.id
    assert small.state == "placing" and small.node_id == node_b.id  # only node-a is held
    assert SessionEvent.objects.filter(session=large, message_key="reserved_node").exists()
    assert launch().state == "queued"  # node-a has a free GPU, but it is the 2x's
    _end(held["node_a"])
    assert queue_dispatch() == 1
    large.refresh_from_db()
    assert large.state == "placing" and large.reserved_node is None
    assert sorted(d.uuid for d in large.gpu_devices()) == ["GPU-a-0", "GPU-a-1"]
