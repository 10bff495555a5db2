"""The portal's /metrics reads the fleet and the ledger from the database at scrape time."""

from __future__ import annotations

import math
from datetime import timedelta

import pytest
from celery import shared_task
from django.core.cache import cache
from django.test import Client
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from billing.models import LedgerAccount, Transfer
from billing.services.ledger import system_account, transfer_post, wallet_for
from billing.tasks import METERING_TICK_SECONDS_KEY, metering_tick_task
from portal.metrics import TASK_FAILURES_KEY
from provisioner.models import Session
from tests.provisioner.factories import catalog_make, node_make, profiles_ensure, session_row, user_make

pytestmark = pytest.mark.django_db


def _scrape() -> dict[str, list]:
    text = Client().get("/metrics").content.decode()
    return {family.name: family.samples for family in text_string_to_metric_families(text)}


def test_running_sessions_queue_and_heartbeats_come_from_the_database():
    profiles_ensure()
    model = catalog_make()
    user = user_make()
    node = node_make("gpu-host-1")
    for profile in ("1/8", "1/8", "whole"):
        Session.objects.filter(pk=session_row(user, profile=profile, model=model).pk).update(
            state=Session.State.RUNNING, node=node
        )
    waiting = session_row(user, profile="1/4", model=model)
    Session.objects.filter(pk=waiting.pk).update(queued_at=timezone.now() - timedelta(seconds=90))
    node.last_heartbeat_at = timezone.now() - timedelta(seconds=30)
    node.save(update_fields=["last_heartbeat_at"])
    node_make("never-seen")

    samples = _scrape()
    running = {
        (s.labels["gpu_model"], s.labels["profile"]): s.value for s in samples["suanli_sessions_running"]
    }
    assert running == {(model.name, "1/8"): 2, (model.name, "whole"): 1}
    assert [s.value for s in samples["suanli_queue_length"]] == [1]
    (oldest,) = samples["suanli_queue_oldest_wait_seconds"]
    assert 89 <= oldest.value < 150
    (age,) = samples["suanli_node_heartbeat_age_seconds"]
    assert age.labels["node"] == "gpu-host-1" and 29 <= age.value < 90


@shared_task(name="tests.portal.test_metrics.always_fails")
def always_fails() -> None:
    raise RuntimeError("this task fails on purpose")


def test_metering_tick_duration_and_celery_failures_are_shared_through_the_cache():
    cache.delete_many(
        [METERING_TICK_SECONDS_KEY, TASK_FAILURES_KEY, f"{TASK_FAILURES_KEY}:{always_fails.name}"]
    )
    (before,) = _scrape()["suanli_metering_tick_seconds"]
    assert math.isnan(before.value)  # no tick yet
    metering_tick_task.apply()
    (tick,) = _scrape()["suanli_metering_tick_seconds"]
    assert 0 < tick.value < 30
    for _ in range(2):
        assert always_fails.apply().failed()
    failures = {
        s.labels["task"]: s.value
        for s in _scrape()["suanli_celery_task_failures"]
        if s.name.endswith("_total")
    }
    assert failures == {"tests.portal.test_metrics.always_fails": 2}


def test_revenue_per_minute_is_the_usage_posted_in_the_last_minute_in_currency_units():
    user = user_make()
    wallet = wallet_for(account=user.account)
    revenue = system_account(kind=LedgerAccount.Kind.REVENUE, unit=wallet.unit)
    for i, micros in enumerate((1_500_000, 250_000)):
        transfer_post(
            debit=wallet, credit=revenue, amount_micros=micros, kind=Transfer.Kind.USAGE,
            idempotency_key=f"metrics-usage-{i}",
        )  # fmt: skip
        wallet.refresh_from_db()
    # the user was funded by a transfer of another kind, which is not revenue
    revenue_samples = {s.labels["unit"]: s.value for s in _scrape()["suanli_revenue_last_minute"]}
    assert revenue_samples == {wallet.unit: 1.75}
