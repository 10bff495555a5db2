"""Helpers for billing tests: accounts, prices, funding and the ledger invariants."""

from __future__ import annotations

import itertools
from datetime import timedelta

import pytest
from django.db import connection

from billing.models import CARD_UNIT, Account, Entry, LedgerAccount, Meter, Transfer
from billing.services.pricing import burn_rate_set, price_set
from billing.services.topups import wallet_credit_promotion

_counter = itertools.count()

A100 = "A100-SXM4-80GB"


def make_account(name: str | None = None) -> Account:
    return Account.objects.create(kind=Account.Kind.USER, name=name or f"acct-{next(_counter)}")


def fund(account: Account, micros: int) -> None:
    wallet_credit_promotion(
        account=account, amount_micros=micros, idempotency_key=f"test-fund-{next(_counter)}"
    )


def seed_prices() -> None:
    price_set(gpu_model=A100, profile="whole", price_micros_per_hour=12_000_000)
    price_set(gpu_model="T4", profile="whole", price_micros_per_hour=2_000_000)
    price_set(gpu_model="H200", profile="whole", price_micros_per_hour=36_000_000)
    price_set(gpu_model="", profile="cpu", price_micros_per_hour=360_000)
    burn_rate_set(gpu_model=A100, multiplier_milli=2000)
    burn_rate_set(gpu_model="T4", multiplier_milli=500)
    burn_rate_set(gpu_model="H200", multiplier_milli=4000)


def assert_ledger_invariants() -> None:
    """Cached balances equal their entries; entries sum to zero per unit; floors hold; meters add up."""
    with connection.cursor() as cursor:
        cursor.execute(
            """
            SELECT la.id, la.balance_micros, COALESCE(sum(e.amount_micros), 0)
            FROM billing_ledgeraccount la LEFT JOIN billing_entry e ON e.account_id = la.id
            GROUP BY la.id HAVING la.balance_micros <> COALESCE(sum(e.amount_micros), 0)
            """
        )
        assert cursor.fetchall() == []
        cursor.execute(
            """
            SELECT la.unit, sum(e.amount_micros) FROM billing_entry e
            JOIN billing_ledgeraccount la ON la.id = e.account_id GROUP BY la.unit
            """
        )
        for unit, total in cursor.fetchall():
            assert total == 0, unit
        cursor.execute(
            "SELECT count(*) FROM billing_transfer t WHERE (SELECT count(*) FROM billing_entry e "
            "WHERE e.transfer_id = t.id) <> 2"
        )
        assert cursor.fetchone()[0] == 0
    assert not LedgerAccount.objects.filter(kind__in=["wallet", "card"], balance_micros__lt=0).exists()
    assert not LedgerAccount.objects.filter(kind="overdraft", balance_micros__gt=0).exists()
    for meter in Meter.objects.all():
        money = sum(
            Transfer.objects.filter(meter=meter)
            .exclude(unit=CARD_UNIT)
            .values_list("amount_micros", flat=True)
        )
        cards = sum(
            Transfer.objects.filter(meter=meter, unit=CARD_UNIT).values_list("amount_micros", flat=True)
        )
        assert money == meter.charged_micros == meter.price_micros_per_hour * meter.wallet_seconds // 3600
        assert (
            cards == meter.card_charged_micros == meter.card_burn_micros_per_hour * meter.card_seconds // 3600
        )
        assert meter.posted_seconds <= meter.billed_seconds
        assert meter.billed_until == meter.started_at + timedelta(seconds=meter.billed_seconds)
    assert Entry.objects.count() == 2 * Transfer.objects.count()


@pytest.fixture
def prices(db):
    seed_prices()
