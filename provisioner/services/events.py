"""A session's history: one line per event, stored as a message key and rendered when read.

Apart from ``sessions`` so that the services that write history lines and that ``sessions`` calls
(stop warnings, preemption) need not import it back.
"""

from __future__ import annotations

from provisioner.messages import Message, message_columns
from provisioner.models import SessionEvent


def event_fields(line: Message | str) -> dict:
    """The columns of a history line: its message key, parameters and English text."""
    key, params, text = message_columns(line)
    return {"message_key": key, "message_params": params, "message": text[:500]}


def session_event(
    *, session_id, kind: str, line: Message | str, from_state: str = "", to_state: str = ""
) -> None:
    """Add a line to a session's history: a message (rendered in the reader's language) or free text."""
    SessionEvent.objects.create(
        session_id=session_id, kind=kind, from_state=from_state, to_state=to_state, **event_fields(line)
    )
