"""The interruptible tier's prices beside the on-demand ones (billing/services/pricing.py)."""

from __future__ import annotations

import pytest

from billing.models import AuditEntry, Price
from billing.services.pricing import INTERRUPTIBLE, price_quote, price_set
from core.errors import NotFound, ValidationFailed
from tests.billing.conftest import A100

pytestmark = pytest.mark.django_db


def test_interruptible_quote_is_the_lower_price_and_burns_cards_by_the_same_ratio(prices):
    price_set(
        gpu_model=A100,
        profile="whole",
        price_micros_per_hour=12_000_000,
        interruptible_price_micros_per_hour=4_000_000,
    )
    on_demand = price_quote(gpu_model=A100, profile="whole")
    cheap = price_quote(gpu_model=A100, profile="whole", tier=INTERRUPTIBLE)
    assert (on_demand.price_micros_per_hour, cheap.price_micros_per_hour) == (12_000_000, 4_000_000)
    assert cheap.card_burn_micros_per_hour == on_demand.card_burn_micros_per_hour // 3 == 666_666


def test_a_slice_without_its_own_price_takes_its_fraction_of_the_whole_interruptible_price(prices):
    price_set(
        gpu_model=A100,
        profile="whole",
        price_micros_per_hour=12_000_000,
        interruptible_price_micros_per_hour=4_000_000,
    )
    quarter = price_quote(gpu_model=A100, profile="1/4", tier=INTERRUPTIBLE)
    assert quarter.price_micros_per_hour == 1_000_000
    assert (
        quarter.card_burn_micros_per_hour
        == price_quote(gpu_model=A100, profile="1/4").card_burn_micros_per_hour // 3
    )


def test_no_interruptible_price_means_the_tier_is_not_offered(prices):
    with pytest.raises(NotFound):
        price_quote(gpu_model=A100, profile="whole", tier=INTERRUPTIBLE)
    with pytest.raises(NotFound):
        price_quote(gpu_model="", profile="cpu", tier=INTERRUPTIBLE)
    # a newer version without it withdraws the tier
    price_set(
        gpu_model="T4",
        profile="whole",
        price_micros_per_hour=2_000_000,
        interruptible_price_micros_per_hour=500_000,
    )
    assert price_quote(gpu_model="T4", profile="whole", tier=INTERRUPTIBLE).price_micros_per_hour == 500_000
    price_set(gpu_model="T4", profile="whole", price_micros_per_hour=2_000_000)
    with pytest.raises(NotFound):
        price_quote(gpu_model="T4", profile="whole", tier=INTERRUPTIBLE)


def test_price_set_refuses_an_interruptible_price_above_on_demand_or_for_cpu(prices):
    with pytest.raises(ValidationFailed):
        price_set(
            gpu_model=A100,
            profile="whole",
            price_micros_per_hour=1_000,
            interruptible_price_micros_per_hour=1_001,
        )
    with pytest.raises(ValidationFailed):
        price_set(
            gpu_model="", profile="cpu", price_micros_per_hour=1_000, interruptible_price_micros_per_hour=10
        )
    with pytest.raises(ValidationFailed):
        price_set(
            gpu_model=A100,
            profile="whole",
            price_micros_per_hour=1_000,
            interruptible_price_micros_per_hour=-1,
        )


def test_price_set_audits_the_interruptible_price(prices):
    price = price_set(
        gpu_model=A100,
        profile="whole",
        price_micros_per_hour=10_000_000,
        interruptible_price_micros_per_hour=3_000_000,
    )
    row = AuditEntry.objects.filter(action="price.set", target_id=str(price.pk)).get()
    assert row.before == {"price_micros_per_hour": 12_000_000}  # no interruptible price: not shown
    assert row.after == {
        "price_micros_per_hour": 10_000_000,
        "interruptible_price_micros_per_hour": 3_000_000,
    }
    assert Price.objects.get(pk=price.pk).interruptible_price_micros_per_hour == 3_000_000
