"""Warnings before the stops the portal decides, end to end: the portal under uvicorn, a Celery worker and
Celery beat (which runs the metering tick and the limits sweep on their schedules), and a node agent on a
fake A100 fleet, as ``make run`` starts them. The test only launches through the API and watches.

Mail goes to files (EMAIL_URL=file://…): the worker that sends it is another process, so Django's
in-memory outbox could not show it to the test."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from billing.models import Meter
from billing.selectors import account_funds
from provisioner.models import Session, StopWarning
from provisioner.quotas import quota_set
from tests.browser.steps import (
    a100_offer,
    api_for,
    api_launch,
    mail_text,
    product_stack,
    stack_env,
    wait_for_free_gpu,
)
from tests.provisioner.conftest import A100, make_user
from tests.provisioner.factories import team_make
from tests.stack import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.django_db(transaction=True)]
UNIT = 1_000_000  # micros of money; the A100's 1/4 costs 0.25 a second here (steps.a100_offer)


def _stack(tmp_path: Path, **env: str):
    return product_stack(
        tmp_path,
        env=stack_env(
            EMAIL_URL=f"file://{tmp_path / 'mail'}",
            SESSION_LIMITS_SWEEP_SECONDS="1",
            BILLING_POSTING_INTERVAL_SECONDS="1",
            BILLING_ADMISSION_MINUTES="0",
            **env,
        ),
    )


def _launch_running(api, **fields) -> Session:
    session_id = api_launch(api, **fields)
    wait_for(lambda: Session.objects.get(id=session_id).state == "running", 90, 0.3, "the session to run")
    return Session.objects.get(id=session_id)


def _ended(session: Session, timeout: float = 60) -> Session:
    wait_for(lambda: Session.objects.get(id=session.id).state in ("stopped",), timeout, 0.3, "the stop")
    return Session.objects.get(id=session.id)


def test_a_low_funds_session_is_warned_once_then_stopped_with_nothing_billed_after(tmp_path):
    with _stack(tmp_path, BILLING_RUNWAY_WARN_SECONDS="20") as stack:
        a100_offer()
        wait_for_free_gpu(stack)
        user = make_user("lowfunds", funds=15 * UNIT)  # a minute of a 1/4 A100
        session = _launch_running(api_for(stack["web"].url, user))
        wait_for(
            lambda: StopWarning.objects.filter(session=session, kind="funds").exists(), 60, 0.3, "the warning"
        )
        assert "Funds are running out" in mail_text(tmp_path)
        ended = _ended(session)
        assert "funds exhausted" in ended.reason
        assert StopWarning.objects.filter(session=session, kind="funds").count() == 1  # warned once
        assert mail_text(tmp_path).count("Funds are running out") == 1
        meter = Meter.objects.get(session_ref=str(session.id))
        money = account_funds(account=user.account, gpu_model=A100).money_micros
        wait_for(lambda: Meter.objects.get(id=meter.id).state == "closed", 20, 0.3, "the meter to close")
        billed = Meter.objects.get(id=meter.id).billed_seconds
        time.sleep(4)  # several ticks and postings
        assert Meter.objects.get(id=meter.id).billed_seconds == billed
        assert account_funds(account=user.account, gpu_model=A100).money_micros <= money
        after = account_funds(account=user.account, gpu_model=A100).money_micros
        time.sleep(3)
        assert (
            account_funds(account=user.account, gpu_model=A100).money_micros == after
        )  # nothing billed after


def test_a_member_over_their_budget_mid_session_has_only_their_own_session_stopped(tmp_path):
    with _stack(tmp_path, SESSION_STOP_WARN_SECONDS="6") as stack:
        a100_offer()
        wait_for_free_gpu(stack)
        owner, member = make_user("lead", funds=0), make_user("stu", funds=0)
        team = team_make(owner, members=[member], funded_micros=10_000 * UNIT)
        quota_set(user=member, account=team.account, limits={"monthly_spend_cap_micros": 5 * UNIT})  # 20 s
        theirs = _launch_running(api_for(stack["web"].url, member), account=team.account_id)
        owners = _launch_running(api_for(stack["web"].url, owner), account=team.account_id)
        wait_for(
            lambda: StopWarning.objects.filter(session=theirs, kind="budget").exists(), 60, 0.3, "the warning"
        )
        assert "Your share of this team reached this month's budget" in mail_text(tmp_path)
        ended = _ended(theirs)
        assert "monthly budget reached" in ended.reason
        assert Session.objects.get(id=owners.id).state == "running"
        assert not StopWarning.objects.filter(session=owners).exists()
