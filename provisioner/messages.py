"""The lines people read about their sessions: lifecycle events and the reason of the last transition.

They are written by workers, heartbeats and sweeps, where no reader's language is known, so a line is
stored as a key of ``TEMPLATES`` and its parameters (``message``, ``message_columns``) and rendered when
it is read, in the reader's language (``message_render``). A parameter that is itself a message, like a
stop's reason inside "Stop by …: …", is stored nested and translated with it; one that is a name (a
node, a user) or someone's own words (an agent's exit reason, an owner's reason to stop) is shown as
given. The English rendering is stored beside the key for the admin, the logs and the API's ``reason``.
A line with no key, or with a key this code no longer knows, is shown as that stored text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from django.utils.translation import gettext, gettext_noop

TEMPLATES: dict[str, str] = {
    "launched_by": gettext_noop("Launched by %(user)s"),
    "placed_on": gettext_noop("Placed on %(node)s"),
    "no_room": gettext_noop("No free %(gpu_model)s %(profile)s right now: waiting in the queue."),
    "cancelled": gettext_noop("Cancelled: %(why)s"),
    "cancelled_by": gettext_noop("Cancelled by %(actor)s: %(why)s"),
    "stop": gettext_noop("Stop: %(why)s"),
    "stop_by": gettext_noop("Stop by %(actor)s: %(why)s"),
    "starting": gettext_noop("The agent is starting Jupyter"),
    "running": gettext_noop("Jupyter is running"),
    "stopped": gettext_noop("Stopped"),
    "queue_timeout": gettext_noop("Waited longer than %(minutes)s minutes in the queue"),
    "longest_reached": gettext_noop("longest session time reached"),
    "idle_for": gettext_noop("idle for %(minutes)s minutes"),
    "idle_warning": gettext_noop("No activity: this session stops in about %(minutes)s minutes unless used."),
    "funds_exhausted": gettext_noop("funds exhausted"),
    "budget_reached": gettext_noop("monthly budget reached"),
    "stop_warning_idle": gettext_noop(
        "No activity: this session stops in about %(minutes)s minutes unless it is used. "
        "Your home folder is kept."
    ),
    "stop_warning_funds": gettext_noop(
        "Funds are running out: this session stops in about %(minutes)s minutes unless you top up or redeem "
        "a card. Your home folder is kept."
    ),
    "stop_warning_max_hours": gettext_noop(
        "This session reaches its longest time and stops in about %(minutes)s minutes. "
        "Your home folder is kept."
    ),
    "stop_warning_budget_you": gettext_noop(
        "You reached this month's budget: this session stops in about %(minutes)s minutes. "
        "Your home folder is kept."
    ),
    "stop_warning_budget_team": gettext_noop(
        "This team reached this month's budget: this session stops in about %(minutes)s minutes. "
        "Your home folder is kept."
    ),
    "stop_warning_budget_member": gettext_noop(
        "Your share of this team reached this month's budget: this session stops in about %(minutes)s "
        "minutes. Your home folder is kept."
    ),
    "budget_threshold_you": gettext_noop(
        "You have used %(percent)s%% of this month's budget (%(spent)s spent, %(card_hours)s card-hours)."
    ),
    "budget_threshold_team": gettext_noop(
        "This team has used %(percent)s%% of this month's budget (%(spent)s spent, "
        "%(card_hours)s card-hours)."
    ),
    "budget_threshold_member": gettext_noop(
        "Your share of this team has used %(percent)s%% of this month's budget (%(spent)s spent, "
        "%(card_hours)s card-hours)."
    ),
    "asked_by_owner": gettext_noop("asked by its owner"),
    "kept_alive": gettext_noop("Kept alive by its owner"),
    "from_session_page": gettext_noop("from the session page"),
    "forced_by_admin": gettext_noop("forced by an admin"),
    "node_drained": gettext_noop("node drained by an admin"),
    "jupyter_exited": gettext_noop("Jupyter exited: %(why)s"),
    "jupyter_exited_plain": gettext_noop("Jupyter exited"),
    "workload_failed": gettext_noop("the workload failed"),
    "failed_on": gettext_noop("Failed on %(node)s: %(why)s"),
    "node_silent": gettext_noop("Node %(node)s stopped answering (no heartbeat since %(time)s)"),
    "start_timeout": gettext_noop("Jupyter did not start within %(seconds)s s"),
    "node_refused": gettext_noop("The node refused the workload (%(code)s): %(why)s"),
    "could_not_start": gettext_noop("Jupyter could not start: %(why)s"),
}
KEY_MAX_LENGTH = 32
TEXT_PARAM_MAX_LENGTH = 300  # an agent's words are its own: kept, but not without end
_PLACEHOLDER = re.compile(r"%\((\w+)\)s")


@dataclass(frozen=True)
class Message:
    """A line to store: a key of ``TEMPLATES`` and its parameters as JSON (a name to a string or a
    number, or to a nested message ``{"key": …, "params": {…}}``). Made by ``message``."""

    key: str
    params: dict = field(default_factory=dict)

    def __str__(self) -> str:
        return _render(self.key, self.params, translate=_as_written)


def message(key: str, **params: str | int | Message) -> Message:
    """The line ``key`` with ``params``; raises ValueError for an unknown key or parameters that are not
    exactly the template's, so a writer's mistake fails where it is made rather than on a page."""
    if key not in TEMPLATES:
        raise ValueError(f"unknown message key {key!r}")
    wanted = set(_PLACEHOLDER.findall(TEMPLATES[key]))
    if set(params) != wanted:
        raise ValueError(f"message {key!r} takes {sorted(wanted)}, not {sorted(params)}")
    return Message(key, {name: _param(value) for name, value in params.items()})


def _param(value: str | int | Message) -> str | int | dict:
    if isinstance(value, Message):
        return {"key": value.key, "params": value.params}
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    return str(value)[:TEXT_PARAM_MAX_LENGTH]


def message_columns(value: Message | str) -> tuple[str, dict, str]:
    """What a row stores for ``value``: (key, params, English text). Free text is ("", {}, text)."""
    if isinstance(value, Message):
        return value.key, value.params, str(value)
    return "", {}, value


def message_load(key: str, params: dict, stored: str) -> Message | str:
    """A stored line back as the ``Message`` it was written from, or as its text when it has no key
    this code knows or parameters that no longer fit (to store it again elsewhere, as it was)."""
    try:
        _render(key, params or {}, translate=_as_written)
    except (KeyError, TypeError, ValueError):
        return stored
    return Message(key, params or {})


def message_render(key: str, params: dict, *, stored: str = "") -> str:
    """The line in the active language; ``stored`` when it has no key this code knows, or parameters
    that no longer fit its template."""
    try:
        return _render(key, params or {}, translate=gettext)
    except (KeyError, TypeError, ValueError):
        return stored


def _as_written(template: str) -> str:
    return template


def _render(key: str, params: dict, *, translate) -> str:
    values = {
        name: _render(value["key"], value.get("params") or {}, translate=translate)
        if isinstance(value, dict)
        else value
        for name, value in params.items()
    }
    return translate(TEMPLATES[key]) % values
