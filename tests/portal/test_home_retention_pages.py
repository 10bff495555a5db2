"""The retention rule on the pages: one line on /files/, and a banner with the date on the dashboard and
/files/ while a removal of the user's home is planned, in their language; read with the request's user,
so the banner costs the dashboard no query."""

from __future__ import annotations

import re
from datetime import UTC, datetime

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from portal.services import user_create
from provisioner.models import HomeRemoval

pytestmark = pytest.mark.django_db
DUE = datetime(2031, 3, 4, 5, 6, tzinfo=UTC)


@pytest.fixture(autouse=True)
def _shared(settings, tmp_path):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    settings.HOMES_BACKEND, settings.HOMES_SHARED_ROOT = "shared", str(tmp_path)


def _page(user, path: str) -> str:
    client = Client()
    client.force_login(user)
    page = client.get(path)
    assert page.status_code == 200
    return page.content.decode()


def _banner(html: str) -> str:
    found = re.search(r'<p class="message warning" data-testid="home-removal">.*?</p>', html, re.S)
    return found.group(0) if found else ""


def _user(name: str, *, language: str = "en", planned: bool = True):
    user = user_create(username=name, email="", password="pw-123456789", language=language)
    if planned:
        HomeRemoval.objects.create(
            user=user, name=f"{name}-{user.pk}", reason="idle", planned_at=timezone.now(), due_at=DUE
        )
    return user


def test_a_planned_removal_is_a_banner_with_its_date_on_the_dashboard_and_the_files_page():
    user = _user("ada")
    for path in ("/dashboard/", "/files/"):
        banner = _banner(_page(user, path))
        assert "Your home folder will be removed on 2031-03-04 05:06 UTC" in banner, path


def test_the_banner_in_chinese():
    banner = _banner(_page(_user("mei", language="zh-hans"), "/dashboard/"))
    assert "你的主目录将于 2031-03-04 05:06 UTC 被删除" in banner


def test_no_banner_without_a_plan_or_once_it_is_cancelled():
    assert _banner(_page(_user("new", planned=False), "/dashboard/")) == ""
    user = _user("back")
    HomeRemoval.objects.filter(user=user).update(cancelled_at=timezone.now())
    assert _banner(_page(user, "/dashboard/")) == ""
    assert _banner(_page(user, "/files/")) == ""


def test_the_files_page_states_the_rule(settings):
    html = _page(_user("rule", planned=False), "/files/")
    assert "Homes unused for 180 days are removed; you are told 14 days before." in html
    html = _page(_user("gui", language="zh-hans", planned=False), "/files/")
    assert "连续 180 天未使用的主目录会被删除；删除前 14 天会通知你。" in html
    settings.HOMES_RETENTION_IDLE_DAYS = 0  # kept forever: no rule to state
    assert 'data-testid="home-retention"' not in _page(_user("keep", planned=False), "/files/")


def test_the_banner_costs_the_dashboard_no_query():
    def queries(user) -> list[str]:
        client = Client()
        client.force_login(user)
        with CaptureQueriesContext(connection) as captured:
            assert client.get("/dashboard/").status_code == 200
        return [query["sql"] for query in captured]

    with_plan, without = queries(_user("with")), queries(_user("without", planned=False))
    assert len(with_plan) == len(without)
    # the date comes in the query that reads the request's user with their home, and in no other
    reading = [sql for sql in with_plan if "provisioner_homeremoval" in sql]
    assert len(reading) == 1 and "provisioner_homeusage" in reading[0]


def test_staff_read_the_record_in_the_admin():
    _user("ada")
    staff = user_create(username="op", email="", password="pw-123456789")
    staff.is_staff = staff.is_superuser = True
    staff.save(update_fields=["is_staff", "is_superuser"])
    html = _page(staff, "/admin/provisioner/homeremoval/")
    assert "ada-" in html and "2031" in html
