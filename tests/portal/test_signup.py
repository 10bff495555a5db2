"""Sign-up: a throttle per client address (failing open when the cache is down), an optional
invite-code-only mode where a bad code makes nothing, and optional email confirmation."""

from __future__ import annotations

import logging
import re
import time

import pytest
from django.core import mail, signing
from django.core.cache import cache
from django.test import Client
from django.urls import reverse

from billing.models import Account, Card
from billing.services.cards import card_batch_issue, card_redeem
from portal.models import User
from portal.services import user_create
from portal.signup import _verify_token

pytestmark = pytest.mark.django_db

PASSWORD = "a-long-pass-phrase-9"


@pytest.fixture(autouse=True)
def _fresh(settings):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    cache.clear()


def _signup(client: Client, username: str, *, ip: str = "203.0.113.7", **fields):
    body = {"username": username, "email": f"{username}@example.edu", "password": PASSWORD, **fields}
    return client.post(reverse("signup"), body, REMOTE_ADDR=ip)


def _code(hours_micros: int = 2_000_000) -> str:
    _batch, (code,) = card_batch_issue(hours_micros=hours_micros, count=1, valid_days=30)
    return code


# --- the throttle ------------------------------------------------------------------------------------


def test_signups_from_one_address_are_throttled_and_another_address_is_not(settings):
    settings.SIGNUP_RATE_PER_HOUR = 2
    assert _signup(Client(), "s1").status_code == 302
    assert _signup(Client(), "s2").status_code == 302
    refused = _signup(Client(), "s3")
    assert refused.status_code == 429
    assert "Too many sign-ups from your network" in refused.content.decode()
    assert not User.objects.filter(username="s3").exists()
    assert _signup(Client(), "s4", ip="198.51.100.9").status_code == 302


def test_failed_attempts_count_too(settings):
    settings.SIGNUP_RATE_PER_HOUR = 2
    for _ in range(2):
        assert _signup(Client(), "weak", password="1").status_code == 200
    assert _signup(Client(), "late").status_code == 429
    assert not User.objects.filter(username="late").exists()


def test_the_throttle_fails_open_and_logs_when_the_cache_is_down(settings, caplog):
    settings.SIGNUP_RATE_PER_HOUR = 1
    settings.CACHES = {
        "default": {
            "BACKEND": "django.core.cache.backends.redis.RedisCache",
            "LOCATION": "redis://127.0.0.1:1/0",  # nothing listens there
            "OPTIONS": {"socket_connect_timeout": 0.5},
        }
    }
    with caplog.at_level(logging.WARNING, logger="core.throttle"):
        assert _signup(Client(), "d1").status_code == 302
        assert _signup(Client(), "d2").status_code == 302
    assert User.objects.filter(username__in=["d1", "d2"]).count() == 2
    assert "throttle skipped: the cache is unreachable (signup:ip:" in caplog.text


def test_a_throttled_signup_is_translated(settings):
    settings.SIGNUP_RATE_PER_HOUR = 1
    _signup(Client(), "z1")
    refused = _signup(Client(HTTP_ACCEPT_LANGUAGE="zh-hans"), "z2")
    assert refused.status_code == 429
    assert "注册次数过多" in refused.content.decode()


# --- invite code required ----------------------------------------------------------------------------


def test_invite_mode_refuses_a_signup_without_a_code_and_makes_nothing(settings):
    settings.SIGNUP_INVITE_REQUIRED = True
    accounts = Account.objects.count()
    response = _signup(Client(), "nocode")
    assert response.status_code == 200
    assert "Invite code" in response.content.decode()
    assert not User.objects.filter(username="nocode").exists()
    assert Account.objects.count() == accounts


@pytest.mark.parametrize("which", ["unknown", "used", "mistyped"])
def test_invite_mode_refuses_a_bad_code_and_makes_nothing(settings, which):
    settings.SIGNUP_INVITE_REQUIRED = True
    code = _code()
    if which == "used":
        first = user_create(username="first", email="", password=PASSWORD)
        card_redeem(user=first, account=first.account, code=code)
    elif which == "unknown":
        code = "ZZZZ-ZZZZ-ZZZZ-ZZZZ"
    else:
        code = code[:-1] + ("A" if code[-1] != "A" else "B")
    accounts, cards = Account.objects.count(), sorted(Card.objects.values_list("id", "state", "owner_id"))
    response = _signup(Client(), "late", invite_code=code)
    assert response.status_code == 200
    assert 'class="error" role="alert"' in response.content.decode()
    assert not User.objects.filter(username="late").exists()
    assert Account.objects.count() == accounts
    assert sorted(Card.objects.values_list("id", "state", "owner_id")) == cards


