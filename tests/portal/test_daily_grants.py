"""The daily grant on beat: once a day for each user who logged in lately, on their own account."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from billing.models import Card
from portal.services import user_create
from portal.tasks import daily_grants_task

pytestmark = pytest.mark.django_db
HOUR = 1_000_000


def _user(name: str, *, last_login=None):
    user = user_create(username=name, email=f"{name}@example.com", password="a-long-pass-phrase-9")
    user.last_login = last_login
    user.save(update_fields=["last_login"])
    return user


def test_the_daily_grant_reaches_active_users_once_a_day(settings):
    settings.CARD_DAILY_GRANT_MICROS = 2 * HOUR
    settings.CARD_DAILY_GRANT_ACTIVE_DAYS = 7
    active = _user("active", last_login=timezone.now() - timedelta(days=1))
    _user("away", last_login=timezone.now() - timedelta(days=30))
    _user("never")
    assert daily_grants_task() == 1
    assert daily_grants_task() == 1  # the day's card again, not a second one
    cards = Card.objects.filter(redeemed_by__isnull=False)
    assert [(c.redeemed_by_id, c.owner_id) for c in cards] == [(active.id, active.account_id)]
    assert cards[0].ledger_account.balance_micros == 2 * HOUR


def test_the_daily_grant_is_off_by_default():
    _user("active", last_login=timezone.now())
    assert daily_grants_task() == 0
    assert not Card.objects.exists()
