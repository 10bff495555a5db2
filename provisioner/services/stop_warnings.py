"""Warnings before a stop: nobody loses work or money by surprise.

Every stop the portal decides on its own (idle, funds running out, the longest session time, a monthly
budget reached) is announced first, ``SESSION_STOP_WARN_SECONDS`` ahead: a live ``StopWarning`` on the
session (shown on its page and inside JupyterLab), a line in its history, and a notice to its owner
(on the portal's pages and by email, in the owner's language). The owner's home is kept, and the
warning says so. One live warning per session and kind; a warning is cleared when its cause goes away
(the session is used again, funds are added, a budget is raised) and when the session ends.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.db import IntegrityError, transaction
from django.urls import reverse
from django.utils import timezone

from notices.services import notify
from provisioner.messages import Message, message
from provisioner.models import Session, StopWarning
from provisioner.services.events import session_event

log = logging.getLogger("provisioner.stop_warnings")
W = StopWarning.Kind


@dataclass(frozen=True)
class Warned:
    """What ``stop_warn`` did: the live warning of that kind, and whether this call made it."""

    warning: StopWarning
    created: bool


def stop_warn_ahead() -> timedelta:
    """How long before a stop its warning comes (SESSION_STOP_WARN_SECONDS)."""
    return timedelta(seconds=settings.SESSION_STOP_WARN_SECONDS)


def _minutes_left(due_at: datetime, now: datetime) -> int:
    return max(1, round((due_at - now).total_seconds() / 60))


def stop_warn(
    *,
    session_id,
    owner_id: int,
    kind: str,
    due_at: datetime,
    key: str,
    params: dict | None = None,
    now: datetime | None = None,
) -> Warned:
    """Announce that a running session stops at ``due_at`` for ``kind``. Idempotent per session and kind
    while the warning is live: a repeat returns the live one and tells nobody again. The line's
    ``minutes`` parameter is the time left now; pages count down from ``due_at``."""
    now = now or timezone.now()
    live = StopWarning.objects.filter(session_id=session_id, kind=kind, cleared_at__isnull=True).first()
    if live is not None:
        return Warned(live, created=False)
    line = message(key, **(params or {}), minutes=_minutes_left(due_at, now))
    try:
        with transaction.atomic():
            warning = StopWarning.objects.create(
                session_id=session_id,
                kind=kind,
                due_at=due_at,
                message_key=line.key,
                message_params=line.params,
            )
            session_event(session_id=session_id, kind=f"{kind}_warning", line=line)
            _tell_owner(warning, owner_id=owner_id, line=line)
    except IntegrityError:  # a concurrent sweep made it first
        return Warned(
            StopWarning.objects.get(session_id=session_id, kind=kind, cleared_at__isnull=True), False
        )
    return Warned(warning, created=True)


def _tell_owner(warning: StopWarning, *, owner_id: int, line: Message) -> None:
    notify(
        users=[owner_id],
        kind="stop_warning",
        key=line.key,
        params=line.params,
        dedupe_key=f"stop-warning:{warning.id}",
        url=reverse("session_detail", args=[warning.session_id]),
    )


def stop_warnings_clear(*, session_ids, kind: str | None = None, now: datetime | None = None) -> int:
    """Clear the live warnings of these sessions (of one ``kind``, or all). Returns how many."""
    live = StopWarning.objects.filter(session_id__in=list(session_ids), cleared_at__isnull=True)
    if kind is not None:
        live = live.filter(kind=kind)
    return live.update(cleared_at=now or timezone.now())


def stop_warnings_due(*, kind: str, now: datetime) -> dict:
    """Running sessions whose live warning of ``kind`` is due: session id → warning."""
    return {
        w.session_id: w
        for w in StopWarning.objects.filter(
            kind=kind, cleared_at__isnull=True, due_at__lte=now, session__state=Session.State.RUNNING
        )
    }
