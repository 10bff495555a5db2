from datetime import timedelta

import pytest
from django.core.cache import cache
from django.core.management import call_command
from django.utils import timezone
from rest_framework.test import APIClient

from portal.models import AccessToken
from portal.services import access_token_create, user_create

pytestmark = pytest.mark.django_db


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
