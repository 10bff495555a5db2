from __future__ import annotations

from datetime import timedelta

import pytest

from billing import signals
from billing.models import Meter
from billing.selectors import account_funds
from billing.services.ledger import wallet_for
from billing.services.metering import (
    account_can_launch,
    db_now,
    meter_alive,
    meter_close,
    meter_cost,
    meter_open,
    metering_tick,
)
from billing.services.pricing import price_quote
from core.errors import InsufficientFunds, NotFound
from tests.billing.conftest import A100, assert_ledger_invariants, fund, make_account

pytestmark = pytest.mark.django_db


def _open(account, ref="s1", model=A100, profile="whole", started=None):
    quote = price_quote(gpu_model=model, profile=profile)
    started = started or db_now() - timedelta(hours=2)
    return meter_open(
        account=account, session_ref=ref, gpu_model=model, profile=profile, quote=quote, started_at=started
    )


def test_tick_bills_by_the_second_up_to_last_alive(prices):
    account = make_account()
    fund(account, 100_000_000)
    meter = _open(account)
    meter_alive(session_refs=["s1"], alive_at=meter.started_at + timedelta(seconds=61))
    metering_tick(now=meter.started_at + timedelta(hours=1))
    meter.refresh_from_db()
    assert meter.billed_seconds == 61
    assert meter.charged_micros == 12_000_000 * 61 // 3600
    assert wallet_for(account=account).balance_micros == 100_000_000 - meter.charged_micros
    assert_ledger_invariants()


def test_tick_is_cumulative_and_never_drifts(prices):
    account = make_account()
    fund(account, 100_000_000)
    meter = _open(account, profile="1/8")  # 1,500,000 / h: 416.67 per second
    start = meter.started_at
    meter_alive(session_refs=["s1"], alive_at=start + timedelta(hours=1))
    for second in range(61, 3601, 61):
        metering_tick(now=start + timedelta(seconds=second))
    meter_close(session_ref="s1", ended_at=start + timedelta(hours=5))
    meter.refresh_from_db()
    assert meter.billed_seconds == 3600
    assert meter.charged_micros == 1_500_000
    assert meter.state == Meter.State.CLOSED
    assert_ledger_invariants()


def test_posts_at_most_once_an_interval_and_reads_the_rest_live(prices, settings):
    interval = settings.BILLING_POSTING_INTERVAL_SECONDS
    account = make_account()
    fund(account, 100_000_000)
    meter = _open(account)
    start = meter.started_at
    meter_alive(session_refs=["s1"], alive_at=start + timedelta(seconds=interval + 30))
    metering_tick(now=start + timedelta(seconds=interval))
    posted = meter.transfers.count()
    metering_tick(now=start + timedelta(seconds=interval + 30))
    meter.refresh_from_db()
    # at most one posting an interval, and the tick writes only the meters it posts
    assert meter.transfers.count() == posted
    assert meter.billed_seconds == interval and meter.posted_seconds == interval
    # what ran since is read as of now: up to the last time the agent confirmed it alive
    cost = meter_cost(session_ref="s1")
    assert cost.billed_seconds == interval + 30
    assert cost.accrued_micros == 12_000_000 * (interval + 30) // 3600 - 12_000_000 * interval // 3600
    assert account_funds(account=account).accrued_micros == cost.accrued_micros
    metering_tick(now=start + timedelta(seconds=2 * interval + 1))
    meter.refresh_from_db()
    assert (meter.billed_seconds, meter.posted_seconds) == (interval + 30,) * 2
    assert meter_cost(session_ref="s1").accrued_micros == 0


def test_replayed_tick_bills_nothing_twice(prices):
    account = make_account()
    fund(account, 100_000_000)
    meter = _open(account)
    meter_alive(session_refs=["s1"], alive_at=meter.started_at + timedelta(seconds=600))
    now = meter.started_at + timedelta(seconds=600)
    metering_tick(now=now)
    before = wallet_for(account=account).balance_micros
    metering_tick(now=now)
    metering_tick(now=now + timedelta(minutes=5))
    assert wallet_for(account=account).balance_micros == before
    assert_ledger_invariants()


def test_overshoot_goes_to_overdraft_and_signals_exhaustion(prices):
    account = make_account()
    fund(account, 1_000_000)  # 5 minutes of an A100
    meter = _open(account)
    meter_alive(session_refs=["s1"], alive_at=meter.started_at + timedelta(seconds=600))
    got = []

    def on_exhausted(sender, session_refs, **kwargs):
        got.append(session_refs)

    signals.funds_exhausted.connect(on_exhausted)
    try:
        from django.test import TestCase

        with TestCase.captureOnCommitCallbacks(execute=True):
            result = metering_tick(now=meter.started_at + timedelta(seconds=600))
    finally:
        signals.funds_exhausted.disconnect(on_exhausted)
    assert result.exhausted_session_refs == ["s1"]
    assert got == [["s1"]]
    cost = meter_cost(session_ref="s1")
    assert cost.wallet_micros == 1_000_000
    assert cost.overdraft_micros == 2_000_000 - 1_000_000
    fund(account, 5_000_000)  # the overdraft is recovered first
    assert wallet_for(account=account).balance_micros == 4_000_000
    assert_ledger_invariants()


