"""The cache backend: Django's Redis cache that fails open. While Redis cannot be reached it behaves as
Django's ``DummyCache`` (every read a miss, every write dropped, ``incr`` of a missing key a
``ValueError``), so the throttles let requests through, the login lockout counts nothing and no page or
API answer fails because of the cache. An outage is logged once when it starts and once when it ends,
per process, not once per request (``core.outage``).

After a failure the backend does not ask Redis again for ``core.outage.RETRY_SECONDS`` (every call
meanwhile is a miss at no cost), so a dead Redis costs one short socket timeout per process and
interval, not one per cache call. In core, the bottom layer: every app's throttles and caches use it.

Django makes a cache backend per context, and under ASGI every request is a context of its own: each
backend would make its own Redis client and connection pool, so every request that used the cache opened
a new connection. Here the backends of one process share one client (and its pool) per location and
options.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

from django.core.cache.backends.base import DEFAULT_TIMEOUT
from django.core.cache.backends.redis import RedisCache
from django.utils.functional import cached_property
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from core.outage import outage

UNREACHABLE = (RedisConnectionError, RedisTimeoutError)

T = TypeVar("T")

_clients: dict[tuple, Any] = {}  # (client class, servers, options) → the process's RedisCacheClient
_clients_lock = threading.Lock()


class FailOpenRedisCache(RedisCache):
    """``django.core.cache.backends.redis.RedisCache`` that answers as a miss or a no-op while Redis
    cannot be reached (see the module's docstring). Errors other than an unreachable server (a wrong
    command, bad data) still raise."""

    def __init__(self, server, params) -> None:
        super().__init__(server, params)
        location = server if isinstance(server, str) else ",".join(server)
        self._outage = outage(f"cache {location}", what_happens="failing open (misses, no throttling)")

    @cached_property
    def _cache(self):
        """The process's client for this location and options (its connection pools with it)."""
        key = (self._class, tuple(self._servers), repr(sorted(self._options.items())))
        with _clients_lock:
            client = _clients.get(key)
            if client is None:
                client = _clients[key] = self._class(self._servers, **self._options)
        return client

    def _guarded(self, call: Callable[[], T], fallback: Callable[[], T]) -> T:
        if self._outage.skipping():
            return fallback()
        try:
            result = call()
        except UNREACHABLE as exc:
            self._outage.failed(exc)
            return fallback()
        self._outage.answered()
        return result

    def add(self, key, value, timeout=DEFAULT_TIMEOUT, version=None) -> bool:
        return self._guarded(lambda: super(FailOpenRedisCache, self).add(key, value, timeout, version), _true)

    def get(self, key, default=None, version=None) -> Any:
        return self._guarded(
            lambda: super(FailOpenRedisCache, self).get(key, default, version), lambda: default
        )

    def set(self, key, value, timeout=DEFAULT_TIMEOUT, version=None) -> None:
        self._guarded(lambda: super(FailOpenRedisCache, self).set(key, value, timeout, version), _none)

    def touch(self, key, timeout=DEFAULT_TIMEOUT, version=None) -> bool:
        return self._guarded(lambda: super(FailOpenRedisCache, self).touch(key, timeout, version), _false)

    def delete(self, key, version=None) -> bool:
        return self._guarded(lambda: super(FailOpenRedisCache, self).delete(key, version), _false)

    def get_many(self, keys, version=None) -> dict:
        return self._guarded(lambda: super(FailOpenRedisCache, self).get_many(keys, version), dict)

    def has_key(self, key, version=None) -> bool:
        return self._guarded(lambda: super(FailOpenRedisCache, self).has_key(key, version), _false)

    def incr(self, key, delta=1, version=None) -> int:
        return self._guarded(lambda: super(FailOpenRedisCache, self).incr(key, delta, version), _missing(key))

    def set_many(self, data, timeout=DEFAULT_TIMEOUT, version=None) -> list:
        return self._guarded(lambda: super(FailOpenRedisCache, self).set_many(data, timeout, version), list)

    def delete_many(self, keys, version=None) -> None:
        self._guarded(lambda: super(FailOpenRedisCache, self).delete_many(keys, version), _none)

    def clear(self) -> bool:
        return self._guarded(lambda: super(FailOpenRedisCache, self).clear(), _false)


def _true() -> bool:
    return True


def _false() -> bool:
    return False


def _none() -> None:
    return None


def _missing(key: str) -> Callable[[], int]:
    def fallback() -> int:
        raise ValueError(f"Key '{key}' not found (the cache is unreachable)")

    return fallback
