"""The fail-open cache against a Redis that cannot be reached (a closed port), and against the real one."""

import logging
import time

import pytest
from django.core.cache import cache

from core.outage import outage

CLOSED = "redis://127.0.0.1:1/0"  # nothing listens on port 1: every connection is refused


@pytest.fixture
def cache_down(settings):
    settings.CACHES = {"default": {**settings.CACHES["default"], "LOCATION": CLOSED}}  # the product's backend
    yield
    outage(f"cache {CLOSED}", what_happens="").answered()


def test_an_unreachable_cache_is_a_miss_and_every_write_a_no_op(cache_down):
    cache.set("k", 1)
    assert cache.get("k") is None
    assert cache.get("k", "fallback") == "fallback"
    assert cache.get_many(["k", "j"]) == {}
    assert cache.add("k", 0) is True
    assert cache.has_key("k") is False
    assert cache.delete("k") is False
    cache.delete_many(["k"])
    with pytest.raises(ValueError):
        cache.incr("k")  # as Django's DummyCache: callers already handle a missing counter


def test_an_outage_is_logged_once_and_costs_milliseconds(cache_down, caplog):
    caplog.set_level(logging.WARNING, logger="core.outage")
    started = time.perf_counter()
    for i in range(200):
        cache.get(f"k{i}")
    elapsed = time.perf_counter() - started
    warnings = [r for r in caplog.records if "unreachable" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in caplog.records]
    assert elapsed < 1.0, f"200 reads of a dead cache took {elapsed:.2f} s"


def test_the_reachable_cache_still_caches():
    cache.set("fail-open-probe", 41)
    assert cache.incr("fail-open-probe") == 42
    assert cache.get("fail-open-probe") == 42


def test_every_context_of_a_process_shares_one_redis_client_and_its_connections():
    """Django makes a cache backend per context (under ASGI, per request); they share one client, so a
    request that uses the cache opens no connection of its own."""
    import contextvars

    import redis
    from django.conf import settings
    from django.core.cache import caches

    def backend_used():
        backend = caches["default"]
        backend.set("shared", 1)
        return backend

    backends = [contextvars.Context().run(backend_used) for _ in range(20)]
    assert len({id(b) for b in backends}) == 20
    assert len({id(b._cache) for b in backends}) == 1
    stats = redis.Redis.from_url(settings.REDIS_URL)
    before = stats.info("stats")["total_connections_received"]
    for _ in range(20):
        contextvars.Context().run(backend_used)
    assert stats.info("stats")["total_connections_received"] - before == 0
