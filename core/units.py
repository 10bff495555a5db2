"""Unit conversions of the ledger's integer micro-units.

Card hours are kept as micro card-hours (1 h = 1,000,000), like money in micro-units: one helper for
every place that turns hours a person typed into micros, or micros back into hours to show.
"""

from __future__ import annotations

from decimal import ROUND_HALF_EVEN, Decimal

MICROS_PER_HOUR = 1_000_000
MICROS_PER_UNIT = 1_000_000  # of money: a yuan, a dollar
CURRENCY_SYMBOLS = {"CNY": "¥", "USD": "$", "EUR": "€", "GBP": "£", "JPY": "¥", "HKD": "HK$", "SGD": "S$"}


def hours_to_micros(hours: Decimal | int) -> int:
    """``Decimal("1.5")`` hours → ``1_500_000`` micros, exactly.

    Raises ValueError for a fraction of a micro (more than six decimals), an infinity or a NaN, and
    TypeError for a float (its binary value is not the decimal a person typed).
    """
    if isinstance(hours, float):
        raise TypeError("hours must be a Decimal or an int, not a float")
    hours = Decimal(hours)
    if not hours.is_finite():
        raise ValueError(f"{hours} is not a number of hours")
    micros = hours * MICROS_PER_HOUR
    if micros != micros.to_integral_value():
        raise ValueError(f"{hours} h is not a whole number of micro-hours (at most six decimals)")
    return int(micros)


def micros_to_hours(micros: int) -> Decimal:
    """``1_500_000`` micros → ``Decimal("1.5")`` hours, exactly."""
    return Decimal(micros) / MICROS_PER_HOUR


def money_text(micros: int, *, currency: str, places: int = 2) -> str:
    """``12345678`` micros → ``¥12.35``: an amount for people to read, in ``currency``."""
    amount = (Decimal(micros) / MICROS_PER_HOUR).quantize(
        Decimal(1).scaleb(-places), rounding=ROUND_HALF_EVEN
    )
    symbol = CURRENCY_SYMBOLS.get(currency, currency + " ")
    sign = "-" if amount < 0 else ""
    return f"{sign}{symbol}{abs(amount):,}"
