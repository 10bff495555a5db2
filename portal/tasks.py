"""Celery tasks of the portal app."""

from __future__ import annotations

import logging
import time
from datetime import timedelta

import redis
from celery import shared_task
from django.conf import settings
from django.utils import timezone

from billing.services.cards import card_daily_grant
from portal.models import User

log = logging.getLogger("portal.tasks")

BEAT_PULSE_KEY = "suanli:beat_pulse"


def redis_client() -> redis.Redis:
    return redis.Redis.from_url(settings.REDIS_URL, socket_timeout=2, socket_connect_timeout=2)


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
