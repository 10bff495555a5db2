"""Liveness and readiness, for load balancers, orchestrators and people.

- Liveness (``/livez``): the web process answers. No dependency is asked; the ASGI application answers
  it before Django (``portal/asgi.py``), so a busy thread pool or a dead database never fails it.
- Readiness (``/readyz``, and ``/healthz`` for older probes): each dependency's state with its latency.
  Ready (200) while the database answers, because then the portal serves: with Redis down the cache
  fails open and launches and stops are picked up by the agents' heartbeats. Not ready (503) only when
  the database is down. Celery is judged from pulses in Redis (each worker's own, and beat's through a
  worker), never by a broadcast ping, so the check costs a few milliseconds, not a ping's timeout.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import lru_cache

import redis
from django.conf import settings
from django.db import connection
from redis.backoff import NoBackoff
from redis.retry import Retry

from portal.tasks import BEAT_PULSE_KEY, WORKER_PULSE_KEY, WORKER_PULSE_SECONDS

LIVENESS_BODY = b'{"status": "ok"}'
NOT_READY_RETRY_AFTER_SECONDS = 5


async def liveness_asgi(scope, receive, send) -> None:
    """``/livez`` as a bare ASGI answer: the process and its event loop are alive."""
    headers = [(b"content-type", b"application/json"), (b"cache-control", b"no-store")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": LIVENESS_BODY})


@lru_cache(maxsize=4)
def _redis(url: str) -> redis.Redis:
    """One client (and connection pool) per URL, with timeouts short enough that a dead Redis costs a
    probe a quarter of a second at most."""
    return redis.Redis.from_url(
        url,
        socket_timeout=0.5,
        socket_connect_timeout=0.25,
        retry=Retry(NoBackoff(), 1),  # once more on a fresh connection: a pooled one dies with a restart
        retry_on_error=[redis.ConnectionError],
    )


def _timed(check: Callable[[], dict]) -> dict:
    started = time.perf_counter()
    try:
        part = {"ok": True, **check()}
    except Exception as exc:  # any failure of a dependency is a red light, never a 500
        part = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:300]}
    return {**part, "latency_ms": round((time.perf_counter() - started) * 1000, 2)}


def _database() -> dict:
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")
        cursor.fetchone()
    return {}


def _pulses() -> dict:
    """Redis's ping, the workers that pulsed within three of their intervals and beat's last pulse, in
    one round trip."""
    now = time.time()
    recent = now - 3 * WORKER_PULSE_SECONDS
    pipe = _redis(settings.REDIS_URL).pipeline(transaction=False)
    pipe.ping().zrangebyscore(WORKER_PULSE_KEY, recent, "+inf").get(BEAT_PULSE_KEY)
    _pong, workers, beat = pipe.execute()
    return {
        "workers": sorted(w.decode() for w in workers),
        "beat_pulse_age_seconds": round(now - float(beat), 1) if beat else None,
    }


def readiness_report() -> tuple[bool, dict]:
    """(ready, report): ready while the database answers; the report names every dependency's state."""
    report = {"database": _timed(_database)}
    pulses = _timed(_pulses)
    report["redis"] = {key: pulses[key] for key in ("ok", "error", "latency_ms") if key in pulses}
    if pulses["ok"]:
        workers, beat_age = pulses["workers"], pulses["beat_pulse_age_seconds"]
        report["celery"] = {"ok": bool(workers), "workers": workers}
        beat_fresh = beat_age is not None and beat_age < 3 * settings.BEAT_PULSE_SECONDS
        report["beat"] = {"ok": beat_fresh, "pulse_age_seconds": beat_age}
    else:
        unknown = {"ok": False, "error": "unknown: Redis (the broker) is unreachable"}
        report["celery"], report["beat"] = dict(unknown), dict(unknown)
    ready = report["database"]["ok"]
    healthy = all(part["ok"] for part in report.values())
    status = "ok" if healthy else "degraded" if ready else "unavailable"
    return ready, {"status": status, **report}
