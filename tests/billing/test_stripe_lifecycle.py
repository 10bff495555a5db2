"""Stripe's whole payment lifecycle through the signed webhook, with events built by the ``stripe``
library's own constructors in the shapes Stripe documents, each replayed 10× concurrently and in a
shuffled order. The ledger is checked after every scenario."""

from __future__ import annotations

import json
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import stripe
from django.db import connection
from django.test import Client

from billing.models import LedgerAccount, StripeEvent, TopUp, TopUpDispute, Transfer
from billing.services.ledger import overdraft_for, system_account, wallet_adjust, wallet_for
from billing.services.metering import account_can_launch
from billing.services.pricing import price_quote
from billing.services.topups import topup_webhook_handle
from core.errors import InsufficientFunds
from tests.billing.conftest import A100, assert_ledger_invariants, make_account, seed_prices

SECRET = "whsec_lifecycle"
KEY = "sk_test_lifecycle"
AMOUNT_MINOR = 5000  # 50.00 CNY
AMOUNT = 50_000_000

_ids = iter(range(10**6))


def _event(kind: str, obj: stripe.StripeObject) -> stripe.Event:
    return stripe.Event.construct_from(
        {
            "id": f"evt_{next(_ids)}_{kind}",
            "object": "event",
            "api_version": "2024-06-20",
            "created": int(time.time()),
            "livemode": False,
            "pending_webhooks": 1,
            "type": kind,
            "data": {"object": obj},
        },
        KEY,
    )


def _session(cs: str, *, pi: str, payment_status: str = "paid", status: str = "complete"):
    return stripe.checkout.Session.construct_from(
        {
            "id": cs,
            "object": "checkout.session",
            "mode": "payment",
            "amount_total": AMOUNT_MINOR,
            "currency": "cny",
            "payment_intent": pi,
            "payment_status": payment_status,
            "status": status,
        },
        KEY,
    )


def _charge(pi: str, *, refunded: int):
    return stripe.Charge.construct_from(
        {
            "id": f"ch_{pi}",
            "object": "charge",
            "amount": AMOUNT_MINOR,
            "amount_refunded": refunded,
            "currency": "cny",
            "payment_intent": pi,
            "refunded": refunded == AMOUNT_MINOR,
            "status": "succeeded",
        },
        KEY,
    )


def _dispute(pi: str, *, status: str, amount: int = AMOUNT_MINOR):
    return stripe.Dispute.construct_from(
        {
            "id": f"dp_{pi}",
            "object": "dispute",
            "amount": amount,
            "charge": f"ch_{pi}",
            "currency": "cny",
            "payment_intent": pi,
            "reason": "fraudulent",
            "status": status,
        },
        KEY,
    )


def _signed(event: stripe.Event) -> tuple[bytes, str]:
    body = json.dumps(event.to_dict()).encode()
    at = int(time.time())
    signature = stripe.WebhookSignature._compute_signature(f"{at}.{body.decode()}", SECRET)
    return body, f"t={at},v1={signature}"


def _replay(events: list[stripe.Event], *, times: int = 10, seed: int = 7) -> list[str]:
    """Every event ``times`` times, shuffled, sent by ``times`` threads at once (own connections)."""
    bodies = [_signed(event) for event in events for _ in range(times)]
    random.Random(seed).shuffle(bodies)
    barrier = threading.Barrier(times)

    def send(item):
        index, (body, header) = item
        if index < times:
            barrier.wait()
        try:
            return topup_webhook_handle(payload=body, signature=header)
        finally:
            connection.close()

    with ThreadPoolExecutor(times) as pool:
        return list(pool.map(send, enumerate(bodies)))


def _topup(cs: str, account=None) -> TopUp:
    return TopUp.objects.create(
        account=account or make_account(), amount_micros=AMOUNT, currency="CNY", checkout_session_id=cs
    )


def _balances(topup: TopUp) -> tuple[int, int]:
    return wallet_for(account=topup.account).balance_micros, overdraft_for(
        account=topup.account
    ).balance_micros


concurrent = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def _webhook_secret(settings):
    settings.STRIPE_WEBHOOK_SECRET = SECRET


@concurrent
def test_completed_and_async_succeeded_credit_once_whatever_the_order():
    topup = _topup("cs_paid")
    events = [
        _event("checkout.session.completed", _session("cs_paid", pi="pi_paid", payment_status="unpaid")),
        _event("checkout.session.async_payment_succeeded", _session("cs_paid", pi="pi_paid")),
    ]
    outcomes = _replay(events)
    assert outcomes.count("credited") == 1
    assert outcomes.count("duplicate") == 18
    topup.refresh_from_db()
    assert topup.state == "paid" and topup.payment_intent_id == "pi_paid"
    assert _balances(topup) == (AMOUNT, 0)
    assert Transfer.objects.filter(kind="topup").count() == 1
    assert StripeEvent.objects.count() == 2
    assert_ledger_invariants()


@concurrent
@pytest.mark.parametrize(
    ("kind", "state"),
    [("checkout.session.expired", "expired"), ("checkout.session.async_payment_failed", "failed")],
)
def test_expired_and_failed_close_the_topup_and_move_nothing(kind, state):
    topup = _topup(f"cs_{state}")
    events = [
        _event(
            "checkout.session.completed", _session(topup.checkout_session_id, pi="", payment_status="unpaid")
        ),
        _event(kind, _session(topup.checkout_session_id, pi="", payment_status="unpaid", status="expired")),
    ]
    outcomes = _replay(events)
    assert outcomes.count(state) == 1
    topup.refresh_from_db()
    assert topup.state == state and topup.closed_at is not None
    assert not Transfer.objects.exists()


