"""The idle stop's signs of use, as heartbeats bring them (provisioner/services/heartbeats.py): each one
alone keeps a session in use, none of them leaves it idle, garbage in any is ignored, and use clears a
live idle warning. Heartbeats go through the real service, or the API where the HTTP answer matters."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from provisioner.models import Session, StopWarning
from provisioner.services.sessions import session_launch
from tests.provisioner.conftest import A100, ENV, beat, gpu, make_node, make_user, workload_status
from tests.provisioner.test_heartbeat_api import post

pytestmark = pytest.mark.django_db
LONG_AGO = timedelta(hours=1)
QUIET = {"last_activity": None, "busy_kernels": 0, "connections": 0}


@pytest.fixture
def node_and_token(catalog):
    return make_node("node-a", [gpu(0, "GPU-a-0")], sharing_policy="best-effort")


def running(node, profile: str = "whole") -> Session:
    user = make_user()
    session = session_launch(
        user=user, account=user.account, gpu_model=A100, profile=profile, environment=ENV,
        max_hours=1, idle_minutes=30, idempotency_key=None,
    ).session  # fmt: skip
    beat(node, [workload_status(session, "running")])
    session.refresh_from_db()
    assert session.state == "running"
    return session


def activity(**fields) -> dict:
    """An agent's activity report: quiet in every sign unless ``fields`` say otherwise."""
    jupyter = {key: fields.pop(key) for key in list(fields) if key in QUIET}
    return {
        "jupyter": {**QUIET, **jupyter},
        "cpu_seconds": None,
        "gpu_util_percent": 0,
        "gpu_memory_bytes": 0,
        **fields,
    }


def in_use_after(node, session: Session, report: dict | None, *, metrics=None, **status) -> bool:
    """Send one heartbeat for a session idle since long ago (with this activity ``report``, device
    ``metrics`` and workload ``status`` fields); whether it restarted the session's idle clock."""
    idle_since = timezone.now() - LONG_AGO
    Session.objects.filter(id=session.id).update(last_active_at=idle_since)
    extra = {"activity": report} if report is not None else {}
    beat(node, [workload_status(session, "running", **extra, **status)], metrics=metrics)
    return Session.objects.get(id=session.id).last_active_at != idle_since


def cpu_reported_before(session: Session, cpu_seconds: float, seconds_ago: float) -> None:
    Session.objects.filter(id=session.id).update(
        cpu_seconds=cpu_seconds, cpu_seen_at=timezone.now() - timedelta(seconds=seconds_ago)
    )


def test_a_session_with_no_sign_of_use_stays_idle(node_and_token):
    node, _ = node_and_token
    session = running(node)
    cpu_reported_before(session, 100.0, 10)
    long_ago = (timezone.now() - LONG_AGO).isoformat()
    # 1 % of a core, a kernel last active an hour ago, the GPU under its threshold
    report = activity(last_activity=long_ago, cpu_seconds=100.1, gpu_util_percent=2)
    assert not in_use_after(node, session, report)


@pytest.mark.parametrize(
    "sign",
    [
        {"busy_kernels": 1},
        {"last_activity": "now"},
        {"connections": 1},
        {"gpu_util_percent": 50},
        {"cpu_seconds": 101.0},  # one CPU second in ten: 10 % of a core
    ],
    ids=["kernel-busy", "recent-activity", "browser-connected", "gpu", "cpu"],
)
def test_each_sign_of_use_alone_keeps_the_session_in_use(node_and_token, sign):
    node, _ = node_and_token
    session = running(node)
    cpu_reported_before(session, 100.0, 10)
    if sign.get("last_activity") == "now":
        sign = {"last_activity": timezone.now().isoformat().replace("+00:00", "Z")}
    assert in_use_after(node, session, activity(**{"cpu_seconds": 100.1, **sign}))


def test_a_connected_browser_counts_only_when_the_setting_says_so(node_and_token, settings):
    node, _ = node_and_token
    session = running(node)
    settings.SESSION_IDLE_COUNT_CONNECTED = False
    assert not in_use_after(node, session, activity(connections=2))
    settings.SESSION_IDLE_COUNT_CONNECTED = True
    assert in_use_after(node, session, activity(connections=2))


