"""Races on one real PostgreSQL: many threads, each with its own connection."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import stripe
from django.db import connection
from django.test import override_settings

from billing.models import Card, LedgerAccount, TopUp, Transfer
from billing.services.cards import card_batch_issue, card_redeem, card_split
from billing.services.ledger import wallet_for
from billing.services.metering import meter_alive, meter_open, metering_tick
from billing.services.pricing import price_quote
from billing.services.topups import topup_webhook_handle
from core.clock import db_now
from core.errors import ApplicationError
from portal.services import user_create
from tests.billing.conftest import A100, assert_ledger_invariants, fund, make_account, seed_prices

pytestmark = pytest.mark.django_db(transaction=True)
SECRET = "whsec_test_secret"


def _run(n: int, fn) -> list:
    barrier = threading.Barrier(n)

    def call(i):
        barrier.wait()
        try:
            return fn(i)
        except ApplicationError as exc:
            return exc
        finally:
            connection.close()

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(call, range(n)))


def test_fifty_redemptions_of_one_code_make_one_card(settings):
    settings.CARD_REDEEM_RATE_PER_MINUTE = 1000
    users = [user_create(username=f"r{i}", email="", password="a-long-pass-phrase-9") for i in range(50)]
    _, (code,) = card_batch_issue(hours_micros=5_000_000, count=1, valid_days=30)
    results = _run(50, lambda i: card_redeem(user=users[i], account=users[i].account, code=code))
    won = [r for r in results if isinstance(r, Card)]
    assert len(won) == 1
    assert {r.code for r in results if not isinstance(r, Card)} == {"code_used"}
    assert Card.objects.filter(state="active").count() == 1


def test_concurrent_splits_never_exceed_what_the_card_holds(settings):
    user = user_create(username="splitter", email="", password="a-long-pass-phrase-9")
    _, (code,) = card_batch_issue(hours_micros=10_000_000, count=1, valid_days=30, max_parts=50)
    card = card_redeem(user=user, account=user.account, code=code)
    results = _run(20, lambda i: card_split(card_id=card.id, account=user.account, parts=[3_000_000]))
    made = [r for r in results if isinstance(r, list)]
    assert len(made) == 3
    card.ledger_account.refresh_from_db()
    assert card.ledger_account.balance_micros == 1_000_000
    assert_ledger_invariants()


def test_one_split_key_replayed_concurrently_splits_once(settings):
    user = user_create(username="retrier", email="", password="a-long-pass-phrase-9")
    _, (code,) = card_batch_issue(hours_micros=10_000_000, count=1, valid_days=30, max_parts=50)
    card = card_redeem(user=user, account=user.account, code=code)
    results = _run(
        10,
        lambda i: card_split(
            card_id=card.id, account=user.account, parts=[3_000_000, 1_000_000], idempotency_key="split-1"
        ),
    )
    assert all(isinstance(r, list) for r in results), results
    assert {tuple(part.id for part, _code in r) for r in results} == {
        tuple(sorted(p.id for p, _c in results[0]))
    }
    assert Card.objects.filter(parent=card).count() == 2
    card.ledger_account.refresh_from_db()
    assert card.ledger_account.balance_micros == 6_000_000
    assert_ledger_invariants()


def _signed(payload: dict, secret: str = SECRET, at: int | None = None) -> tuple[bytes, str]:
    body = json.dumps(payload).encode()
    at = at or int(time.time())
    signature = stripe.WebhookSignature._compute_signature(f"{at}.{body.decode()}", secret)
    return body, f"t={at},v1={signature}"


def _paid_event(session_id: str, amount_total: int) -> dict:
    return {
        "id": f"evt_{session_id}",
        "object": "event",
        "type": "checkout.session.completed",
        "data": {
            "object": {
                "id": session_id,
                "object": "checkout.session",
                "payment_status": "paid",
                "amount_total": amount_total,
            }
        },
    }


@override_settings(STRIPE_WEBHOOK_SECRET=SECRET)
def test_webhook_replayed_ten_times_concurrently_credits_once():
    account = make_account()
    TopUp.objects.create(
        account=account, amount_micros=50_000_000, currency="CNY", checkout_session_id="cs_1"
    )
    body, header = _signed(_paid_event("cs_1", 5000))
    results = _run(10, lambda i: topup_webhook_handle(payload=body, signature=header))
    assert results.count("credited") == 1
    assert wallet_for(account=account).balance_micros == 50_000_000
    assert Transfer.objects.filter(kind="topup").count() == 1


def test_ticks_topups_and_opens_at_once_keep_the_invariants():
    seed_prices()
    accounts = [make_account() for _ in range(6)]
    for a in accounts:
        fund(a, 3_000_000)
    start = db_now() - timedelta(hours=1)
    quote = price_quote(gpu_model=A100, profile="whole")

    def work(i):
        account = accounts[i % len(accounts)]
        for step in range(5):
            if i % 3 == 0:
                now = start + timedelta(seconds=120 * (step + 1) + i)
                meter_alive(session_refs=[f"c{j}-{k}" for j in range(12) for k in range(5)], alive_at=now)
                metering_tick(now=now)
            elif i % 3 == 1:
                fund(account, 1_000_000)
            else:
                meter_open(
                    account=account,
                    session_ref=f"c{i}-{step}",
                    gpu_model=A100,
                    profile="whole",
                    quote=quote,
                    started_at=start,
                )
        return True

    results = _run(12, work)
    assert all(r is True for r in results), results
    metering_tick(now=start + timedelta(hours=2))
    assert_ledger_invariants()
    assert not LedgerAccount.objects.filter(kind="wallet", balance_micros__lt=0).exists()
