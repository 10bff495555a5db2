"""Signals the metering tick sends; the provisioner receives them (billing never imports it)."""

from django.dispatch import Signal

# kwargs: session_refs: list[str] — the provisioner stops those sessions (reason "funds exhausted")
funds_exhausted = Signal()
# kwargs: account_id: int, runway_seconds: int, session_refs: list[str]
runway_low = Signal()
# kwargs: account_id: int, session_refs: list[str] — funds were added after a runway_low
runway_recovered = Signal()
# kwargs: at: datetime — a metering tick committed (budgets are checked after it)
metered = Signal()
