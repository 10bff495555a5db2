"""``/metrics`` for Prometheus: gauges read from the database at scrape time, so every web process
answers the same figures (nothing is counted in one process's memory).

Set ``METRICS_TOKEN`` to require ``Authorization: Bearer <token>`` from the scraper; without it the
endpoint answers only requests from loopback.
"""

from __future__ import annotations

import hmac
from datetime import timedelta

from django.conf import settings
from django.core.cache import cache
from django.db.models import Count, Min, Sum
from django.db.models.functions import Now
from django.http import HttpRequest, HttpResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import CollectorRegistry, CounterMetricFamily, GaugeMetricFamily

from billing.models import Transfer
from billing.selectors import ledger_health
from billing.tasks import METERING_TICK_SECONDS_KEY
from core.clock import db_now
from provisioner.models import Node, Session

MICROS = 1_000_000
TASK_FAILURES_KEY = "metrics:celery_task_failures"  # a Redis hash would be neater; the cache keeps one dict


def task_failure_count(sender=None, **_kwargs) -> None:
    """Celery's ``task_failure`` signal: count the failure in the shared cache (every worker adds to
    the same figure). A lost update under two simultaneous failures is possible and harmless."""
    name = getattr(sender, "name", None) or "unknown"
    key = f"{TASK_FAILURES_KEY}:{name}"
    cache.add(key, 0, timeout=None)
    cache.incr(key)
    names = cache.get(TASK_FAILURES_KEY) or []
    if name not in names:
        cache.set(TASK_FAILURES_KEY, sorted({*names, name}), timeout=None)


class _DatabaseCollector:
    def collect(self):
        health = ledger_health()
        holds = GaugeMetricFamily(
            "suanli_ledger_holds_open",
            "Ledger reconciliation problems open (each blocks launches on the account it names)",
            labels=["kind"],
        )
        for kind, count in health.holds_by_kind.items():
            holds.add_metric([kind], count)
        yield holds
        yield GaugeMetricFamily(
            "suanli_stripe_events_waiting",
            "Stripe events received before the payment they name was known",
            value=health.stripe_events_waiting,
        )
        yield from _fleet_families()
        yield from _money_families()
        yield from _worker_families()


def _worker_families():
    tick = cache.get(METERING_TICK_SECONDS_KEY)
    yield GaugeMetricFamily(
        "suanli_metering_tick_seconds",
        "How long the last metering tick took",
        value=tick if tick is not None else float("nan"),
    )
    failures = CounterMetricFamily(
        "suanli_celery_task_failures", "Celery tasks that raised, by task", labels=["task"]
    )
    names = cache.get(TASK_FAILURES_KEY) or []
    counts = cache.get_many([f"{TASK_FAILURES_KEY}:{name}" for name in names])
    for name in names:
        failures.add_metric([name], counts.get(f"{TASK_FAILURES_KEY}:{name}", 0))
    yield failures


def _fleet_families():
    running = GaugeMetricFamily(
        "suanli_sessions_running",
        "Sessions running, by GPU model and profile",
        labels=["gpu_model", "profile"],
    )
    rows = (
        Session.objects.filter(state=Session.State.RUNNING)
        .values("gpu_model__name", "profile__name")
        .annotate(n=Count("id"))
    )
    for row in rows:
        running.add_metric([row["gpu_model__name"] or "", row["profile__name"]], row["n"])
    yield running
    queued = Session.objects.filter(state=Session.State.QUEUED)
    queue = queued.aggregate(n=Count("id"), oldest=Min("queued_at"))
    yield GaugeMetricFamily("suanli_queue_length", "Sessions waiting in the queue", value=queue["n"])
    now = db_now()
    yield GaugeMetricFamily(
        "suanli_queue_oldest_wait_seconds",
        "How long the longest-waiting queued session has waited",
        value=(now - queue["oldest"]).total_seconds() if queue["oldest"] else 0.0,
    )
    heartbeat = GaugeMetricFamily(
        "suanli_node_heartbeat_age_seconds",
        "Seconds since each node's last heartbeat",
        labels=["node", "state"],
    )
    for node in Node.objects.exclude(last_heartbeat_at=None).order_by("name"):
        heartbeat.add_metric([node.name, node.state], (now - node.last_heartbeat_at).total_seconds())
    yield heartbeat


def _money_families():
    """Usage (revenue) and card burn posted in the last minute, from the ledger: a currency or card-hour
    figure per unit (the ledger holds micro-units)."""
    families = {
        Transfer.Kind.USAGE: GaugeMetricFamily(
            "suanli_revenue_last_minute", "Usage charged to wallets in the last minute", labels=["unit"]
        ),
        Transfer.Kind.CARD_BURN: GaugeMetricFamily(
            "suanli_card_burn_last_minute", "Card credit burnt in the last minute", labels=["unit"]
        ),
    }
    rows = (
        Transfer.objects.filter(kind__in=list(families), created_at__gte=Now() - timedelta(minutes=1))
        .values("kind", "unit")
        .annotate(total=Sum("amount_micros"))
    )
    for row in rows:
        families[row["kind"]].add_metric([row["unit"]], row["total"] / MICROS)
    yield from families.values()


_registry = CollectorRegistry(auto_describe=False)
_registry.register(_DatabaseCollector())


def _allowed(request: HttpRequest) -> bool:
    token = settings.METRICS_TOKEN
    if token:
        given = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
        return hmac.compare_digest(given.encode(), token.encode())
    return request.META.get("REMOTE_ADDR") in ("127.0.0.1", "::1")


def metrics(request: HttpRequest) -> HttpResponse:
    if not _allowed(request):
        return HttpResponse("forbidden\n", status=403, content_type="text/plain")
    return HttpResponse(generate_latest(_registry), content_type=CONTENT_TYPE_LATEST)
