"""Celery tasks of the portal app."""

from __future__ import annotations

import time

import redis
from celery import shared_task
from django.conf import settings

BEAT_PULSE_KEY = "suanli:beat_pulse"


def redis_client() -> redis.Redis:
    return redis.Redis.from_url(settings.REDIS_URL, socket_timeout=2, socket_connect_timeout=2)


@shared_task(name="portal.tasks.beat_pulse", ignore_result=True)
def beat_pulse() -> float:
    """Beat schedules it, a worker runs it: a fresh pulse in Redis proves beat, broker and worker work."""
    now = time.time()
    redis_client().set(BEAT_PULSE_KEY, repr(now), ex=3600)
    return now