def test_cpu_use_is_measured_between_two_reports_and_a_figure_that_went_down_is_none(
    node_and_token, settings
):
    node, _ = node_and_token
    settings.SESSION_IDLE_CPU_PERCENT = 20.0
    session = running(node)
    assert not in_use_after(node, session, activity(cpu_seconds=5000.0))  # the first figure: no baseline
    stored = Session.objects.get(id=session.id)
    assert stored.cpu_seconds == 5000.0 and stored.cpu_seen_at is not None
    cpu_reported_before(session, 5000.0, 10)
    assert not in_use_after(node, session, activity(cpu_seconds=5001.5))  # 15 % < 20 %
    cpu_reported_before(session, 5000.0, 10)
    assert in_use_after(node, session, activity(cpu_seconds=5002.5))  # 25 %
    cpu_reported_before(session, 5000.0, 10)
    assert not in_use_after(node, session, activity(cpu_seconds=10.0))  # went down: a fresh baseline
    assert Session.objects.get(id=session.id).cpu_seconds == 10.0


def test_the_device_wide_utilisation_counts_only_without_per_process_figures_on_a_whole_device(
    node_and_token,
):
    node, _ = node_and_token
    whole = running(node)
    busy_device = [{"uuid": "GPU-a-0", "gpu_util_percent": 80}]
    no_figure = activity(gpu_util_percent=None)
    assert in_use_after(node, whole, no_figure, metrics=busy_device)
    assert not in_use_after(node, whole, activity(gpu_util_percent=0), metrics=busy_device)
    Session.objects.filter(id=whole.id).update(slot_count=4)  # a half: others' work is not its own
    assert not in_use_after(node, whole, no_figure, metrics=busy_device)


def test_an_older_agents_per_session_gpu_figure_still_counts(node_and_token):
    node, _ = node_and_token
    session = running(node)
    assert in_use_after(node, session, None, gpu_util_percent=80)
    assert not in_use_after(node, session, None, gpu_util_percent=1)


GARBAGE = [
    "nonsense",
    {"jupyter": "busy", "cpu_seconds": "lots", "gpu_util_percent": 900, "gpu_memory_bytes": -1},
    {"jupyter": {"last_activity": "yesterday", "busy_kernels": True, "connections": -3}},
    {"jupyter": {"last_activity": "2026-02-30T00:00:00Z", "busy_kernels": 1.5, "connections": "2"}},
    {"cpu_seconds": 1e300, "gpu_util_percent": -5},
    {"cpu_seconds": [1], "gpu_util_percent": {"sm": 99}},
]


@pytest.mark.parametrize("report", GARBAGE)
def test_garbage_in_the_activity_is_ignored_and_the_heartbeat_recorded(node_and_token, report):
    node, token = node_and_token
    session = running(node)
    cpu_reported_before(session, 100.0, 10)
    idle_since = timezone.now() - LONG_AGO
    Session.objects.filter(id=session.id).update(last_active_at=idle_since)
    body = {
        "inventory": {"gpus": [gpu(0, "GPU-a-0")]},
        "workloads": [workload_status(session, "running", activity=report)],
    }
    response = post(token, body)
    assert response.status_code == 200, response.content
    stored = Session.objects.get(id=session.id)
    assert stored.last_active_at == idle_since  # no sign of use read from garbage
    assert stored.last_alive_at > idle_since  # and the rest recorded
    assert stored.cpu_seconds == 100.0


def test_garbage_in_one_figure_leaves_the_others_read(node_and_token):
    node, _ = node_and_token
    session = running(node)
    report = activity(busy_kernels="many", connections=1, cpu_seconds="lots")
    assert in_use_after(node, session, report)


def test_use_clears_a_live_idle_warning_and_no_other(node_and_token):
    node, _ = node_and_token
    session = running(node)
    due = timezone.now() + timedelta(minutes=5)
    idle = StopWarning.objects.create(session=session, kind="idle", due_at=due, message_key="idle_warning")
    funds = StopWarning.objects.create(session=session, kind="funds", due_at=due, message_key="idle_warning")
    assert not in_use_after(node, session, activity())
    assert StopWarning.objects.get(id=idle.id).cleared_at is None
    assert in_use_after(node, session, activity(busy_kernels=1))
    assert StopWarning.objects.get(id=idle.id).cleared_at is not None
    assert StopWarning.objects.get(id=funds.id).cleared_at is None
