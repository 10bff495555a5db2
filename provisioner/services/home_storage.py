"""The daily storage charge, from the provisioner's side: billing prices and posts it, but the homes'
sizes are the provisioner's (``HomeUsage``), so they are read here and handed down as plain values."""

from __future__ import annotations

from datetime import UTC, date

from billing.services.storage import (
    GB,
    StorageCharge,
    storage_charge_many,
    storage_day_start,
    storage_rate_at,
)
from core.clock import db_now
from provisioner.models import HomeUsage


def home_storage_charge(*, day: date | None = None) -> int:
    """Charge every home measured above the free allowance for ``day`` (default: today, UTC, by the
    database clock) to its user's own account; returns the transfers written. Idempotent per user and day
    (``storage_charge_many``): the hourly beat task charges each user once a day. No price: reads nothing
    more. Raises ValidationFailed for a bad day."""
    day = day or db_now().astimezone(UTC).date()
    rate = storage_rate_at(at=storage_day_start(day=day))
    if rate is None:
        return 0
    rows = HomeUsage.objects.filter(bytes__gt=rate.free_gb * GB, user__account__isnull=False).values_list(
        "user_id", "user__account_id", "bytes"
    )
    charges = [StorageCharge(user_id, account_id, size) for user_id, account_id, size in rows]
    return storage_charge_many(charges=charges, day=day)
