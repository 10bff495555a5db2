"""The state of the parts the product depends on, for /healthz."""

from __future__ import annotations

import time

from django.db import connection

from portal.celery import app as celery_app
from portal.tasks import BEAT_PULSE_KEY, redis_client


def _database() -> dict:
    started = time.perf_counter()
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")
        cursor.fetchone()
    return {"ok": True, "latency_ms": round((time.perf_counter() - started) * 1000, 2)}


def _redis() -> dict:
    started = time.perf_counter()
    redis_client().ping()
    return {"ok": True, "latency_ms": round((time.perf_counter() - started) * 1000, 2)}


def _celery() -> dict:
    replies = celery_app.control.ping(timeout=1.0) or []
    workers = sorted(name for reply in replies for name in reply)
    pulse = redis_client().get(BEAT_PULSE_KEY)
    pulse_age = round(time.time() - float(pulse), 1) if pulse else None
    return {"ok": bool(workers), "workers": workers, "beat_pulse_age_seconds": pulse_age}


def health_report() -> tuple[bool, dict]:
    checks = {"database": _database, "redis": _redis, "celery": _celery}
    report: dict = {}
    for name, check in checks.items():
        if name == "celery" and not report["redis"]["ok"]:
            report[name] = {"ok": False, "error": "the broker (Redis) is unreachable"}
            continue
        try:
            report[name] = check()
        except Exception as exc:  # any failure of a dependency is a red light, never a 500
            report[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:300]}
    healthy = all(part["ok"] for part in report.values())
    return healthy, {"status": "ok" if healthy else "degraded", **report}