@concurrent
def test_refunds_overtaking_their_checkout_are_applied_once_it_is_paid():
    topup = _topup("cs_refund")
    events = [
        _event("checkout.session.completed", _session("cs_refund", pi="pi_refund")),
        _event("charge.refunded", _charge("pi_refund", refunded=2000)),
        _event("charge.refunded", _charge("pi_refund", refunded=AMOUNT_MINOR)),
    ]
    _replay(events)
    topup.refresh_from_db()
    assert topup.refunded_micros == AMOUNT
    assert _balances(topup) == (0, 0)
    refunds = Transfer.objects.filter(kind="refund")
    assert sum(refunds.values_list("amount_micros", flat=True)) == AMOUNT
    assert not StripeEvent.objects.filter(applied_at__isnull=True).exists()
    assert_ledger_invariants()


@concurrent
@pytest.mark.parametrize(("status", "wallet"), [("won", AMOUNT), ("warning_closed", AMOUNT), ("lost", 0)])
def test_a_dispute_holds_the_amount_then_releases_or_reverses_it(status, wallet):
    topup = _topup(f"cs_dp_{status}")
    pi = f"pi_dp_{status}"
    events = [
        _event("checkout.session.completed", _session(topup.checkout_session_id, pi=pi)),
        _event("charge.dispute.created", _dispute(pi, status="needs_response")),
        _event("charge.dispute.closed", _dispute(pi, status=status)),
    ]
    _replay(events, seed=len(status))
    dispute = TopUpDispute.objects.get()
    assert dispute.state == ("lost" if status == "lost" else "won")
    assert _balances(topup) == (wallet, 0)
    assert system_account(kind=LedgerAccount.Kind.DISPUTES).balance_micros == 0
    assert_ledger_invariants()


@pytest.mark.django_db
def test_an_open_dispute_holds_the_money_until_it_closes():
    topup = _topup("cs_open")
    for event in (
        _event("checkout.session.completed", _session("cs_open", pi="pi_open")),
        _event("charge.dispute.created", _dispute("pi_open", status="needs_response", amount=3000)),
    ):
        topup_webhook_handle(payload=_signed(event)[0], signature=_signed(event)[1])
    assert _balances(topup) == (20_000_000, 0)
    assert system_account(kind=LedgerAccount.Kind.DISPUTES).balance_micros == 30_000_000
    assert_ledger_invariants()


@pytest.mark.django_db
def test_a_refund_of_spent_money_goes_into_overdraft_and_blocks_launches_until_covered():
    seed_prices()
    topup = _topup("cs_spent")
    quote = price_quote(gpu_model=A100, profile="whole")
    for event in (
        _event("checkout.session.completed", _session("cs_spent", pi="pi_spent")),
        _event("charge.refunded", _charge("pi_spent", refunded=AMOUNT_MINOR)),
    ):
        if event.type == "charge.refunded":
            wallet_adjust(
                account=topup.account,
                amount_micros=-40_000_000,
                actor=None,
                reason="spent",
                idempotency_key="s",
            )
        body, header = _signed(event)
        topup_webhook_handle(payload=body, signature=header)
    assert _balances(topup) == (0, -40_000_000)
    with pytest.raises(InsufficientFunds) as refused:
        account_can_launch(account=topup.account, quote=quote, gpu_model=A100)
    assert refused.value.code == "account_owes"
    assert "40.00" in refused.value.message
    _topup("cs_again", account=topup.account)
    body, header = _signed(_event("checkout.session.completed", _session("cs_again", pi="pi_again")))
    topup_webhook_handle(payload=body, signature=header)
    assert _balances(topup) == (10_000_000, 0)
    account_can_launch(account=topup.account, quote=quote, gpu_model=A100)
    assert_ledger_invariants()


@pytest.mark.django_db
@pytest.mark.parametrize(
    "kind", ["customer.created", "payment_intent.succeeded", "invoice.paid", "charge.dispute.funds_withdrawn"]
)
def test_events_outside_the_handled_set_are_acknowledged_not_500(kind):
    obj = stripe.StripeObject.construct_from({"id": "obj_1", "object": kind.split(".")[0]}, KEY)
    body, header = _signed(_event(kind, obj))
    response = Client().post(
        "/api/stripe/webhook", body, content_type="application/json", HTTP_STRIPE_SIGNATURE=header
    )
    assert response.status_code == 200
    assert response.json()["outcome"] == "ignored"
    assert not Transfer.objects.exists()


@pytest.mark.django_db
def test_handled_events_without_an_object_are_acknowledged_and_change_nothing():
    body = json.dumps({"id": "evt_bad", "type": "charge.refunded", "data": {"object": "nope"}}).encode()
    at = int(time.time())
    header = f"t={at},v1={stripe.WebhookSignature._compute_signature(f'{at}.{body.decode()}', SECRET)}"
    assert topup_webhook_handle(payload=body, signature=header) == "malformed"
    assert not StripeEvent.objects.exists()
