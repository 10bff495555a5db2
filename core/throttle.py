"""Fixed-window counters in the cache, for the throttles of services: a user's launches, sign-ups and
confirmation emails from one address. In core, the bottom layer, because every app's services use it.
"""

from __future__ import annotations

import logging

from django.core.cache import cache

log = logging.getLogger(__name__)


def attempt_count(key: str, *, window_seconds: int) -> int | None:
    """Count one attempt under ``key`` in a fixed window of ``window_seconds`` from the first attempt
    (add then incr, so concurrent attempts all count) and return the count so far.

    Returns None when the cache cannot be reached, after logging a warning: a throttle fails open, so a
    Redis restart slows nobody down instead of locking every user out."""
    try:
        cache.add(key, 0, timeout=window_seconds)
        try:
            return cache.incr(key)
        except ValueError:  # the window expired between add and incr
            cache.set(key, 1, timeout=window_seconds)
            return 1
    except Exception:  # any failure of the cache backend (redis-py's errors, a timeout): fail open
        log.warning("throttle skipped: the cache is unreachable (%s)", key, exc_info=True)
        return None
