"""The storage price where people see it: the home line of the dashboard and the files page, and the
daily charge in the wallet's history, in English and Chinese."""

from __future__ import annotations

import re
import zoneinfo
from datetime import UTC, timedelta

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from billing.models import Transfer
from billing.services.storage import StorageCharge, storage_charge_many, storage_price_set
from billing.services.topups import wallet_credit_promotion
from core.clock import db_now
from portal.pages import daily_spend
from portal.services import user_create
from provisioner.models import HomeUsage

pytestmark = pytest.mark.django_db
GB = 10**9


@pytest.fixture(autouse=True)
def _fast_hasher(settings):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


def _user(name: str, *, language: str = "en", home_bytes: int = 17 * GB):
    user = user_create(username=name, email="", password="pw-123456789", language=language)
    HomeUsage.objects.create(user=user, bytes=home_bytes, files=10, measured_at=timezone.now())
    return user


def _page(user, path: str) -> str:
    client = Client()
    client.force_login(user)
    page = client.get(path)
    assert page.status_code == 200
    return page.content.decode()


def _storage_line(user, path: str = "/dashboard/") -> str:
    found = re.search(r'<span data-testid="storage-price">(.*?)</span>', _page(user, path), re.S)
    return found.group(1) if found else ""


def test_no_price_no_storage_line():
    assert _storage_line(_user("ada")) == ""


def test_the_dashboard_says_what_the_home_costs_a_month_in_english_and_chinese():
    storage_price_set(price_micros_per_gb_month=3_000_000, free_gb=5)
    assert _storage_line(_user("ada")) == (
        "Storage: 12.0 GB over the 5 GB free, about ¥36.00 a month (charged daily)"
    )
    assert _storage_line(_user("mei", language="zh-hans")) == (
        "存储：超出免费的 5 GB 共 12.0 GB，每月约 ¥36.00（按日扣费）"
    )


def test_the_files_page_shows_it_too_and_a_home_within_the_allowance_reads_so(settings, tmp_path):
    settings.HOMES_BACKEND, settings.HOMES_SHARED_ROOT = "shared", str(tmp_path)
    storage_price_set(price_micros_per_gb_month=2_500_000, free_gb=5)
    assert _storage_line(_user("bo", home_bytes=2 * GB), "/files/") == (
        "Storage: within the 5 GB free; beyond it, ¥2.50 per GB a month (charged daily)"
    )
    assert "about ¥30.00 a month" in _storage_line(_user("cy"), "/files/")  # 12 GB × ¥2.50


def test_a_new_price_shows_at_once():
    user = _user("di")
    storage_price_set(price_micros_per_gb_month=3_000_000, free_gb=5)
    assert "¥36.00" in _storage_line(user)
    storage_price_set(price_micros_per_gb_month=1_000_000, free_gb=0)
    assert _storage_line(user) == "Storage: 17.0 GB, about ¥17.00 a month (charged daily)"


@pytest.mark.parametrize(
    ("language", "label"), [("en", "Home storage, {day}"), ("zh-hans", "主目录存储，{day}")]
)
def test_the_wallet_history_shows_the_daily_charge_as_home_storage_of_its_day(language, label):
    user = _user(f"eve-{language}", language=language)
    wallet_credit_promotion(account=user.account, amount_micros=10_000_000, idempotency_key=f"f-{language}")
    storage_price_set(
        price_micros_per_gb_month=3_000_000, free_gb=5, effective_from=db_now() - timedelta(days=2)
    )
    day = db_now().astimezone(UTC).date()
    storage_charge_many(charges=[StorageCharge(user.id, user.account_id, 17 * GB)], day=day)
    history = _page(user, "/wallet/")
    assert label.format(day=day.isoformat()) in history
    assert "-¥1.20" in history or "−¥1.20" in history
    assert daily_spend(account=user.account)[-1][1] == 1_200_000  # the spend chart counts it


def test_the_price_costs_the_dashboard_no_query_once_cached():
    user = _user("fay")
    storage_price_set(price_micros_per_gb_month=3_000_000, free_gb=5)
    client = Client()
    client.force_login(user)
    client.get("/dashboard/")  # reads the price into the cache
    with CaptureQueriesContext(connection) as queries:
        assert "about ¥36.00 a month" in client.get("/dashboard/").content.decode()
    assert len(queries) <= 9
    assert not [q for q in queries if "billing_storageprice" in q["sql"]]


def test_the_spend_chart_counts_a_charge_on_the_day_of_the_readers_time_zone():
    user = _user("gus")
    wallet_credit_promotion(account=user.account, amount_micros=10_000_000, idempotency_key="g-1")
    storage_price_set(
        price_micros_per_gb_month=3_000_000, free_gb=5, effective_from=db_now() - timedelta(days=2)
    )
    storage_charge_many(charges=[StorageCharge(user.id, user.account_id, 17 * GB)], day=db_now().date())
    at = Transfer.objects.get(kind=Transfer.Kind.STORAGE).created_at
    days = set()
    for zone in ("Pacific/Pago_Pago", "Pacific/Kiritimati"):  # UTC-11 and UTC+14: never the same day
        day = at.astimezone(zoneinfo.ZoneInfo(zone)).date().isoformat()
        with timezone.override(zone):
            spent = dict(daily_spend(account=user.account))
        assert spent[day] == 1_200_000 and sum(spent.values()) == 1_200_000, zone
        days.add(day)
    assert len(days) == 2