def test_runway_low_warns_once(prices):
    account = make_account()
    fund(account, 1_500_000)  # 7.5 minutes of an A100
    meter = _open(account)
    got = []

    def on_low(sender, account_id, runway_seconds, session_refs, **kwargs):
        got.append((account_id, runway_seconds, session_refs))

    signals.runway_low.connect(on_low)
    try:
        from django.test import TestCase

        with TestCase.captureOnCommitCallbacks(execute=True):
            metering_tick(now=meter.started_at + timedelta(seconds=10))
            metering_tick(now=meter.started_at + timedelta(seconds=20))
    finally:
        signals.runway_low.disconnect(on_low)
    assert got == [(account.id, 450, ["s1"])]


def test_an_account_told_its_runway_is_short_is_watched_every_tick_between_postings(prices, settings):
    """Between a meter's postings the tick does not read it, unless its account was told its funds are
    short: then the end of the funds is seen at the first tick after, not at the next posting."""
    settings.BILLING_POSTING_INTERVAL_SECONDS = 300
    settings.BILLING_RUNWAY_WARN_SECONDS = 600
    account = make_account()
    fund(account, 1_500_000)  # 450 s of an A100 at 12/h
    meter = _open(account)
    start = meter.started_at
    meter_alive(session_refs=["s1"], alive_at=start + timedelta(hours=1))
    low, exhausted = [], []

    def on_low(sender, account_id, runway_seconds, session_refs, **kwargs):
        low.append(runway_seconds)

    def on_exhausted(sender, session_refs, **kwargs):
        exhausted.append(session_refs)

    signals.runway_low.connect(on_low)
    signals.funds_exhausted.connect(on_exhausted)
    try:
        from django.test import TestCase

        with TestCase.captureOnCommitCallbacks(execute=True):
            metering_tick(now=start + timedelta(seconds=10))  # not posted yet: a new launch is watched
        assert low == [440]
        with TestCase.captureOnCommitCallbacks(execute=True):
            assert metering_tick(now=start + timedelta(seconds=300)).posted_meters == 1
        assert exhausted == []
        with TestCase.captureOnCommitCallbacks(execute=True):
            result = metering_tick(now=start + timedelta(seconds=455))  # next posting due at 600 s
    finally:
        signals.runway_low.disconnect(on_low)
        signals.funds_exhausted.disconnect(on_exhausted)
    assert result.posted_meters == 0 and result.exhausted_session_refs == ["s1"]
    assert exhausted == [["s1"]]
    meter.refresh_from_db()
    assert meter.posted_seconds == 300  # nothing written to the meter between its postings
    assert account_funds(account=account).runway_seconds <= 0


def test_admission_needs_minutes_of_funds(prices):
    account = make_account()
    quote = price_quote(gpu_model=A100, profile="whole")
    with pytest.raises(InsufficientFunds):
        account_can_launch(account=account, quote=quote, gpu_model=A100)
    fund(account, 2_000_000)  # exactly 10 minutes
    account_can_launch(account=account, quote=quote, gpu_model=A100)


def test_meter_open_is_idempotent_and_close_is_final(prices):
    account = make_account()
    fund(account, 10_000_000)
    first = _open(account)
    assert _open(account).id == first.id
    meter_alive(session_refs=["s1"], alive_at=first.started_at + timedelta(seconds=30))
    closed = meter_close(session_ref="s1", ended_at=first.started_at + timedelta(seconds=100))
    assert closed.billed_seconds == 30  # never past the last alive
    again = meter_close(session_ref="s1", ended_at=first.started_at + timedelta(seconds=500))
    assert again.billed_seconds == 30 and again.charged_micros == closed.charged_micros
    assert meter_alive(session_refs=["s1"], alive_at=first.started_at + timedelta(hours=1)) == 0
    with pytest.raises(NotFound):
        meter_close(session_ref="nope", ended_at=first.started_at)
    assert_ledger_invariants()


def test_tick_uses_database_clock_by_default(prices, settings):
    age = settings.BILLING_POSTING_INTERVAL_SECONDS + 20  # due for its first posting
    account = make_account()
    fund(account, 10_000_000)
    meter = _open(account, started=db_now() - timedelta(seconds=age))
    meter_alive(session_refs=["s1"], alive_at=db_now() + timedelta(hours=1))
    metering_tick()
    meter.refresh_from_db()
    assert age - 1 <= meter.billed_seconds <= age + 5
