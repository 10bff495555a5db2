"""A dependency's outage as one process sees it (Redis as the cache, Redis as the broker): logged once
when it starts and once when it ends, not once per request; and, for ``RETRY_SECONDS`` after each
failure, callers skip the dependency instead of waiting on it again, so an outage costs a request
nothing once it is known. In core, the bottom layer, because every layer's fail-open paths use it.
"""

from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger(__name__)

RETRY_SECONDS = 1.0


class Outage:
    """Shared by every thread of the process: ``outage(name)`` gives the one for ``name``."""

    def __init__(self, name: str, *, what_happens: str) -> None:
        self.name = name
        self.what_happens = what_happens  # said when the outage starts: how the process copes
        self._lock = threading.Lock()
        self._since: float | None = None  # monotonic time of this outage's first failure
        self._retry_at = 0.0

    @property
    def seconds(self) -> float | None:
        """How long the outage has lasted, or None while the dependency answers."""
        since = self._since
        return None if since is None else time.monotonic() - since

    def skipping(self) -> bool:
        """True while the dependency failed less than RETRY_SECONDS ago: don't ask it now."""
        return self._since is not None and time.monotonic() < self._retry_at

    def failed(self, exc: BaseException) -> None:
        now = time.monotonic()
        with self._lock:
            self._retry_at = now + RETRY_SECONDS
            if self._since is not None:
                return
            self._since = now
        log.warning("%s unreachable (%s: %s): %s", self.name, type(exc).__name__, exc, self.what_happens)

    def answered(self) -> None:
        if self._since is None:
            return
        with self._lock:
            since, self._since = self._since, None
        if since is not None:
            log.warning("%s reachable again after %.1f s", self.name, time.monotonic() - since)


_outages: dict[str, Outage] = {}
_outages_lock = threading.Lock()


def outage(name: str, *, what_happens: str) -> Outage:
    """The process's one ``Outage`` for ``name`` (created on first use)."""
    with _outages_lock:
        if name not in _outages:
            _outages[name] = Outage(name, what_happens=what_happens)
        return _outages[name]
