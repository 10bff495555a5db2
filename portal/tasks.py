"""Celery tasks of the portal app."""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from datetime import timedelta

import redis
from celery import shared_task
from celery.signals import worker_ready, worker_shutdown
from django.conf import settings
from django.utils import timezone

from billing.services.cards import card_daily_grant
from portal.homes import home_storage
from portal.models import User

log = logging.getLogger("portal.tasks")

BEAT_PULSE_KEY = "suanli:beat_pulse"
WORKER_PULSE_KEY = "suanli:worker_pulse"  # a sorted set: each worker's name, scored by its last pulse
WORKER_PULSE_SECONDS = 5.0
WORKER_PULSE_KEPT_SECONDS = 3600  # a worker gone this long leaves the set


def redis_client() -> redis.Redis:
    return redis.Redis.from_url(settings.REDIS_URL, socket_timeout=2, socket_connect_timeout=2)


@worker_ready.connect
def worker_pulse_start(sender=None, **_kwargs) -> None:
    """Each worker stamps its name in Redis every WORKER_PULSE_SECONDS from a thread of its own, so the
    readiness check reads which workers are up instead of waiting on a broadcast ping."""
    hostname = getattr(sender, "hostname", None) or socket.gethostname()
    threading.Thread(target=_worker_pulse, args=(hostname,), name="worker-pulse", daemon=True).start()


def _worker_pulse(hostname: str) -> None:
    client = redis_client()
    while True:
        now = time.time()
        # with the broker down the worker says so itself, and readiness shows Redis down
        with contextlib.suppress(redis.RedisError):
            pipe = client.pipeline(transaction=False).zadd(WORKER_PULSE_KEY, {hostname: now})
            pipe.zremrangebyscore(WORKER_PULSE_KEY, "-inf", now - WORKER_PULSE_KEPT_SECONDS).execute()
        time.sleep(WORKER_PULSE_SECONDS)


@worker_shutdown.connect
def worker_pulse_stop(sender=None, **_kwargs) -> None:
    """A worker that stops cleanly leaves the set at once (a killed one ages out)."""
    hostname = getattr(sender, "hostname", None) or socket.gethostname()
    with contextlib.suppress(redis.RedisError):
        redis_client().zrem(WORKER_PULSE_KEY, hostname)


@shared_task(name="portal.tasks.beat_pulse", ignore_result=True)
def beat_pulse() -> float:
    """Beat schedules it, a worker runs it: a fresh pulse in Redis proves beat, broker and worker work."""
    now = time.time()
    redis_client().set(BEAT_PULSE_KEY, repr(now), ex=3600)
    return now


@shared_task(name="portal.tasks.daily_grants_task", ignore_result=True)
def daily_grants_task() -> int:
    """The daily grant (off unless CARD_DAILY_GRANT_MICROS > 0) for every active user who logged in
    within CARD_DAILY_GRANT_ACTIVE_DAYS, on their own account. Beat runs it every hour; the grant is
    once per user and local day, so the first run after midnight grants and the others find it made."""
    if settings.CARD_DAILY_GRANT_MICROS <= 0:
        return 0
    since = timezone.now() - timedelta(days=settings.CARD_DAILY_GRANT_ACTIVE_DAYS)
    granted = 0
    for user in User.objects.filter(
        is_active=True, last_login__gte=since, account__isnull=False
    ).select_related("account"):
        try:
            granted += card_daily_grant(user=user, account=user.account) is not None
        except Exception:  # one user's failure must not cost everyone else their grant
            log.exception("daily grant for user %s", user.pk)
    return granted


@shared_task
def uploads_expire_task() -> int:
    """Hourly: discard partial uploads from the portal that no part reached for
    HOMES_UPLOAD_ABANDONED_HOURS (they sit outside the homes, where no quota counts them)."""
    expired = home_storage().uploads_expire(idle_seconds=settings.HOMES_UPLOAD_ABANDONED_HOURS * 3600)
    if expired:
        log.info("discarded %d abandoned uploads", expired)
    return expired
