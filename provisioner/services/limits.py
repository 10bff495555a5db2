"""Stops the portal decides on its own, each announced first (``stop_warnings``): the longest session
time, idle, funds running out, a monthly budget reached, preemption.

The sweep (``sessions_enforce_limits``, every SESSION_LIMITS_SWEEP_SECONDS) warns and stops for the
longest time and idle; a step of its own in the same beat task (``sessions_preempt_due``) stops the
interruptible sessions whose preemption warning is due (warned by ``preemption.preemption_claim``).
Funds follow the metering tick's ``runway_low`` / ``funds_exhausted`` signals, budgets its ``metered``
signal (``provisioner.services.budgets``). Every stop is a conditional update (``session_stop``): safe
to run anywhere, any time, twice.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from django.db import transaction
from django.utils import timezone

from provisioner.messages import message
from provisioner.models import Session, StopWarning
from provisioner.services.session_notices import session_ids
from provisioner.services.sessions import session_stop
from provisioner.services.stop_warnings import (
    stop_warn,
    stop_warn_ahead,
    stop_warnings_clear,
    stop_warnings_due,
)

S = Session.State
W = StopWarning.Kind


def sessions_enforce_limits(*, now: datetime | None = None) -> dict[str, int]:
    """Warn running sessions near their longest time or their idle time, and stop those past it.
    Returns counts: stops for ``max_duration`` and ``idle``, and warnings made (``warned``)."""
    now = now or timezone.now()
    counts = {"max_duration": 0, "idle": 0, "warned": 0}
    running = Session.objects.filter(state=S.RUNNING).values_list(
        "id", "owner_id", "running_at", "max_seconds", "idle_seconds", "last_active_at"
    )
    for session_id, owner_id, running_at, max_seconds, idle_seconds, last_active_at in running:
        ends_at = (running_at or now) + timedelta(seconds=max_seconds)
        if now >= ends_at:
            session_stop(session=Session(id=session_id), actor=None, reason=message("longest_reached"))
            counts["max_duration"] += 1
            continue
        idle_at = (last_active_at or running_at or now) + timedelta(seconds=idle_seconds or 0)
        if idle_seconds and now >= idle_at:
            idle_for = int((now - (last_active_at or running_at or now)).total_seconds())
            session_stop(
                session=Session(id=session_id), actor=None, reason=message("idle_for", minutes=idle_for // 60)
            )
            counts["idle"] += 1
            continue
        warned = [
            stop_warn(
                session_id=session_id, owner_id=owner_id, kind=kind, due_at=due, key=key, now=now
            ).created
            for kind, due, key in (
                (W.MAX_HOURS, ends_at, "stop_warning_max_hours"),
                (W.IDLE, idle_at if idle_seconds else None, "stop_warning_idle"),
            )
            if due is not None and now >= due - stop_warn_ahead()
        ]
        counts["warned"] += sum(warned)
    return counts


def sessions_preempt_due(*, now: datetime | None = None) -> int:
    """Stop the running interruptible sessions whose preemption warning is due and that are still
    claimed (a claim released meanwhile spares them), each marked ``preempted_at`` in the transaction
    of its stop by a conditional update (running and claimed): one its owner stopped first is not
    marked, and does not resume. Returns how many were stopped."""
    now = now or timezone.now()
    stopped = 0
    for session_id in stop_warnings_due(kind=W.PREEMPT, now=now):
        with transaction.atomic():
            if Session.objects.filter(id=session_id, state=S.RUNNING, preempted_for__isnull=False).update(
                preempted_at=now
            ):
                session_stop(session=Session(id=session_id), actor=None, reason=message("preempted"))
                stopped += 1
    return stopped


def sessions_warn_for_funds(
    *, session_refs: list[str], runway_seconds: int, now: datetime | None = None
) -> int:
    """Billing's ``runway_low``: warn those running sessions that funds run out in about
    ``runway_seconds`` (the stop itself follows ``funds_exhausted``). Returns warnings made."""
    now = now or timezone.now()
    ids = session_ids(session_refs)
    made = 0
    for session_id, owner_id in Session.objects.filter(id__in=ids, state=S.RUNNING).values_list(
        "id", "owner_id"
    ):
        due = now + timedelta(seconds=max(0, runway_seconds))
        made += stop_warn(
            session_id=session_id,
            owner_id=owner_id,
            kind=W.FUNDS,
            due_at=due,
            key="stop_warning_funds",
            now=now,
        ).created
    return made


def sessions_stop_for_funds(*, session_refs: list[str]) -> int:
    """Billing's ``funds_exhausted``: stop those sessions (reason "funds exhausted")."""
    stopped = 0
    for session in Session.objects.filter(id__in=session_ids(session_refs), state__in=Session.LIVE):
        session_stop(session=session, actor=None, reason=message("funds_exhausted"))
        stopped += 1
    return stopped


def sessions_funds_recovered(*, session_refs: list[str]) -> int:
    """Billing's ``runway_recovered``: funds were added; clear those sessions' funds warnings."""
    return stop_warnings_clear(session_ids=session_ids(session_refs), kind=W.FUNDS)
