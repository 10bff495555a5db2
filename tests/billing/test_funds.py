"""``account_funds``: one statement that must agree with ``usable_cards`` and the ledger it sums."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.core.cache import cache
from django.db.models import Sum
from django.utils import timezone

from billing.models import Card, Meter
from billing.selectors import account_funds, usable_cards
from billing.services.cards import card_batch_issue, card_redeem
from billing.services.pricing import price_quote
from portal.services import user_create
from tests.billing.conftest import A100, fund

pytestmark = pytest.mark.django_db

HOUR = 1_000_000


def _cards_of(user, *, variants):
    """One redeemed card per (gpu_models, state, expires in days or None) in ``variants``."""
    for gpu_models, state, expires_days in variants:
        _batch, (code,) = card_batch_issue(
            hours_micros=3 * HOUR, count=1, valid_days=30, gpu_models=gpu_models
        )
        cache.clear()  # redemptions are rate limited per user
        card = card_redeem(user=user, account=user.account, code=code)
        expires_at = timezone.now() + timedelta(days=expires_days) if expires_days is not None else None
        Card.objects.filter(id=card.id).update(state=state, expires_at=expires_at)


def test_funds_agree_with_usable_cards_for_every_model(prices):
    user = user_create(username="funds", email="funds@example.com", password="a long pass phrase 1")
    other = user_create(username="other", email="other@example.com", password="a long pass phrase 1")
    _cards_of(
        user,
        variants=[
            ([], "active", 10),
            ([], "active", None),
            ([A100], "active", 5),
            (["T4"], "active", 5),
            ([A100, "T4"], "active", 5),
            ([], "active", -1),  # past its expiry, not yet swept
            ([], "revoked", 10),
            ([A100], "expired", 10),
        ],
    )
    _cards_of(other, variants=[([], "active", 10)])
    fund(user.account, 7 * HOUR)
    quote = price_quote(gpu_model=A100, profile="whole")
    alive = timezone.now()
    Meter.objects.create(
        account=user.account,
        session_ref="s-1",
        gpu_model=A100,
        profile="whole",
        price_micros_per_hour=quote.price_micros_per_hour,
        card_burn_micros_per_hour=quote.card_burn_micros_per_hour,
        # 100 s run and confirmed alive, none of it posted: accrued as of now, not as of a tick
        started_at=alive - timedelta(seconds=100),
        billed_until=alive - timedelta(seconds=100),
        alive_until=alive,
    )
    for gpu_model in (None, A100, "T4", "H200", ""):
        expected = (
            usable_cards(account=user.account, gpu_model=gpu_model).aggregate(
                s=Sum("ledger_account__balance_micros")
            )["s"]
            or 0
        )
        funds = account_funds(account=user.account, gpu_model=gpu_model)
        assert funds.cards_micros == expected and type(funds.cards_micros) is int, gpu_model
    assert account_funds(account=user.account).cards_micros == 5 * 3 * HOUR  # the five active, unexpired
    assert account_funds(account=user.account, gpu_model="H200").cards_micros == 2 * 3 * HOUR
    funds = account_funds(account=user.account)
    assert (funds.wallet_micros, funds.overdraft_micros, funds.accrued_micros) == (
        7 * HOUR,
        0,
        quote.price_micros_per_hour * 100 // 3600,
    )
    assert funds.burn_micros_per_hour == quote.price_micros_per_hour
    assert funds.card_burn_micros_per_hour == quote.card_burn_micros_per_hour
    empty = account_funds(account=other.account, gpu_model=A100)
    assert (empty.wallet_micros, empty.cards_micros, empty.burn_micros_per_hour) == (0, 3 * HOUR, 0)
