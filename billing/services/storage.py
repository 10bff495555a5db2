"""Home storage: an optional price per GB-month above a free allowance, charged once a UTC day.

Billing knows nothing of homes: the provisioner reads each user's last measured home and hands
``storage_charge_many`` plain values (user, paying account, bytes). A day is charged at the price in
effect when it began (00:00 UTC): ``(bytes − free_gb × 10^9) × price ÷ 10^9 ÷ 30`` micros, rounded down.
The payer is the user's own account, by metering's rule (``metering.payer_legs``): cards not tied to a GPU
model first (where the price sets a card rate), then the wallet, and what the wallet lacks goes to the
overdraft, as GPU time does; an account that owes cannot launch until it tops up.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import UTC, date, datetime, time

from django.core.cache import cache
from django.db import transaction
from django.utils import timezone
from django.utils.translation import gettext as _

from billing.audit import audit_record
from billing.models import CARD_UNIT, LedgerAccount, StoragePrice, Transfer
from billing.services.ledger import Leg, bulk_cursor, money_unit, system_account, transfers_post_many
from billing.services.metering import payer_legs, payers_lock
from billing.services.pricing import version_current
from core.clock import db_now
from core.errors import ValidationFailed

GB = 10**9
MONTH_DAYS = 30
# A day's charge goes through metering's payer rule as a meter of this many "seconds" whose hourly rates
# are the day's charge: a card pays whole parts of the day, and the parts add up to the charge exactly.
_DAY_PARTS = 3600
_CACHE_KEY = "billing:storage-price"
_CACHE_SECONDS = 60


@dataclass(frozen=True)
class StorageRate:
    """The storage price in effect: what a GB-month above ``free_gb`` costs, in money and card-hours."""

    price_id: int
    price_micros_per_gb_month: int
    card_micros_per_gb_month: int | None
    free_gb: int

    def over_bytes(self, home_bytes: int) -> int:
        return max(0, home_bytes - self.free_gb * GB)

    def daily_micros(self, home_bytes: int) -> int:
        """A day's money for a home of ``home_bytes``, rounded down."""
        return self.over_bytes(home_bytes) * self.price_micros_per_gb_month // (GB * MONTH_DAYS)

    def daily_card_micros(self, home_bytes: int) -> int:
        """A day's card-hour micros, rounded down; 0 where cards do not pay for storage."""
        return self.over_bytes(home_bytes) * (self.card_micros_per_gb_month or 0) // (GB * MONTH_DAYS)

    def monthly_micros(self, home_bytes: int) -> int:
        return self.over_bytes(home_bytes) * self.price_micros_per_gb_month // GB


@dataclass(frozen=True)
class StorageCharge:
    """One user's home as measured, and the account that pays for it (the user's own)."""

    user_id: int
    account_id: int
    home_bytes: int


def _rate(row: StoragePrice | None) -> StorageRate | None:
    if row is None:
        return None
    return StorageRate(row.id, row.price_micros_per_gb_month, row.card_micros_per_gb_month, row.free_gb)


def storage_rate_at(*, at: datetime) -> StorageRate | None:
    """The storage price in effect at ``at``; None: storage is free then."""
    return _rate(version_current(StoragePrice.objects.all(), at))


def storage_rate_current() -> StorageRate | None:
    """The storage price in effect now, from the cache (a query or two on a miss). An entry lives at most
    ``_CACHE_SECONDS`` and never past the next version's ``effective_from``; ``storage_price_set`` drops
    it."""
    cached = cache.get(_CACHE_KEY)
    if cached is not None:
        return cached or None  # False: no price
    newest = StoragePrice.objects.order_by("-effective_from", "-id").first()
    rate, timeout = _rate(newest), _CACHE_SECONDS
    now = timezone.now()  # the app's clock: a display cache, not a charge
    if newest is not None and newest.effective_from > now:
        rate = storage_rate_at(at=now)
        timeout = max(1, min(timeout, int((newest.effective_from - now).total_seconds()) + 1))
    cache.set(_CACHE_KEY, rate or False, timeout=timeout)
    return rate


