"""Hardening: production settings, security headers, CSRF on every form, rate limits on redemption and
launch, the doors with their own authentication (agent heartbeat, Stripe webhook) refusing garbage with a
4xx, and the audit trail of admin and money actions readable (only) in the admin."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from django.contrib import admin
from django.core.cache import cache
from django.test import Client
from django.urls import URLPattern, URLResolver, get_resolver
from rest_framework.test import APIClient

from billing.models import AuditEntry, Card, TopUp
from billing.services.ledger import wallet_adjust
from portal.services import access_token_create
from provisioner.models import Node, Session
from tests.provisioner.conftest import A100, ENV, make_catalog, make_node, make_user

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = {"gpu_model": A100, "profile": "1/8", "environment": ENV}


@pytest.fixture(autouse=True)
def _clean(settings):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    cache.clear()


# --- production settings -----------------------------------------------------------------------------


def _production_settings(**extra: str) -> dict:
    """The settings a DEBUG=0 process computes (URLs given, so nothing embedded is started)."""
    env = {
        "PATH": "/usr/bin:/bin",
        "DJANGO_SETTINGS_MODULE": "portal.settings",
        "DEBUG": "0",
        "SECRET_KEY": "a-production-secret-of-enough-length-0123456789",
        "DATABASE_URL": "postgresql://suanli@127.0.0.1:1/suanli",
        "REDIS_URL": "redis://127.0.0.1:1/0",
        "ALLOWED_HOSTS": "portal.example.com",
        **extra,
    }
    names = [
        "DEBUG",
        "SESSION_COOKIE_SECURE",
        "CSRF_COOKIE_SECURE",
        "SESSION_COOKIE_HTTPONLY",
        "SECURE_HSTS_SECONDS",
        "SECURE_HSTS_INCLUDE_SUBDOMAINS",
        "SECURE_SSL_REDIRECT",
        "SECURE_PROXY_SSL_HEADER",
        "SECURE_CONTENT_TYPE_NOSNIFF",
        "X_FRAME_OPTIONS",
    ]
    code = (
        "import json, django; django.setup(); from django.conf import settings as s; "
        f"print(json.dumps({{n: getattr(s, n, None) for n in {names!r}}}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_production_settings_make_cookies_secure_and_send_hsts():
    prod = _production_settings()
    assert prod["DEBUG"] is False
    assert prod["SESSION_COOKIE_SECURE"] and prod["CSRF_COOKIE_SECURE"] and prod["SESSION_COOKIE_HTTPONLY"]
    assert prod["SECURE_HSTS_SECONDS"] >= 31536000 and prod["SECURE_HSTS_INCLUDE_SUBDOMAINS"]
    assert prod["SECURE_PROXY_SSL_HEADER"] == ["HTTP_X_FORWARDED_PROTO", "https"]
    assert prod["SECURE_CONTENT_TYPE_NOSNIFF"] and prod["X_FRAME_OPTIONS"] == "SAMEORIGIN"
    assert prod["SECURE_SSL_REDIRECT"] is False  # TLS usually ends at the proxy: off unless asked


def test_the_ssl_redirect_is_configurable():
    assert _production_settings(SECURE_SSL_REDIRECT="1")["SECURE_SSL_REDIRECT"] is True


@pytest.fixture
def production(settings):
    settings.DEBUG = False
    settings.SESSION_COOKIE_SECURE = True
    settings.CSRF_COOKIE_SECURE = True
    settings.SECURE_HSTS_SECONDS = 31536000
    settings.SECURE_HSTS_INCLUDE_SUBDOMAINS = True
    return settings


@pytest.mark.django_db
def test_pages_carry_hsts_and_an_enforced_content_security_policy(production):
    response = Client().get("/login/", secure=True)
    assert response.status_code == 200
    assert response["Strict-Transport-Security"] == "max-age=31536000; includeSubDomains"
    policy = response["Content-Security-Policy"]
    assert "default-src 'self'" in policy and "script-src 'self'" in policy and "frame-ancestors" in policy
    assert response["X-Content-Type-Options"] == "nosniff"


@pytest.mark.django_db
def test_development_reports_the_policy_without_enforcing_it(settings):
    settings.DEBUG = True
    response = Client().get("/login/")
    assert "Content-Security-Policy" not in response
    assert "default-src 'self'" in response["Content-Security-Policy-Report-Only"]


@pytest.mark.django_db
def test_the_ssl_redirect_sends_plain_http_to_https(production):
    production.SECURE_SSL_REDIRECT = True
    response = Client().get("/login/")
    assert response.status_code == 301 and response["Location"].startswith("https://")


@pytest.mark.django_db
def test_the_session_and_csrf_cookies_are_secure_in_production(production):
    make_user("mei", funds=0)
    client = Client()
    page = client.get("/login/", secure=True)
    assert page.cookies["csrftoken"]["secure"]
    response = client.post(
        "/login/",
        {
            "username": "mei",
            "password": "a-long-pass-phrase-9",
            "csrfmiddlewaretoken": page.cookies["csrftoken"].value,
        },
        secure=True,
    )
    assert response.status_code == 302
    assert response.cookies["sessionid"]["secure"] and response.cookies["sessionid"]["httponly"]


# --- CSRF --------------------------------------------------------------------------------------------

# Doors whose authentication is not a browser session, so they do not take a CSRF token.
CSRF_FREE = {"api/stripe/webhook", "api/agent/heartbeat"}


def _routes(patterns, prefix: str = ""):
    for entry in patterns:
        if isinstance(entry, URLResolver):
            yield from _routes(entry.url_patterns, prefix + str(entry.pattern))
        elif isinstance(entry, URLPattern):
            yield prefix + str(entry.pattern)


SAMPLE_ARGS = {"uuid": "00000000-0000-4000-8000-000000000000", "int": "1", "slug": "lab", "str": "x"}


def _sample_url(route: str) -> str:
    def fill(match: re.Match) -> str:
        converter = match.group(1) or "str"
        return SAMPLE_ARGS.get(converter, "x")

    return "/" + re.sub(r"<(?:(\w+):)?\w+>", fill, route).replace("^", "").replace("$", "")


def _site_routes() -> list[str]:
    return sorted(
        {r for r in _routes(get_resolver().url_patterns) if not r.startswith("admin/") and "(?P" not in r}
    )


@pytest.mark.django_db
@pytest.mark.parametrize("route", _site_routes())
def test_a_post_without_the_csrf_token_is_refused(route):
    """Every page and every session-authenticated API call: a logged-in browser's POST without the token
    fails with 403, before the view runs."""
    if route in CSRF_FREE:
        pytest.skip("authenticated by a signature or a node token, not a cookie")
    user = make_user("mei", funds=0)
    client = Client(enforce_csrf_checks=True)
    client.force_login(user)
    before = (Session.objects.count(), Card.objects.count(), TopUp.objects.count(), Node.objects.count())
    response = client.post(_sample_url(route), {"name": "x"})
    assert response.status_code == 403, (route, response.status_code)
    assert (
        Session.objects.count(),
        Card.objects.count(),
        TopUp.objects.count(),
        Node.objects.count(),
    ) == before


def test_every_post_form_in_the_templates_carries_the_csrf_token():
    missing = []
    for template in (ROOT / "templates").rglob("*.html"):
        text = template.read_text()
        for form in re.finditer(r"<form\b[^>]*>.*?</form>", text, flags=re.S | re.I):
            if re.search(r"method=[\"']?post", form.group(0), flags=re.I) and "csrf_token" not in form.group(
                0
            ):
                missing.append(f"{template.relative_to(ROOT)}: {form.group(0)[:80]}")
    assert not missing, missing


# --- rate limits -------------------------------------------------------------------------------------


@pytest.mark.django_db
def test_redemption_is_rate_limited_with_the_standard_body(settings):
    settings.CARD_REDEEM_RATE_PER_MINUTE = 3
    client = APIClient()
    client.force_authenticate(make_user("mei", funds=0))
    answers = [client.post("/api/v1/cards/redeem", {"code": "AAAA-BBBB"}, format="json") for _ in range(4)]
    assert [a.status_code for a in answers[:3]] == [400, 400, 400]
    assert answers[3].status_code == 429
    assert answers[3].json()["error"]["code"] == "rate_limited"


@pytest.mark.django_db
def test_launch_is_rate_limited_with_the_standard_body(settings):
    settings.SESSION_LAUNCH_RATE = (2, 60)
    make_catalog()
    make_node()
    client = APIClient()
    client.force_authenticate(make_user("mei"))
    answers = [client.post("/api/v1/sessions", LAUNCH, format="json") for _ in range(3)]
    assert [a.status_code for a in answers[:2]] == [201, 201], answers[1].content
    assert answers[2].status_code == 429 and "Retry-After" in answers[2]
    assert set(answers[2].json()["error"]) == {"code", "message", "fields"}
    assert answers[2].json()["error"]["code"] == "throttled"
    assert Session.objects.count() == 2
    # reads are not launches
    assert client.get("/api/v1/sessions").status_code == 200


# --- the doors with their own authentication ---------------------------------------------------------

GARBAGE = [
    b"",
    b"not json",
    b"[]",
    b'{"agent_version": 5, "inventory": "x"}',
    b'{"inventory": {"gpus": [{"index": "zero"}]}}',
    json.dumps({"x": "y" * 200_000}).encode(),
    b'{"id": "evt_1", "type": "checkout.session.completed", "data": {"object": {}}}',
]


@pytest.mark.django_db
@pytest.mark.parametrize("body", GARBAGE, ids=range(len(GARBAGE)))
def test_the_stripe_webhook_answers_garbage_with_a_4xx(body, settings):
    settings.STRIPE_WEBHOOK_SECRET = "whsec_test"
    client = Client()
    for signature in ("", "t=1,v1=deadbeef", "garbage"):
        response = client.post(
            "/api/stripe/webhook", body, content_type="application/json", HTTP_STRIPE_SIGNATURE=signature
        )
        assert 400 <= response.status_code < 500, (signature, response.content[:200])
    assert TopUp.objects.filter(state="paid").count() == 0


@pytest.mark.django_db
@pytest.mark.parametrize("body", GARBAGE, ids=range(len(GARBAGE)))
def test_the_agent_heartbeat_answers_garbage_with_a_4xx(body, catalog_node):
    _node, token = catalog_node
    client = Client()
    for authorization in ("", "Bearer nope", f"Bearer {token}", f"Token {token}"):
        response = client.post(
            "/api/agent/heartbeat", body, content_type="application/json", HTTP_AUTHORIZATION=authorization
        )
        assert 400 <= response.status_code < 500, (authorization, response.content[:200])
        assert set(response.json()["error"]) == {"code", "message", "fields"}


@pytest.fixture
def catalog_node(db):
    make_catalog()
    return make_node("door")


@pytest.mark.django_db
def test_a_user_token_is_not_a_node_token(catalog_node):
    _token, raw = access_token_create(user=make_user("mei", funds=0), name="x", scopes=["read"])
    response = Client().post(
        "/api/agent/heartbeat", {}, content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {raw}"
    )
    assert response.status_code == 401


# --- the audit trail ---------------------------------------------------------------------------------


@pytest.mark.django_db
def test_money_actions_leave_an_audit_row_readable_only_in_the_admin():
    staff = make_user("operator", funds=0, staff=True)
    customer = make_user("mei", funds=0)
    wallet_adjust(
        account=customer.account,
        amount_micros=5_000_000,
        actor=staff,
        reason="goodwill",
        idempotency_key="t-1",
    )
    entry = AuditEntry.objects.get(action="wallet.adjust")
    assert entry.actor == staff and entry.after == {"balance_micros": 5_000_000}

    model_admin = admin.site._registry.get(AuditEntry)
    assert model_admin is not None, "AuditEntry is not registered in the admin"
    client = Client()
    client.force_login(staff)
    request = client.get("/admin/").wsgi_request
    assert not model_admin.has_add_permission(request)
    assert not model_admin.has_change_permission(request, entry)
    assert not model_admin.has_delete_permission(request, entry)
    listing = client.get("/admin/billing/auditentry/")
    assert listing.status_code == 200 and b"wallet.adjust" in listing.content
    detail = client.get(f"/admin/billing/auditentry/{entry.pk}/change/")
    assert detail.status_code == 200 and b"goodwill" in detail.content
    assert b'name="_save"' not in detail.content  # viewable, not editable
    assert client.post(f"/admin/billing/auditentry/{entry.pk}/delete/", {"post": "yes"}).status_code == 403
    assert AuditEntry.objects.filter(pk=entry.pk).exists()
