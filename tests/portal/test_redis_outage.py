"""The portal with Redis unreachable (cache, throttles and broker on a closed port): pages and the API
answer, throttles fail open, logins hold; liveness asks nothing, readiness says what is down. Launches
and stops with the broker down: tests/provisioner/test_enqueue.py."""

import time

import pytest
from django.core.cache import cache
from rest_framework.throttling import UserRateThrottle

from core.outage import outage
from portal.models import AccessToken
from portal.services import access_token_create
from tests.outage import CLOSED
from tests.provisioner.conftest import make_user

PASSWORD = "a-long-pass-phrase-9"


@pytest.fixture
def cache_down(settings):
    settings.CACHES = {"default": {**settings.CACHES["default"], "LOCATION": CLOSED}}  # the product's backend
    yield
    outage(f"cache {CLOSED}", what_happens="").answered()


@pytest.fixture
def redis_down(cache_down, broker_down, settings):
    settings.REDIS_URL = CLOSED


@pytest.fixture
def user(db, settings):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    return make_user(funds=100_000_000)


def test_pages_and_the_api_answer_with_redis_down(client, user, redis_down):
    client.force_login(user)
    assert client.get("/dashboard/").status_code == 200
    assert client.get("/sessions/").status_code == 200
    assert client.get("/api/v1/sessions").status_code == 200
    _token, raw = access_token_create(user=user, name="script", scopes=["read"])
    answer = client.get("/api/v1/sessions", HTTP_AUTHORIZATION=f"Bearer {raw}")
    assert answer.status_code == 200, answer.content
    assert AccessToken.objects.filter(user=user).exists()


def test_the_api_throttle_bites_with_redis_and_fails_open_without(client, user, monkeypatch, settings):
    monkeypatch.setitem(UserRateThrottle.THROTTLE_RATES, "user", "2/min")
    cache.clear()  # no window left over from an earlier test's user of the same id
    client.force_login(user)
    statuses = [client.get("/api/v1/sessions").status_code for _ in range(3)]
    assert statuses == [200, 200, 429]
    settings.CACHES = {"default": {**settings.CACHES["default"], "LOCATION": CLOSED}}  # the product's backend
    try:
        assert [client.get("/api/v1/sessions").status_code for _ in range(5)] == [200] * 5
    finally:
        outage(f"cache {CLOSED}", what_happens="").answered()


def test_a_login_made_before_the_outage_holds_and_a_new_one_works(client, user, redis_down):
    client.force_login(user)
    assert client.get("/dashboard/").status_code == 200  # not a redirect to the login page
    fresh = type(client)()
    answer = fresh.post("/login/", {"username": user.username, "password": PASSWORD})
    assert answer.status_code == 302 and answer["Location"] != "/login/", answer.content[:500]
    assert fresh.get("/dashboard/").status_code == 200
    wrong = type(client)().post("/login/", {"username": user.username, "password": "not it"})
    assert wrong.status_code == 200  # the form again, with its error: no 500 from the lockout's counter


def test_liveness_asks_no_dependency(client, redis_down):
    answer = client.get("/livez")  # no database for this test: a query would raise
    assert answer.status_code == 200 and answer.json() == {"status": "ok"}


def test_liveness_is_answered_before_django(monkeypatch):
    import asyncio
    import concurrent.futures

    from portal import asgi

    async def no_django(scope, receive, send):
        raise AssertionError("liveness reached Django")

    monkeypatch.setattr(asgi, "django_application", no_django)
    sent = []

    async def send(message):
        sent.append(message)

    async def probe(times: int) -> float:
        started = time.perf_counter()
        for _ in range(times):
            await asgi.application({"type": "http", "path": "/livez", "method": "GET"}, None, send)
        return (time.perf_counter() - started) / times

    # a thread of its own: an earlier test (Playwright's sync API) may leave this thread's loop running
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        per_probe = pool.submit(asyncio.run, probe(1000)).result()
    assert sent[0]["status"] == 200 and sent[1]["body"] == b'{"status": "ok"}'
    assert per_probe < 0.001, f"{per_probe * 1e6:.0f} µs per liveness probe"


@pytest.mark.django_db
@pytest.mark.parametrize("path", ["/readyz", "/healthz"])
def test_readiness_is_200_and_names_redis_down_while_the_database_serves(client, redis_down, path):
    started = time.perf_counter()
    answer = client.get(path)
    assert time.perf_counter() - started < 1.0
    body = answer.json()
    assert answer.status_code == 200, body
    assert body["status"] == "degraded"
    assert body["database"]["ok"] and "latency_ms" in body["database"]
    assert body["redis"]["ok"] is False and body["redis"]["error"]
    assert body["celery"]["ok"] is False and body["beat"]["ok"] is False


@pytest.mark.django_db
def test_readiness_is_503_with_retry_after_when_the_database_is_down(client, monkeypatch):
    from django.db import OperationalError

    from portal import health

    def database_down():
        raise OperationalError("connection refused")

    monkeypatch.setattr(health, "_database", database_down)
    answer = client.get("/readyz")
    assert answer.status_code == 503
    assert answer["Retry-After"] == str(health.NOT_READY_RETRY_AFTER_SECONDS)
    assert answer.json()["status"] == "unavailable" and answer.json()["database"]["ok"] is False
