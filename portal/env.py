"""Typed settings from the environment.

One helper reads every setting; a value that does not parse stops the process with one line naming the
variable, what it got and what it wants, instead of a traceback deep inside Django.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TypeVar
from urllib.parse import urlsplit

T = TypeVar("T")

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


class ConfigError(Exception):
    """A setting from the environment is missing or malformed."""


def _parse_bool(raw: str) -> bool:
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError("expected one of 1/0, true/false, yes/no, on/off")


def _parse_list(raw: str) -> list[str]:
    return [item.strip() for item in raw.split(",") if item.strip()]


def _parse_url(schemes: tuple[str, ...], serverless: tuple[str, ...] = ()) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        parts = urlsplit(raw)
        if parts.scheme not in schemes:
            raise ValueError(f"expected a URL starting with {' or '.join(s + '://' for s in schemes)}")
        if parts.scheme not in serverless and not (parts.hostname or parts.path or parts.query):
            raise ValueError("the URL names no server")
        return raw

    return parse


def _parse_int(raw: str) -> int:
    return int(raw.strip())


def env(name: str, default: T, parse: Callable[[str], T] | None = None, *, choices: tuple | None = None) -> T:
    """Read ``name`` from the environment, parsed to the type of ``default``.

    Raises ConfigError naming the variable when the value does not parse or is not one of ``choices``.
    """
    raw = os.environ.get(name)
    if raw is None:
        return default
    if parse is None:
        if isinstance(default, bool):
            parse = _parse_bool  # type: ignore[assignment]
        elif isinstance(default, int):
            parse = _parse_int  # type: ignore[assignment]
        elif isinstance(default, float):
            parse = float  # type: ignore[assignment]
        elif isinstance(default, list):
            parse = _parse_list  # type: ignore[assignment]
        else:
            parse = str  # type: ignore[assignment]
    try:
        value = parse(raw)  # type: ignore[misc]
    except ValueError as exc:
        raise ConfigError(f"{name}={raw!r} is not valid: {exc}") from None
    if choices is not None and value not in choices:
        raise ConfigError(f"{name}={raw!r} is not valid: expected one of {', '.join(map(str, choices))}")
    return value


_RATE_PERIODS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def throttle_rate_parts(rate: str) -> tuple[int, int]:
    """A throttle rate as DRF writes it, ``<count>/<period>`` with a period read by its first letter
    (s, min, hour, day), as (count, period in seconds): ``30/min`` is (30, 60)."""
    count, _, period = rate.strip().partition("/")
    if not count.isdigit() or int(count) < 1 or period[:1] not in _RATE_PERIODS:
        raise ValueError("expected a rate such as 30/min: a positive count, /, then s, min, hour or day")
    return int(count), _RATE_PERIODS[period[:1]]


def percents_parts(raw: str) -> tuple[int, ...]:
    """Percentages as a comma-separated list, ascending, each from 1 to 100: ``50,80,100``."""
    items = [p.strip() for p in raw.split(",") if p.strip()]
    if not items or not all(p.isdigit() and 1 <= int(p) <= 100 for p in items):
        raise ValueError("expected percentages such as 50,80,100: whole numbers from 1 to 100")
    return tuple(sorted({int(p) for p in items}))


def throttle_rate(raw: str) -> str:
    """A throttle rate, checked here rather than on the first request that meets the throttle."""
    throttle_rate_parts(raw)
    return raw.strip()


database_url = _parse_url(("postgres", "postgresql"))
redis_url = _parse_url(("redis", "rediss", "unix", "redis+socket"))
sso_issuer_url = _parse_url(("https", "http"))
email_url = _parse_url(
    ("console", "smtp", "smtps", "locmem", "dummy", "file"), serverless=("console", "locmem", "dummy")
)
