"""Lines people read, stored as a key and its parameters and rendered in the reader's language.

They are written where no reader's language is known (workers, heartbeats, sweeps, services that tell
someone something later), so a line is stored as a key of a registered template and its parameters
(``message``, ``message_columns``) and rendered when it is read, in the reader's language
(``message_render``). A parameter that is itself a message, like a stop's reason inside "Stop by …: …",
is stored nested and translated with it; one that is a name (a node, a user) or someone's own words is
shown as given. A line with no key, or with a key this code no longer knows, is shown as its stored text.

Each app registers its templates at import (``templates_register``); keys are one namespace.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from django.utils.translation import gettext

KEY_MAX_LENGTH = 32
TEXT_PARAM_MAX_LENGTH = 300  # someone's own words are kept, but not without end
_PLACEHOLDER = re.compile(r"%\((\w+)\)s")
_TEMPLATES: dict[str, str] = {}


def templates_register(templates: dict[str, str]) -> None:
    """Add ``templates`` (key → English template marked with ``gettext_noop``) to the registry. Raises
    ValueError for a key longer than ``KEY_MAX_LENGTH`` or one already registered with another text."""
    for key, template in templates.items():
        if len(key) > KEY_MAX_LENGTH:
            raise ValueError(f"message key {key!r} is longer than {KEY_MAX_LENGTH}")
        if _TEMPLATES.get(key, template) != template:
            raise ValueError(f"message key {key!r} is registered twice with different texts")
    _TEMPLATES.update(templates)


@dataclass(frozen=True)
class Message:
    """A line to store: a registered key and its parameters as JSON (a name to a string or a number, or
    to a nested message ``{"key": …, "params": {…}}``). Made by ``message``."""

    key: str
    params: dict = field(default_factory=dict)

    def __str__(self) -> str:
        return _render(self.key, self.params, translate=_as_written)


def message(key: str, **params: str | int | Message) -> Message:
    """The line ``key`` with ``params``; raises ValueError for an unknown key or parameters that are not
    exactly the template's, so a writer's mistake fails where it is made rather than on a page."""
    if key not in _TEMPLATES:
        raise ValueError(f"unknown message key {key!r}")
    wanted = set(_PLACEHOLDER.findall(_TEMPLATES[key]))
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
    return translate(_TEMPLATES[key]) % values