def _whole(value: object, name: str, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValidationFailed(
            _("%(name)s must be a whole number, zero or more.") % {"name": name}, fields={name: "invalid"}
        )


def storage_price_set(
    *,
    price_micros_per_gb_month: int,
    free_gb: int = 0,
    card_micros_per_gb_month: int | None = None,
    effective_from: datetime | None = None,
    actor=None,
    reason: str = "",
) -> StoragePrice:
    """Add a storage price version (versions are never edited) and an audit row; the cached price is
    dropped. Raises ValidationFailed for a negative or non-whole figure."""
    _whole(price_micros_per_gb_month, "price_micros_per_gb_month")
    _whole(free_gb, "free_gb")
    _whole(card_micros_per_gb_month, "card_micros_per_gb_month", allow_none=True)
    if effective_from is not None and (
        not isinstance(effective_from, datetime) or effective_from.tzinfo is None
    ):
        raise ValidationFailed(
            _("effective_from must be a date and time with a time zone."),
            fields={"effective_from": "invalid"},
        )
    with transaction.atomic():
        before = version_current(StoragePrice.objects.all(), None)
        fields = {"effective_from": effective_from} if effective_from else {}
        row = StoragePrice.objects.create(
            price_micros_per_gb_month=price_micros_per_gb_month,
            free_gb=free_gb,
            card_micros_per_gb_month=card_micros_per_gb_month,
            created_by=actor if getattr(actor, "pk", None) else None,
            **fields,
        )
        audit_record(
            actor=actor,
            action="storage_price.set",
            target=row,
            before=_audited(before),
            after=_audited(row),
            reason=reason,
        )
        storage_price_cache_drop()
        # again after commit: a page that read the rows before it cached them in between
        transaction.on_commit(storage_price_cache_drop, robust=True)
    return row


def storage_price_cache_drop() -> None:
    cache.delete(_CACHE_KEY)


def _audited(row: StoragePrice | None) -> dict | None:
    if row is None:
        return None
    return {
        "price_micros_per_gb_month": row.price_micros_per_gb_month,
        "card_micros_per_gb_month": row.card_micros_per_gb_month,
        "free_gb": row.free_gb,
        "effective_from": row.effective_from.isoformat(),
    }


def storage_day_start(*, day: date) -> datetime:
    """00:00 UTC of ``day``, when its storage price is read. Raises ValidationFailed unless ``day`` is a
    date (a datetime is not)."""
    if not isinstance(day, date) or isinstance(day, datetime):
        raise ValidationFailed(_("The day must be a date."), fields={"day": "invalid"})
    return datetime.combine(day, time.min, tzinfo=UTC)


def storage_key(*, user_id: int, day: date) -> str:
    """The idempotency key of a user's storage charge for ``day``; each leg adds its source to it."""
    return f"storage:{user_id}:{day.isoformat()}"


def storage_charge_many(*, charges: list[StorageCharge], day: date) -> int:
    """Charge each user's home for ``day`` (a UTC date, today or earlier) at the price in effect when
    the day began; returns the transfers written.

    At most once per user and day, also from two workers at once: the payers' ledger accounts are locked
    (id order, as the metering tick does) before the day's keys are read, so a second run waits for the
    first and then finds its transfers. A home at or under the allowance, a charge that rounds to zero or
    no price: nothing. Raises ValidationFailed for a bad day or a negative size, before anything is written.
    """
    day_start = storage_day_start(day=day)
    now = db_now()
    if day_start > now:
        raise ValidationFailed(_("A day that has not begun cannot be charged."), fields={"day": "future"})
    for charge in charges:
        size = charge.home_bytes
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ValidationFailed(_("A home's size cannot be negative."), fields={"home_bytes": "invalid"})
    rate = storage_rate_at(at=day_start)
    if rate is None:
        return 0
    due = [c for c in charges if rate.daily_micros(c.home_bytes) or rate.daily_card_micros(c.home_bytes)]
    if not due:
        return 0
    unit = money_unit()
    revenue = system_account(kind=LedgerAccount.Kind.REVENUE, unit=unit)
    burned = system_account(kind=LedgerAccount.Kind.CARD_BURN, unit=CARD_UNIT)
    with transaction.atomic(), bulk_cursor() as cursor:
        rows = [{"account_id": c.account_id} for c in due]
        payers = payers_lock(cursor, rows, system_ids=[revenue.id, burned.id], unit=unit, now=now)
        charged = _charged_users(day=day, day_start=day_start)
        legs: list[Leg] = []
        for charge in due:
            if charge.user_id in charged:
                continue
            charged.add(charge.user_id)  # the same user twice in ``charges``: once
            day_charge = {
                "id": None,
                "account_id": charge.account_id,
                "gpu_model": "",  # only cards valid for any model pay for storage
                "price_micros_per_hour": rate.daily_micros(charge.home_bytes),
                "card_burn_micros_per_hour": rate.daily_card_micros(charge.home_bytes),
                "billed_seconds": _DAY_PARTS,
                "posted_seconds": 0,
                "card_seconds": 0,
                "wallet_seconds": 0,
            }
            user_legs, _row = payer_legs(
                day_charge,
                payers,
                revenue_id=revenue.id,
                burned_id=burned.id,
                base=storage_key(user_id=charge.user_id, day=day),
                card_kind=Transfer.Kind.STORAGE,
                money_kind=Transfer.Kind.STORAGE,
            )
            legs += [_dated(leg, day) for leg in user_legs]
        return len(transfers_post_many(legs=legs))


def _dated(leg: Leg, day: date) -> Leg:
    """The leg with the day as its memo: the history shows "Home storage, <day>" in the reader's language."""
    return replace(leg, memo=day.isoformat())


def _charged_users(*, day: date, day_start: datetime) -> set[int]:
    """The users whose storage for ``day`` is in the ledger (read after the payers' locks: a concurrent
    charge of the same users has committed by then). A day's transfers are made on or after it began."""
    prefix = "storage:"
    suffix = f":{day.isoformat()}:"
    keys = Transfer.objects.filter(kind=Transfer.Kind.STORAGE, created_at__gte=day_start).values_list(
        "idempotency_key", flat=True
    )
    users = set()
    for key in keys:
        if key.startswith(prefix) and suffix in key:
            users.add(int(key[len(prefix) :].split(":", 1)[0]))
    return users


@dataclass(frozen=True)
class StorageCost:
    """What a home costs at the price in effect now, as the pages show it."""

    over_bytes: int
    free_gb: int
    monthly_micros: int
    price_micros_per_gb_month: int

    @property
    def over_gb(self) -> str:
        """GB above the allowance, one decimal, rounded down (``12.0``)."""
        tenths = self.over_bytes * 10 // GB
        return f"{tenths // 10}.{tenths % 10}"


def storage_cost(*, home_bytes: int) -> StorageCost | None:
    """The home's storage cost at the cached current price; None while storage is free (no price, or a
    price of zero)."""
    rate = storage_rate_current()
    if rate is None or rate.price_micros_per_gb_month <= 0:
        return None
    return StorageCost(
        over_bytes=rate.over_bytes(home_bytes),
        free_gb=rate.free_gb,
        monthly_micros=rate.monthly_micros(home_bytes),
        price_micros_per_gb_month=rate.price_micros_per_gb_month,
    )
