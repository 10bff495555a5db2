"""Single sign-on against a real OpenID Connect provider (the npm package ``oidc-provider``, started by
the test; ``.ci/run`` installs it): the login page's button, the provider's own login and consent pages
filled in as a person would, the code exchanged and the ID token verified against the provider's keys.
A new student lands with a user and an account and can redeem a code; the email-domain rule, the team
claim and ``LOCAL_PASSWORDS=0`` hold."""

from __future__ import annotations

import html
import re
import socket

import httpx
import pytest
from django.core.cache import cache
from django.test import Client
from django.urls import reverse

from billing.models import AuditEntry, Card
from billing.services.cards import card_batch_issue
from portal import oidc
from portal.models import Membership, User
from portal.services import team_create, user_create
from tests.oidc import CLIENT_ID, CLIENT_SECRET, INSTALLED, NOT_INSTALLED, SCOPES, oidc_provider

pytestmark = pytest.mark.django_db

CALLBACK = "http://testserver/oidc/callback/"

if not INSTALLED:
    pytest.skip(NOT_INSTALLED, allow_module_level=True)


@pytest.fixture(scope="module")
def provider_issuer():
    with oidc_provider(redirect_uris=[CALLBACK]) as issuer:
        yield issuer


@pytest.fixture
def sso(settings, provider_issuer):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    settings.OIDC_ISSUER = provider_issuer
    settings.OIDC_RP_CLIENT_ID = CLIENT_ID
    settings.OIDC_RP_CLIENT_SECRET = CLIENT_SECRET
    settings.OIDC_RP_SCOPES = SCOPES
    settings.OIDC_TEAM_CLAIM = "groups"
    settings.OIDC_PROVIDER_NAME = "Example University"
    settings.AUTHENTICATION_BACKENDS = ["portal.oidc.SsoBackend", "django.contrib.auth.backends.ModelBackend"]
    cache.clear()
    oidc._metadata.clear()
    return provider_issuer


def _forms(page: str) -> list[tuple[str, dict[str, str]]]:
    found = []
    for action, body in re.findall(r'<form[^>]*action="([^"]+)"[^>]*>(.*?)</form>', page, re.S):
        hidden = dict(re.findall(r'<input type="hidden" name="([^"]+)" value="([^"]*)"', body))
        found.append((html.unescape(action), hidden))
    return found


def _sign_in_at_provider(authorize_url: str, login: str) -> str:
    """Go through the provider's pages as a browser would, from the authorization request to the
    redirect back to the portal; returns that redirect (path and query)."""
    with httpx.Client(timeout=10) as browser:
        response = browser.get(authorize_url)
        for _step in range(12):
            if response.status_code in (302, 303):
                location = str(response.url.join(response.headers["location"]))
                if location.startswith("http://testserver/"):
                    return location.removeprefix("http://testserver")
                response = browser.get(location)
                continue
            assert response.status_code == 200, response.text[:500]
            ((action, fields),) = _forms(response.text)[:1]
            if fields.get("prompt") == "login":
                fields |= {"login": login, "password": "any password"}
            response = browser.post(str(response.url.join(action)), data=fields)
    raise AssertionError("the provider never redirected back")


def _sso_login(client: Client, login: str):
    start = client.get(reverse("oidc_authentication_init"))
    assert start.status_code == 302, start.content[:300]
    assert start["Location"].startswith(oidc.provider_metadata()["authorization_endpoint"])
    return client.get(_sign_in_at_provider(start["Location"], login), follow=True)


def test_the_login_page_shows_the_provider_button(sso):
    page = Client().get(reverse("login")).content.decode()
    assert 'data-testid="sso-login"' in page and "Sign in with Example University" in page
    assert 'name="password"' in page  # local passwords stay on unless turned off


def test_a_new_student_signs_in_lands_with_an_account_joins_the_course_and_redeems(sso):
    course = team_create(
        creator=user_create(username="prof", email="", password="a-long-pass-phrase-9"), name="CS101"
    )
    assert course.slug == "cs101"
    client = Client()
    landed = _sso_login(client, "mei")
    assert landed.redirect_chain[-1][0] == reverse("dashboard"), landed.redirect_chain
    user = User.objects.get(sso_subject=f"{sso}#mei")
    assert (user.username, user.email) == ("mei", "mei@uni.example.edu")
    assert user.account is not None and not user.has_usable_password()
    assert client.get("/api/v1/me").json()["account_id"] == user.account_id
    assert Membership.objects.get(team=course, user=user).role == Membership.Role.MEMBER
    assert AuditEntry.objects.filter(action="team.member_join_sso", actor=user).exists()

    _batch, (code,) = card_batch_issue(hours_micros=2_000_000, count=1, valid_days=30)
    redeemed = client.post("/api/v1/cards/redeem", {"code": code}, content_type="application/json")
    assert redeemed.status_code == 201, redeemed.content
    assert Card.objects.get(id=redeemed.json()["id"]).owner_id == user.account_id

    again = Client()
    _sso_login(again, "mei")  # the same identity signs in as the same user
    assert User.objects.filter(sso_subject=f"{sso}#mei").count() == 1
    assert again.get("/api/v1/me").json()["id"] == user.pk


def test_a_local_user_with_the_same_username_is_not_taken_over(sso):
    local = user_create(username="chen", email="chen@uni.example.edu", password="a-long-pass-phrase-9")
    client = Client()
    _sso_login(client, "chen")
    me = client.get("/api/v1/me").json()
    assert me["id"] != local.pk and me["username"] == "chen-2"
    local.refresh_from_db()
    assert local.sso_subject is None


def test_an_email_outside_the_allowed_domains_is_refused(sso, settings):
    settings.OIDC_ALLOWED_EMAIL_DOMAINS = ["uni.example.edu"]
    client = Client()
    landed = _sso_login(client, "lin")
    assert landed.redirect_chain[-1][0] == reverse("login")
    assert "Sign-in here is for @uni.example.edu email addresses." in landed.content.decode()
    assert not User.objects.filter(username="lin").exists()
    assert client.get("/api/v1/me").status_code in (401, 403)


def test_with_local_passwords_off_only_the_provider_signs_in(sso, settings):
    settings.LOCAL_PASSWORDS = False
    settings.AUTHENTICATION_BACKENDS = ["portal.oidc.SsoBackend"]
    user_create(username="old", email="", password="a-long-pass-phrase-9")
    page = Client().get(reverse("login")).content.decode()
    assert 'data-testid="sso-login"' in page and 'name="password"' not in page
    refused = Client().post(reverse("login"), {"username": "old", "password": "a-long-pass-phrase-9"})
    assert refused.status_code == 403
    assert "Passwords are turned off here" in refused.content.decode()
    assert Client().get(reverse("signup"))["Location"] == reverse("login")
    client = Client()
    _sso_login(client, "mei")
    assert client.get(reverse("dashboard")).status_code == 200


def test_an_unreachable_provider_is_a_message_not_an_error(sso, settings):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    settings.OIDC_ISSUER = f"http://127.0.0.1:{port}"  # nothing listens there
    response = Client().get(reverse("oidc_authentication_init"), follow=True)
    assert response.redirect_chain[-1][0] == reverse("login")
    assert "cannot be reached" in response.content.decode()


def test_without_an_issuer_the_sso_routes_are_404(settings):
    settings.OIDC_ISSUER = ""
    assert Client().get(reverse("oidc_authentication_init")).status_code == 404
    assert Client().get(reverse("oidc_authentication_callback")).status_code == 404
    assert 'data-testid="sso-login"' not in Client().get(reverse("login")).content.decode()
