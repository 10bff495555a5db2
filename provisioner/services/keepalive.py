""" "I'm still here": the owner of a running session puts off its idle stop (the button of the idle
warning inside JupyterLab, ``POST /api/v1/sessions/<id>/still-here``).

Its own module, beside ``sessions.py``: the idle sweep there decides when to warn and stop; this only
restarts the clock that sweep reads (``last_active_at``) and takes back the warning it gave.
"""

from __future__ import annotations

from django.db import transaction
from django.utils import timezone
from django.utils.translation import gettext as _

from core.errors import Conflict
from provisioner.messages import message
from provisioner.models import Session, StopWarning
from provisioner.services.events import session_event


class SessionNotRunning(Conflict):
    code = "session_not_running"


def session_keep_alive(*, session_id) -> bool:
    """Restart a running session's idle clock: in one transaction ``last_active_at`` becomes now and the
    live idle StopWarning is cleared (so the sweep warns again before a later idle stop), with a "Kept
    alive by its owner" line in the session's history.

    A conditional update on the state, no lock held: raises ``SessionNotRunning`` (409) when the session
    is not running. Idempotent: a repeat only moves the clock again and writes no second line (a script
    calling it in a loop cannot fill the history). Returns whether a warning was cleared."""
    now = timezone.now()
    with transaction.atomic():
        moved = Session.objects.filter(id=session_id, state=Session.State.RUNNING).update(last_active_at=now)
        if not moved:
            raise SessionNotRunning(_("This session is not running."))
        cleared = StopWarning.objects.filter(
            session_id=session_id, kind=StopWarning.Kind.IDLE, cleared_at__isnull=True
        ).update(cleared_at=now)
        if cleared:
            session_event(session_id=session_id, kind="kept_alive", line=message("kept_alive"))
    return bool(cleared)