def test_invite_mode_signs_up_with_a_good_code_and_redeems_it(settings):
    settings.SIGNUP_INVITE_REQUIRED = True
    code = _code(3_000_000)
    client = Client()
    response = _signup(client, "invited", invite_code=code)
    assert response.status_code == 302 and response["Location"] == reverse("dashboard")
    user = User.objects.get(username="invited")
    card = Card.objects.get(owner=user.account)
    assert card.state == Card.State.ACTIVE and card.redeemed_by == user
    assert client.get(reverse("dashboard")).status_code == 200
    again = _signup(Client(), "second", invite_code=code)
    assert "already been redeemed" in again.content.decode()
    assert not User.objects.filter(username="second").exists()


def test_without_invite_mode_a_bad_code_still_signs_up():
    response = _signup(Client(), "open", invite_code="ZZZZ-ZZZZ-ZZZZ-ZZZZ", follow=False)
    assert response.status_code == 302 and response["Location"] == reverse("cards")
    assert User.objects.get(username="open").account is not None


# --- email confirmation ------------------------------------------------------------------------------


def _link(message) -> str:
    return re.search(r"https?://[^/\s]+(/signup/verify/[^\s]+/)", message.body).group(1)


def test_email_mode_needs_an_email(settings):
    settings.SIGNUP_EMAIL_VERIFICATION = True
    response = _signup(Client(), "nomail", email="")
    assert response.status_code == 200
    assert not User.objects.filter(username="nomail").exists()


def test_email_mode_sends_a_link_and_the_user_logs_in_only_after_following_it(
    settings, django_capture_on_commit_callbacks
):
    settings.SIGNUP_EMAIL_VERIFICATION = True
    client = Client()
    with django_capture_on_commit_callbacks(execute=True):
        response = _signup(client, "mei")
    assert response.status_code == 200 and 'data-testid="verify-sent"' in response.content.decode()
    user = User.objects.get(username="mei")
    assert not user.is_active and user.account is not None
    assert client.get(reverse("dashboard")).status_code == 302  # not logged in
    assert not Client().login(username="mei", password=PASSWORD)
    (message,) = mail.outbox
    assert message.to == ["mei@example.edu"]
    link = _link(message)

    confirmed = client.get(link)
    assert confirmed.status_code == 302 and confirmed["Location"] == reverse("dashboard")
    assert client.get(reverse("dashboard")).status_code == 200
    user.refresh_from_db()
    assert user.is_active
    assert Client().login(username="mei", password=PASSWORD)

    again = Client().get(link, follow=True)
    assert "already confirmed" in again.content.decode()


def test_a_tampered_stale_or_reused_link_activates_nobody(
    settings, monkeypatch, django_capture_on_commit_callbacks
):
    settings.SIGNUP_EMAIL_VERIFICATION = True
    with django_capture_on_commit_callbacks(execute=True):
        _signup(Client(), "mei")
    link = _link(mail.outbox[0])
    user = User.objects.get(username="mei")

    tampered = Client().get(link[:-3] + "xx/", follow=True)
    assert tampered.redirect_chain[-1][0] == reverse("login")
    assert "not valid or has expired. Log in with your username and password" in tampered.content.decode()

    real_time = time.time
    monkeypatch.setattr(signing.time, "time", lambda: real_time() - 4 * 86400)  # signed 4 days ago
    stale = _verify_token(user)
    monkeypatch.setattr(signing.time, "time", real_time)
    expired = Client().get(reverse("signup_verify", args=[stale]), follow=True)
    assert "not valid or has expired" in expired.content.decode()
    user.refresh_from_db()
    assert not user.is_active

    # confirmed and logged in once, then deactivated by an admin: the old link does not undo that
    assert Client().get(link).status_code == 302
    User.objects.filter(pk=user.pk).update(is_active=False)
    reused = Client().get(link, follow=True)
    assert "not valid or has expired" in reused.content.decode()
    user.refresh_from_db()
    assert not user.is_active


