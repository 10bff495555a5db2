"""Every stop the portal decides on its own is warned first: idle, the longest time, funds, budgets."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from billing.models import Meter
from billing.services.metering import metering_tick
from billing.services.topups import wallet_credit_promotion
from notices.models import Notice
from provisioner.models import Session, SessionEvent, StopWarning
from provisioner.quotas import quota_set
from provisioner.services.budgets import budgets_enforce
from provisioner.services.limits import sessions_enforce_limits
from provisioner.services.sessions import session_launch
from tests.provisioner.conftest import A100, ENV, beat, gpu, make_node, make_user, workload_status
from tests.provisioner.factories import team_make

pytestmark = pytest.mark.django_db


@pytest.fixture
def node(catalog):
    node, _token = make_node("node-w", [gpu(i, f"GPU-w-{i}") for i in range(4)])
    return node


def launch(user, account=None, **fields) -> Session:
    args = {"gpu_model": A100, "profile": "whole", "environment": ENV, "max_hours": 1, "idle_minutes": 30}
    return session_launch(
        user=user, account=account or user.account, idempotency_key=None, **{**args, **fields}
    ).session


def running(node, *sessions: Session) -> list[Session]:
    beat(node, [workload_status(s, "running") for s in sessions])
    for s in sessions:
        s.refresh_from_db()
        assert s.state == "running"
    return list(sessions)


def live(session: Session, kind: str):
    return StopWarning.objects.filter(session=session, kind=kind, cleared_at__isnull=True).first()


def notices_of(user, kind="stop_warning"):
    return list(Notice.objects.filter(user=user, kind=kind))


def test_the_longest_time_is_warned_before_the_stop(node, sent_tasks, settings):
    settings.SESSION_STOP_WARN_SECONDS = 300
    user = make_user()
    (session,) = running(node, launch(user, max_hours=1, idle_minutes=120))
    assert sessions_enforce_limits(now=session.running_at + timedelta(minutes=50))["warned"] == 0
    counts = sessions_enforce_limits(now=session.running_at + timedelta(minutes=56))
    assert counts["warned"] == 1 and counts["max_duration"] == 0
    warning = live(session, "max_hours")
    assert warning.due_at == session.running_at + timedelta(hours=1)
    assert "about 4 minutes" in warning.message_display and "home folder is kept" in warning.message_display
    assert [n.url for n in notices_of(user)] == [f"/sessions/{session.id}/"]
    assert sessions_enforce_limits(now=session.running_at + timedelta(minutes=58))["warned"] == 0  # once
    assert len(notices_of(user)) == 1
    sessions_enforce_limits(now=session.running_at + timedelta(hours=1, seconds=1))
    session.refresh_from_db()
    assert session.state == "stopping"
    beat(node, [])
    assert StopWarning.objects.get(id=warning.id).cleared_at is not None  # the session ended


def test_activity_clears_a_live_idle_warning(node, sent_tasks, settings):
    settings.SESSION_STOP_WARN_SECONDS = 300
    user = make_user()
    (session,) = running(node, launch(user, idle_minutes=10))
    sessions_enforce_limits(now=session.last_active_at + timedelta(seconds=320))
    assert live(session, "idle") is not None
    beat(node, [workload_status(session, "running", gpu_util_percent=90)])
    assert live(session, "idle") is None
    assert sessions_enforce_limits()["idle"] == 0


def test_funds_running_out_are_warned_once_then_stopped_with_nothing_billed_after(
    node, sent_tasks, settings, django_capture_on_commit_callbacks
):
    settings.BILLING_RUNWAY_WARN_SECONDS = 600
    settings.BILLING_POSTING_INTERVAL_SECONDS = 60  # warned at most that much ahead: under 11 minutes
    user = make_user(funds=3_000_000)  # 15 minutes of an A100 at 12/h
    (session,) = running(node, launch(user))
    start = session.running_at

    def tick(minutes: float):
        at = start + timedelta(minutes=minutes)
        Meter.objects.filter(session_ref=str(session.id)).update(alive_until=at)
        with django_capture_on_commit_callbacks(execute=True):
            return metering_tick(now=at)

    tick(2)
    assert live(session, "funds") is None
    tick(6)  # 9 minutes left: under the 10-minute warning
    warning = live(session, "funds")
    assert warning is not None and "top up" in warning.message_display
    assert len(notices_of(user)) == 1
    tick(8)
    assert StopWarning.objects.filter(session=session, kind="funds").count() == 1  # warned once
    assert len(notices_of(user)) == 1
    tick(16)
    session.refresh_from_db()
    assert session.state == "stopping" and "funds exhausted" in session.reason
    beat(node, [])
    meter = Meter.objects.get(session_ref=str(session.id))
    billed = meter.billed_seconds
    tick(30)
    meter.refresh_from_db()
    assert meter.state == "closed" and meter.billed_seconds == billed  # nothing billed after the stop


def test_a_top_up_clears_the_funds_warning(node, sent_tasks, settings, django_capture_on_commit_callbacks):
    settings.BILLING_RUNWAY_WARN_SECONDS = 600
    user = make_user(funds=3_000_000)
    (session,) = running(node, launch(user))
    at = session.running_at + timedelta(minutes=6)
    Meter.objects.filter(session_ref=str(session.id)).update(alive_until=at)
    with django_capture_on_commit_callbacks(execute=True):
        metering_tick(now=at)
    assert live(session, "funds") is not None
    wallet_credit_promotion(account=user.account, amount_micros=100_000_000, idempotency_key="top-up-1")
    with django_capture_on_commit_callbacks(execute=True):
        metering_tick(now=at + timedelta(seconds=30))
    assert live(session, "funds") is None
    assert (
        Meter.objects.get(session_ref=str(session.id)).runway_warned_at is None
    )  # warned again if low again


def _spend(session: Session, micros: int) -> None:
    Meter.objects.filter(session_ref=str(session.id)).update(charged_micros=micros)


def test_a_member_over_their_budget_has_only_their_own_sessions_stopped(node, sent_tasks, settings):
    settings.SESSION_STOP_WARN_SECONDS = 300
    owner, member = make_user(), make_user()
    team = team_make(owner, members=[member])
    quota_set(user=member, account=team.account, limits={"monthly_spend_cap_micros": 10_000_000})
    theirs, owners = running(node, launch(member, team.account), launch(owner, team.account))
    mine = running(node, launch(member))[0]  # the member's own account: not the team's budget
    _spend(theirs, 5_000_000)
    now = timezone.now()
    assert budgets_enforce(now=now)["warned"] == 0
    assert [n.message_params["percent"] for n in notices_of(member, "budget_threshold")] == [50]
    assert [n.message_params["percent"] for n in notices_of(owner, "budget_threshold")] == [50]  # a manager
    _spend(theirs, 10_000_000)
    counts = budgets_enforce(now=now)
    assert counts["warned"] == 1
    assert (
        live(theirs, "budget") is not None and live(owners, "budget") is None and live(mine, "budget") is None
    )
    assert "Your share of this team" in live(theirs, "budget").message_display
    assert sorted(n.message_params["percent"] for n in notices_of(member, "budget_threshold")) == [50, 100]
    assert budgets_enforce(now=now + timedelta(seconds=60))["stopped"] == 0  # not yet due
    assert budgets_enforce(now=now + timedelta(seconds=301))["stopped"] == 1
    states = {s.id: Session.objects.get(id=s.id).state for s in (theirs, owners, mine)}
    assert states == {theirs.id: "stopping", owners.id: "running", mine.id: "running"}
    assert "monthly budget reached" in Session.objects.get(id=theirs.id).reason


def test_a_raised_budget_clears_the_warning(node, sent_tasks, settings):
    user = make_user()
    quota_set(user=user, limits={"monthly_card_cap_micros": 1_000_000})
    (session,) = running(node, launch(user))
    Meter.objects.filter(session_ref=str(session.id)).update(card_charged_micros=1_000_000)
    budgets_enforce()
    assert live(session, "budget") is not None
    assert "You reached this month's budget" in live(session, "budget").message_display
    quota_set(user=user, limits={"monthly_card_cap_micros": 5_000_000})
    assert budgets_enforce()["cleared"] == 1
    assert live(session, "budget") is None


def test_a_budget_is_enforced_by_the_metering_tick(node, sent_tasks, django_capture_on_commit_callbacks):
    user = make_user()
    quota_set(user=user, limits={"monthly_spend_cap_micros": 1_000_000})
    (session,) = running(node, launch(user))
    at = session.running_at + timedelta(minutes=10)  # 2.00 at 12/h: twice the budget
    Meter.objects.filter(session_ref=str(session.id)).update(alive_until=at)
    with django_capture_on_commit_callbacks(execute=True):
        metering_tick(now=at)
    assert live(session, "budget") is not None
    assert SessionEvent.objects.filter(session=session, kind="budget_warning").count() == 1
