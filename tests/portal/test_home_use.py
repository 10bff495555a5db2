"""The home's measured use beside its limits, on the dashboard and the files page, in the user's
language; read with the request's user (portal.backends), so it costs the pages no query."""

from __future__ import annotations

import re

import pytest
from django.test import Client
from django.utils import timezone

from portal.services import user_create
from provisioner.models import HomeUsage
from provisioner.quotas import quota_set

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _fast_hasher(settings):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


def _line(user, path: str = "/dashboard/") -> str:
    client = Client()
    client.force_login(user)
    page = client.get(path)
    assert page.status_code == 200
    found = re.search(r'<p class="home-use[^"]*".*?</p>', page.content.decode(), re.S)
    return found.group(0) if found else ""


def _user(name: str, *, language: str = "en", bytes_: int | None = None, files: int = 3201):
    user = user_create(username=name, email="", password="pw-123456789", language=language)
    if bytes_ is not None:
        HomeUsage.objects.create(user=user, bytes=bytes_, files=files, measured_at=timezone.now())
    return user


def test_the_dashboard_shows_the_home_beside_its_limit():
    line = _line(_user("ada", bytes_=int(1.2 * 2**30)))
    assert "Home: 1.2\xa0GB of 20.0\xa0GB, 3,201 files" in line
    assert "warning" not in line


def test_the_dashboard_shows_it_in_chinese():
    line = _line(_user("mei", language="zh-hans", bytes_=int(1.2 * 2**30)))
    assert "主目录：已用 1.2\xa0GB，上限 20.0\xa0GB，共 3,201 个文件" in line


def test_from_ninety_percent_of_a_limit_the_line_warns_and_over_it_says_launches_are_refused(settings):
    near = _line(_user("near", bytes_=int(18.5 * 2**30)))
    assert "message warning" in near and "Nearly full" in near
    user = _user("full", bytes_=10, files=10)
    quota_set(user=user, limits={"max_home_files": 9})
    over = _line(user)
    assert "message warning" in over and "new sessions are refused" in over


def test_no_line_before_a_measurement_and_no_limit_when_none_is_set(settings):
    assert _line(_user("new")) == ""
    settings.HOMES_QUOTA_BYTES = 0
    assert "Home: 5.0\xa0GB, 3,201 files" in _line(_user("free", bytes_=5 * 2**30))


def test_the_files_page_shows_it_too(settings, tmp_path):
    settings.HOMES_BACKEND, settings.HOMES_SHARED_ROOT = "shared", str(tmp_path)
    assert "Home: 1.0\xa0KB of 20.0\xa0GB" in _line(_user("ada", bytes_=1024), "/files/")
