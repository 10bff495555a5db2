import re
from datetime import timedelta

import pytest
from django.core.cache import cache
from django.core.management import call_command
from django.utils import timezone
from rest_framework.test import APIClient

from portal.models import AccessToken
from portal.services import access_token_create, user_create

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _fast_passwords(settings):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture
def user():
    return user_create(username="mei", email="", password="a-long-pass-phrase")


def _bearer(raw):
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
    return client


def test_a_token_is_shown_once_stored_hashed_and_authenticates(user):
    token, raw = access_token_create(user=user, name="ci", scopes=["read"])
    assert raw.startswith("sl_") and raw not in (token.token_hash, token.prefix)
    response = _bearer(raw).get("/api/v1/me")
    assert response.status_code == 200 and response.json()["username"] == "mei"
    token.refresh_from_db()
    assert token.last_used_at is not None


def test_revoked_expired_and_unknown_tokens_get_the_same_401(user):
    revoked, raw_revoked = access_token_create(user=user, name="a", scopes=["read"])
    revoked.revoked_at = timezone.now()
    revoked.save()
    expired, raw_expired = access_token_create(user=user, name="b", scopes=["read"])
    AccessToken.objects.filter(pk=expired.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    bodies = set()
    for raw in (raw_revoked, raw_expired, "sl_not-a-token"):
        response = _bearer(raw).get("/api/v1/me")
        assert response.status_code == 401
        bodies.add(response.content)
    assert len(bodies) == 1
    assert response.json()["error"]["code"] == "authentication_failed"


def test_a_token_without_the_scope_is_refused(user):
    _, raw = access_token_create(user=user, name="reader", scopes=["read"])
    client = _bearer(raw)
    assert client.post("/api/v1/sessions", {}, format="json").status_code == 403
    assert client.post("/api/v1/cards/redeem", {"code": "x"}, format="json").status_code == 403
    assert client.post("/api/v1/wallet/topups", {"amount": "10"}, format="json").status_code == 403


def test_tokens_cannot_manage_tokens(user):
    _, raw = access_token_create(user=user, name="all", scopes=["read", "sessions", "cards", "billing"])
    assert (
        _bearer(raw).post("/api/v1/tokens", {"name": "x", "scopes": ["read"]}, format="json").status_code
        == 403
    )


def test_tokens_through_the_api_with_a_browser_session(client, user):
    client.force_login(user)
    created = client.post(
        "/api/v1/tokens", {"name": "ci", "scopes": ["read", "sessions"]}, content_type="application/json"
    )
    assert created.status_code == 201
    raw, token_id = created.json()["token"], created.json()["id"]
    assert all("token" not in row for row in client.get("/api/v1/tokens").json())
    assert client.delete(f"/api/v1/tokens/{token_id}").status_code == 204
    assert _bearer(raw).get("/api/v1/me").status_code == 401
    bad = client.post("/api/v1/tokens", {"name": "x", "scopes": ["root"]}, content_type="application/json")
    assert bad.status_code == 400 and "scopes" in str(bad.json()["error"]["fields"])


def test_create_token_command_prints_a_working_token(user, capsys):
    call_command("create_token", "mei", "--name", "cli", "--scopes", "read", "sessions")
    raw = capsys.readouterr().out.strip()
    assert _bearer(raw).get("/api/v1/me").status_code == 200
    assert AccessToken.objects.get(user=user).scopes == ["read", "sessions"]


def test_login_locks_out_after_repeated_failures(client, user):
    cache.clear()
    for _ in range(5):
        assert client.post("/login/", {"username": "mei", "password": "wrong"}).status_code == 200
    locked = client.post("/login/", {"username": "mei", "password": "a-long-pass-phrase"})
    assert locked.status_code == 429
    assert "Too many failed attempts" in locked.content.decode()
    cache.clear()
    assert client.post("/login/", {"username": "mei", "password": "a-long-pass-phrase"}).status_code == 302


def test_the_openapi_schema_and_docs_are_served(client, user):
    client.force_login(user)
    schema = client.get("/api/schema/", HTTP_ACCEPT="application/json")
    assert schema.status_code == 200
    assert "/api/v1/tokens" in schema.json()["paths"]
    docs = client.get("/api/docs/")
    assert docs.status_code == 200 and b"swagger" in docs.content.lower()
    assert b"cdn." not in docs.content


def test_each_scope_opens_only_its_own_writes(user):
    _, cards_only = access_token_create(user=user, name="cards", scopes=["cards"])
    client = _bearer(cards_only)
    assert client.post("/api/v1/sessions", {}, format="json").status_code == 403
    assert client.post("/api/v1/wallet/topups", {"amount": "10"}, format="json").status_code == 403
    assert client.get("/api/v1/wallet").status_code == 403  # no "read": only the cards area
    assert client.post("/api/v1/cards/redeem", {"code": "AAAA"}, format="json").status_code == 400
    refused = client.post("/api/v1/sessions", {}, format="json").json()
    assert refused["error"]["code"] == "permission_denied" and refused["error"]["fields"] == {}


def test_a_read_token_reads_everything_the_user_sees(user):
    _, raw = access_token_create(user=user, name="reader", scopes=["read"])
    client = _bearer(raw)
    for path in ("/api/v1/me", "/api/v1/wallet", "/api/v1/ledger", "/api/v1/cards", "/api/v1/sessions"):
        assert client.get(path).status_code == 200, path


def test_a_token_expires_at_its_expiry(user):
    token, raw = access_token_create(user=user, name="short", scopes=["read"], expires_in_days=1)
    assert timezone.now() + timedelta(hours=23) < token.expires_at <= timezone.now() + timedelta(days=1)
    assert _bearer(raw).get("/api/v1/me").status_code == 200
    AccessToken.objects.filter(pk=token.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    assert _bearer(raw).get("/api/v1/me").status_code == 401


def test_a_revoked_token_stops_at_once_and_revoking_twice_is_404(client, user):
    token, raw = access_token_create(user=user, name="ci", scopes=["read"])
    client.force_login(user)
    assert _bearer(raw).get("/api/v1/me").status_code == 200
    assert client.delete(f"/api/v1/tokens/{token.id}").status_code == 204
    assert _bearer(raw).get("/api/v1/me").status_code == 401
    again = client.delete(f"/api/v1/tokens/{token.id}")
    assert again.status_code == 404 and again.json()["error"]["code"] == "not_found"


def test_a_deactivated_user_s_tokens_stop_working(user):
    _, raw = access_token_create(user=user, name="ci", scopes=["read"])
    user.is_active = False
    user.save()
    assert _bearer(raw).get("/api/v1/me").status_code == 401


def test_last_used_is_recorded_at_most_once_a_minute(user):
    token, raw = access_token_create(user=user, name="ci", scopes=["read"])
    assert token.last_used_at is None
    client = _bearer(raw)
    client.get("/api/v1/me")
    token.refresh_from_db()
    first = token.last_used_at
    client.get("/api/v1/me")
    token.refresh_from_db()
    assert token.last_used_at == first  # no write on every call
    AccessToken.objects.filter(pk=token.pk).update(last_used_at=first - timedelta(minutes=5))
    client.get("/api/v1/me")
    token.refresh_from_db()
    assert token.last_used_at > first - timedelta(minutes=5)
    listed = APIClient()
    listed.force_login(user)
    assert listed.get("/api/v1/tokens").json()[0]["last_used_at"] is not None


def test_token_use_is_throttled_per_token_with_the_standard_body(user, settings):
    cache.clear()
    settings.REST_FRAMEWORK = {
        **settings.REST_FRAMEWORK,
        "DEFAULT_THROTTLE_RATES": {**settings.REST_FRAMEWORK["DEFAULT_THROTTLE_RATES"], "token": "3/min"},
    }
    _, raw = access_token_create(user=user, name="ci", scopes=["read"])
    _, other = access_token_create(user=user, name="other", scopes=["read"])
    client = _bearer(raw)
    assert [client.get("/api/v1/me").status_code for _ in range(3)] == [200, 200, 200]
    throttled = client.get("/api/v1/me")
    assert throttled.status_code == 429 and int(throttled["Retry-After"]) > 0
    assert throttled.json()["error"]["code"] == "throttled"
    assert set(throttled.json()["error"]) == {"code", "message", "fields"}
    assert _bearer(other).get("/api/v1/me").status_code == 200  # counted per token
    cache.clear()


def test_create_token_prints_the_token_once_and_stores_only_its_hash(user, capsys):
    call_command("create_token", "mei", "--scopes", "read", "--days", "7")
    out = capsys.readouterr().out
    lines = out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("sl_")
    token = AccessToken.objects.get(user=user)
    assert lines[0] not in (token.token_hash, token.prefix) and token.name == "cli"
    assert timezone.now() + timedelta(days=6) < token.expires_at <= timezone.now() + timedelta(days=7)
    assert lines[0] not in str(list(AccessToken.objects.values()))


def test_create_token_refuses_an_unknown_user():
    from django.core.management.base import CommandError

    with pytest.raises(CommandError, match="no user named"):
        call_command("create_token", "nobody")


def test_the_profile_page_shows_a_new_token_once(client, user):
    client.force_login(user)
    response = client.post(
        "/profile/", {"action": "token_create", "name": "laptop", "scopes": ["read"], "expires_in_days": "30"}
    )
    assert response.status_code == 302
    page = client.get("/profile/").content.decode()
    token = AccessToken.objects.get(user=user, name="laptop")
    raw = re.search(r"sl_[A-Za-z0-9_-]{20,}", page).group(0)
    assert raw.startswith(token.prefix) and _bearer(raw).get("/api/v1/me").status_code == 200
    assert raw not in client.get("/profile/").content.decode()
    client.post("/profile/", {"action": "token_revoke", "token": str(token.id)})
    assert _bearer(raw).get("/api/v1/me").status_code == 401
