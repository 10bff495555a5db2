"""Prices and card burn rates: what an hour of a profile on a GPU model costs, in money and card-hours.

A slice without its own price costs its fraction of the whole card (``1/2``, ``1/4``, ``1/8``; a MIG
profile ``Ng.XXgb`` is N/7 of the card), and burns cards by the same fraction; ``2x``, ``4x``, ``8x`` (that
many whole cards of one node) cost and burn that many times the whole card. Prices are versioned by
``effective_from``; a session keeps the quote it launched with (stored on its meter).

An environment's price tier (docs/ENVIRONMENTS.md) is an hourly surcharge in micro-units added to the
quote (``quote_with_surcharge``): the money rate grows by exactly the surcharge, and the card burn by the
same proportion of the base rate, rounded down to a whole micro-unit.

Two tiers: ``on_demand`` and ``interruptible`` (a lower price an admin sets beside the on-demand one;
an on-demand launch may preempt such a session). The interruptible tier burns cards scaled by the same
ratio as its price; a price row without an interruptible price does not offer that tier.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime
from fractions import Fraction

from django.conf import settings
from django.db import transaction
from django.db.models.functions import Now
from django.utils.translation import gettext as _

from billing.audit import audit_record
from billing.models import CardBurnRate, Price
from core.compiled import Lookup
from core.errors import NotFound, ValidationFailed

WHOLE = "whole"
CPU = "cpu"
ON_DEMAND = "on_demand"
INTERRUPTIBLE = "interruptible"
TIERS = (ON_DEMAND, INTERRUPTIBLE)
_SLICES = {"whole": Fraction(1), "1/2": Fraction(1, 2), "1/4": Fraction(1, 4), "1/8": Fraction(1, 8)}
_MIG = re.compile(r"^([1-7])g\.\d+gb$")
_GPUS = re.compile(r"^([248])x$")


@dataclass(frozen=True)
class PriceQuote:
    price_id: int
    price_micros_per_hour: int
    card_burn_micros_per_hour: int


def profile_fraction(profile: str) -> Fraction:
    """The share of a whole card a profile rents. Raises NotFound for an unknown profile."""
    if profile in _SLICES:
        return _SLICES[profile]
    match = _MIG.match(profile)
    if match:
        return Fraction(int(match.group(1)), 7)
    match = _GPUS.match(profile)
    if match:
        return Fraction(int(match.group(1)))
    raise NotFound(_("Unknown profile %(profile)s.") % {"profile": repr(profile)})


_LATEST = ("-effective_from", "-id")  # the version in effect: the latest to take effect, then the newest


def version_current(queryset, at: datetime | None):
    """The version of ``queryset`` (rows with ``effective_from``) in effect at ``at`` (default: now)."""
    queryset = queryset.filter(effective_from__lte=at) if at else queryset.filter(effective_from__lte=Now())
    return queryset.order_by(*_LATEST).first()


# The price and burn rate in effect now, read at every launch: compiled once (core.compiled); ``at`` in
# the past or future goes through ``version_current``.
_BURN_RATE_NOW = Lookup(
    lambda model: CardBurnRate.objects.filter(gpu_model=model, effective_from__lte=Now()).order_by(*_LATEST),
    key_types=(str,),
)
_PRICE_NOW = Lookup(
    lambda model, profile: Price.objects.filter(
        gpu_model=model, profile=profile, effective_from__lte=Now()
    ).order_by(*_LATEST),
    key_types=(str, str),
)


def burn_multiplier_milli(*, gpu_model: str, at: datetime | None = None) -> int:
    if at is None and isinstance(gpu_model, str):
        rate = _BURN_RATE_NOW.first(gpu_model)
    else:
        rate = version_current(CardBurnRate.objects.filter(gpu_model=gpu_model), at)
    return rate.multiplier_milli if rate else 1000


def _price_current(*, gpu_model: str, profile: str, at: datetime | None) -> Price | None:
    if at is None and isinstance(gpu_model, str) and isinstance(profile, str):
        return _PRICE_NOW.first(gpu_model, profile)
    return version_current(Price.objects.filter(gpu_model=gpu_model, profile=profile), at)


def _tier_quote(price: Price, *, tier: str, fraction: Fraction, burn: Fraction) -> PriceQuote:
    """The quote of ``fraction`` of ``price``'s row in ``tier``. Raises NotFound for an interruptible
    quote of a row without an interruptible price."""
    on_demand = price.price_micros_per_hour
    if tier == ON_DEMAND:
        return PriceQuote(price.id, int(on_demand * fraction), int(burn))
    lower = price.interruptible_price_micros_per_hour
    if lower is None:
        raise NotFound(_("This choice is not offered as interruptible."))
    scale = Fraction(lower, on_demand) if on_demand else Fraction(1)
    return PriceQuote(price.id, int(lower * fraction), int(burn * scale))


def quote_with_surcharge(quote: PriceQuote, *, surcharge_micros_per_hour: int) -> PriceQuote:
    """``quote`` with an environment's hourly surcharge: the price plus the surcharge, exactly; the card
    burn scaled by (price + surcharge) / price, rounded down (a free base price burns cards unchanged:
    there is no proportion to scale by). The price row stays the base one."""
    if surcharge_micros_per_hour < 0:
        raise ValidationFailed(_("A surcharge cannot be negative."))
    if not surcharge_micros_per_hour:
        return quote
    base = quote.price_micros_per_hour
    burn = quote.card_burn_micros_per_hour
    extra_burn = burn * surcharge_micros_per_hour // base if base else 0
    return PriceQuote(quote.price_id, base + surcharge_micros_per_hour, burn + extra_burn)


def price_quote(
    *, gpu_model: str, profile: str, at: datetime | None = None, tier: str = ON_DEMAND
) -> PriceQuote:
    """The price and card burn of one hour of ``profile`` on ``gpu_model`` at ``at`` (default: now), in
    ``tier`` (``on_demand`` or ``interruptible``).

    Raises NotFound when neither the profile nor the whole card is priced, and for an interruptible
    quote when the price that applies has no interruptible price (the cpu profile never has one).
    """
    if tier not in TIERS:
        raise NotFound(_("Unknown tier %(tier)s.") % {"tier": repr(tier)})
    if profile == CPU:
        price = version_current(Price.objects.filter(gpu_model__in=[gpu_model, ""], profile=CPU), at)
        if price is None:
            raise NotFound(_("The cpu profile is not priced."))
        if tier != ON_DEMAND:
            raise NotFound(_("This choice is not offered as interruptible."))
        return PriceQuote(
            price.id, price.price_micros_per_hour, settings.BILLING_CPU_CARD_BURN_MICROS_PER_HOUR
        )
    fraction = profile_fraction(profile)
    burn = Fraction(burn_multiplier_milli(gpu_model=gpu_model, at=at) * 1000) * fraction
    own = _price_current(gpu_model=gpu_model, profile=profile, at=at)
    if own is not None:
        return _tier_quote(own, tier=tier, fraction=Fraction(1), burn=burn)
    whole = _price_current(gpu_model=gpu_model, profile=WHOLE, at=at)
    if whole is None:
        raise NotFound(
            _("%(gpu_model)s %(profile)s is not priced.") % {"gpu_model": gpu_model, "profile": profile}
        )
    return _tier_quote(whole, tier=tier, fraction=fraction, burn=burn)


def _price_check(price_micros_per_hour, interruptible_price_micros_per_hour, *, profile: str) -> None:
    """Raise ValidationFailed unless the prices are whole, non-negative numbers, the interruptible one
    (optional; never for cpu) at most the on-demand one, and the profile known."""
    lower = interruptible_price_micros_per_hour
    for value in (price_micros_per_hour, *([] if lower is None else [lower])):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValidationFailed(_("A price is a whole number of micro-units per hour."))
        if value < 0:
            raise ValidationFailed(_("A price cannot be negative."))
    if lower is not None:
        if lower > price_micros_per_hour:
            raise ValidationFailed(
                _("An interruptible price cannot be above the on-demand price."),
                fields={"interruptible_price_micros_per_hour": "above the on-demand price"},
            )
        if profile == CPU:
            raise ValidationFailed(
                _("The cpu profile has no interruptible tier."),
                fields={"interruptible_price_micros_per_hour": "not for cpu"},
            )
    if profile != CPU:
        try:
            profile_fraction(profile)
        except NotFound:
            raise ValidationFailed(
                _("Unknown profile %(profile)s.") % {"profile": repr(profile)}, fields={"profile": "unknown"}
            ) from None


def _audited(price: Price | None) -> dict | None:
    """A price as the audit log shows it: the interruptible price only where there is one."""
    if price is None:
        return None
    row = {"price_micros_per_hour": price.price_micros_per_hour}
    if price.interruptible_price_micros_per_hour is not None:
        row["interruptible_price_micros_per_hour"] = price.interruptible_price_micros_per_hour
    return row


def price_set(
    *,
    gpu_model: str,
    profile: str,
    price_micros_per_hour: int,
    interruptible_price_micros_per_hour: int | None = None,
    actor=None,
    reason: str = "",
    effective_from: datetime | None = None,
) -> Price:
    """Add a price version (prices are never edited); writes an audit row. Without
    ``interruptible_price_micros_per_hour`` the version offers no interruptible tier. Raises
    ValidationFailed."""
    _price_check(price_micros_per_hour, interruptible_price_micros_per_hour, profile=profile)
    with transaction.atomic():
        before = version_current(Price.objects.filter(gpu_model=gpu_model, profile=profile), None)
        fields = {"effective_from": effective_from} if effective_from else {}
        price = Price.objects.create(
            gpu_model=gpu_model,
            profile=profile,
            price_micros_per_hour=price_micros_per_hour,
            interruptible_price_micros_per_hour=interruptible_price_micros_per_hour,
            created_by=actor if getattr(actor, "pk", None) else None,
            **fields,
        )
        audit_record(
            actor=actor,
            action="price.set",
            target=price,
            before=_audited(before),
            after=_audited(price),
            reason=reason,
        )
    return price


def burn_rate_set(*, gpu_model: str, multiplier_milli: int, actor=None, reason: str = "") -> CardBurnRate:
    """Add a card burn multiplier version for a GPU model; writes an audit row."""
    if isinstance(multiplier_milli, bool) or not isinstance(multiplier_milli, int) or multiplier_milli <= 0:
        raise ValidationFailed(_("A burn multiplier is a positive whole number of thousandths."))
    with transaction.atomic():
        before = version_current(CardBurnRate.objects.filter(gpu_model=gpu_model), None)
        rate = CardBurnRate.objects.create(gpu_model=gpu_model, multiplier_milli=multiplier_milli)
        audit_record(
            actor=actor,
            action="burn_rate.set",
            target=rate,
            before={"multiplier_milli": before.multiplier_milli} if before else None,
            after={"multiplier_milli": multiplier_milli},
            reason=reason,
        )
    return rate