# --- resending the confirmation ----------------------------------------------------------------------


@pytest.fixture
def sending(settings, django_capture_on_commit_callbacks):
    """Email confirmation on; ``with sending():`` sends what the block queues, as its commit would."""
    settings.SIGNUP_EMAIL_VERIFICATION = True
    return lambda: django_capture_on_commit_callbacks(execute=True)


def test_an_unconfirmed_user_who_logs_in_is_told_and_has_a_fresh_link_sent_in_their_language(sending):
    with sending():
        _signup(Client(HTTP_ACCEPT_LANGUAGE="zh-hans"), "mei")
    assert mail.outbox[0].subject == "确认你的算力账户邮箱"
    browser = Client(HTTP_ACCEPT_LANGUAGE="en")  # another browser, in English
    login = browser.post(reverse("login"), {"username": "mei", "password": PASSWORD}, follow=True)
    assert login.redirect_chain[-1][0] == reverse("signup_pending")
    page = login.content.decode()
    assert "Your email is not confirmed yet." in page and 'data-testid="verify-resend"' in page
    assert "mei@example.edu" in page

    with sending():
        resent = browser.post(reverse("signup_resend"), follow=True)
    assert resent.redirect_chain[-1][0] == reverse("signup_pending")
    assert "We sent a new confirmation link to mei@example.edu." in resent.content.decode()
    _first, fresh = mail.outbox
    assert fresh.to == ["mei@example.edu"] and fresh.subject == "确认你的算力账户邮箱"
    assert fresh.body.startswith("欢迎来到算力，mei。")

    assert browser.get(_link(fresh)).status_code == 302
    assert User.objects.get(username="mei").is_active
    assert browser.get(reverse("dashboard")).status_code == 200
    again = Client().post(reverse("login"), {"username": "mei", "password": PASSWORD})
    assert again.status_code == 302 and again["Location"] != reverse("signup_pending")


def test_a_wrong_password_for_an_unconfirmed_user_is_an_ordinary_failed_login(sending):
    with sending():
        _signup(Client(), "mei")
    browser = Client()
    refused = browser.post(reverse("login"), {"username": "mei", "password": "not-the-password"})
    assert refused.status_code == 200 and "not confirmed" not in refused.content.decode()
    assert browser.post(reverse("signup_resend"))["Location"] == reverse("login")
    assert len(mail.outbox) == 1


def test_resending_is_throttled_per_user(sending):
    client = Client()
    with sending():
        _signup(client, "mei")
        for _ in range(3):
            assert client.post(reverse("signup_resend")).status_code == 302
        refused = client.post(reverse("signup_resend"))
    assert refused.status_code == 429
    assert "Wait an hour before asking for another" in refused.content.decode()
    assert len(mail.outbox) == 1 + 3


def test_resending_takes_the_forms_csrf_token(sending):
    client = Client(enforce_csrf_checks=True)
    page = client.get(reverse("signup"))
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.content.decode()).group(1)
    body = {"username": "mei", "email": "mei@example.edu", "password": PASSWORD}
    with sending():
        sent = client.post(reverse("signup"), body | {"csrfmiddlewaretoken": token})
        assert 'data-testid="verify-resend"' in sent.content.decode()
        assert client.post(reverse("signup_resend")).status_code == 403
    assert len(mail.outbox) == 1
    form_token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', sent.content.decode()).group(1)
    with sending():
        assert client.post(reverse("signup_resend"), {"csrfmiddlewaretoken": form_token}).status_code == 302
    assert len(mail.outbox) == 2


def test_a_confirmed_user_has_nothing_to_resend(sending):
    client = Client()
    with sending():
        _signup(client, "mei")
    client.get(_link(mail.outbox[0]))
    Client().get(_link(mail.outbox[0]))  # the link used twice
    assert client.get(reverse("signup_pending"))["Location"] == reverse("login")
    with sending():
        assert client.post(reverse("signup_resend"))["Location"] == reverse("login")
    assert len(mail.outbox) == 1
