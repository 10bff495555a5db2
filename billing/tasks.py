"""Celery tasks of billing: thin and idempotent; each calls one service."""

from __future__ import annotations

import time

from celery import shared_task
from django.core.cache import cache

from billing.services.cards import card_expire, card_remind
from billing.services.metering import metering_tick
from billing.services.reconcile import ledger_reconcile

METERING_TICK_SECONDS_KEY = "metrics:metering_tick_seconds"  # the last tick's duration, for /metrics


@shared_task(name="billing.tasks.metering_tick_task", ignore_result=True)
def metering_tick_task() -> int:
    started = time.monotonic()
    posted = metering_tick().posted_meters
    cache.set(METERING_TICK_SECONDS_KEY, time.monotonic() - started, timeout=None)  # shared by every worker
    return posted


@shared_task(name="billing.tasks.card_expire_task", ignore_result=True)
def card_expire_task() -> int:
    return card_expire()


@shared_task(name="billing.tasks.card_remind_task", ignore_result=True)
def card_remind_task() -> int:
    return card_remind()


@shared_task(name="billing.tasks.ledger_reconcile_task", ignore_result=True)
def ledger_reconcile_task() -> int:
    return len(ledger_reconcile())
