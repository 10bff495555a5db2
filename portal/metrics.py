"""``/metrics`` for Prometheus: gauges read from the database at scrape time, so every web process
answers the same figures (nothing is counted in one process's memory).

Set ``METRICS_TOKEN`` to require ``Authorization: Bearer <token>`` from the scraper; without it the
endpoint answers only requests from loopback.
"""

from __future__ import annotations

import hmac

from django.conf import settings
from django.http import HttpRequest, HttpResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import CollectorRegistry, GaugeMetricFamily

from billing.selectors import ledger_health


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
