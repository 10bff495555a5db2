"""Card hours ↔ micro card-hours, exactly."""

from __future__ import annotations

from decimal import Decimal

import pytest

from core.units import hours_to_micros, micros_to_hours


@pytest.mark.parametrize(
    ("hours", "micros"),
    [
        (1, 1_000_000),
        (Decimal("1.5"), 1_500_000),
        (Decimal("0.000001"), 1),
        (Decimal("12.345678"), 12_345_678),
    ],
)
def test_hours_to_micros_and_back_are_exact(hours, micros):
    assert hours_to_micros(hours) == micros
    assert micros_to_hours(micros) == hours


@pytest.mark.parametrize(
    "hours", [Decimal("0.0000001"), Decimal("Infinity"), Decimal("NaN"), Decimal("sNaN")]
)
def test_hours_to_micros_refuses_a_fraction_of_a_micro_or_no_number(hours):
    with pytest.raises(ValueError):
        hours_to_micros(hours)


def test_hours_to_micros_refuses_a_float():
    with pytest.raises(TypeError):
        hours_to_micros(0.1)


def test_micros_to_hours_keeps_every_digit():
    assert f"{micros_to_hours(1_234_567):g}" == "1.234567"
