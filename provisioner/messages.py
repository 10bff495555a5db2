"""The lines people read about their sessions: lifecycle events and the reason of the last transition.

They are written by workers, heartbeats and sweeps, where no reader's language is known, so they are
stored in English as written (the admin, the logs and the API's ``reason`` read them as they are), each
made from one of the templates below by ``line``. A page shows them with ``line_translate``: it finds the
template a stored line was made from, translates it into the active language, and translates its values
the same way, so a stop's reason inside "Stop by …: …" is translated too. A line made from no template
(an agent's own words, an old row) is shown as stored.
"""

from __future__ import annotations

import functools
import re

from django.utils.translation import gettext, gettext_noop

LAUNCHED_BY = gettext_noop("Launched by %(user)s")
PLACED_ON = gettext_noop("Placed on %(node)s")
NO_ROOM = gettext_noop("No free %(gpu_model)s %(profile)s right now: waiting in the queue.")
CANCELLED = gettext_noop("Cancelled: %(why)s")
CANCELLED_BY = gettext_noop("Cancelled by %(actor)s: %(why)s")
STOP = gettext_noop("Stop: %(why)s")
STOP_BY = gettext_noop("Stop by %(actor)s: %(why)s")
STARTING = gettext_noop("The agent is starting Jupyter")
RUNNING = gettext_noop("Jupyter is running")
STOPPED = gettext_noop("Stopped")
QUEUE_TIMEOUT = gettext_noop("Waited longer than %(minutes)s minutes in the queue")
LONGEST_REACHED = gettext_noop("longest session time reached")
IDLE_FOR = gettext_noop("idle for %(minutes)s minutes")
IDLE_WARNING = gettext_noop("No activity: this session stops in about %(minutes)s minutes unless used.")
FUNDS_EXHAUSTED = gettext_noop("funds exhausted")
ASKED_BY_OWNER = gettext_noop("asked by its owner")
FROM_SESSION_PAGE = gettext_noop("from the session page")
FORCED_BY_ADMIN = gettext_noop("forced by an admin")
NODE_DRAINED = gettext_noop("node drained by an admin")
JUPYTER_EXITED = gettext_noop("Jupyter exited: %(why)s")
JUPYTER_EXITED_PLAIN = gettext_noop("Jupyter exited")
WORKLOAD_FAILED = gettext_noop("the workload failed")
FAILED_ON = gettext_noop("Failed on %(node)s: %(why)s")
NODE_SILENT = gettext_noop("Node %(node)s stopped answering (no heartbeat since %(time)s)")
START_TIMEOUT = gettext_noop("Jupyter did not start within %(seconds)s s")
NODE_REFUSED = gettext_noop("The node refused the workload (%(code)s): %(why)s")
COULD_NOT_START = gettext_noop("Jupyter could not start: %(why)s")

TEMPLATES = [value for name, value in sorted(globals().items()) if name.isupper() and isinstance(value, str)]
_PLACEHOLDER = re.compile(r"%\((\w+)\)s")


def line(template: str, **values) -> str:
    """The stored (English) line: ``template`` with ``values``."""
    return template % {name: str(value) for name, value in values.items()}


def _pattern(template: str) -> re.Pattern:
    parts = _PLACEHOLDER.split(template)  # literal, name, literal, name, …, literal
    regex = "".join(re.escape(part) if i % 2 == 0 else f"(?P<{part}>.+?)" for i, part in enumerate(parts))
    return re.compile(f"^{regex}$", re.DOTALL)


# Templates with more literal text first, so "Stop by %(actor)s: …" wins over "Stop: …".
_PATTERNS = sorted(
    ((template, _pattern(template)) for template in TEMPLATES),
    key=lambda pair: -len(_PLACEHOLDER.sub("", pair[0])),
)


@functools.lru_cache(maxsize=4096)
def _parse(stored: str) -> tuple[str, tuple[tuple[str, str], ...]] | None:
    for template, pattern in _PATTERNS:
        match = pattern.match(stored)
        if match:
            return template, tuple(match.groupdict().items())
    return None


def line_translate(stored: str, *, depth: int = 2) -> str:
    """``stored`` in the active language when it was made from a template here, else as it is."""
    if not stored:
        return stored
    parsed = _parse(stored)
    if parsed is None:
        return stored
    template, values = parsed
    if depth > 0:
        values = tuple((name, line_translate(value, depth=depth - 1)) for name, value in values)
    return gettext(template) % dict(values)
