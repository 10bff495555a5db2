"""The bell, the notices page (no JavaScript) and the API: the owner's notices only, in bounded queries."""

from __future__ import annotations

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from rest_framework.test import APIClient

from notices.models import Notice, NoticePreference
from notices.services import notify
from tests.notices.conftest import make_user

pytestmark = pytest.mark.django_db


def _started(user, count: int, *, start: int = 0) -> None:
    for index in range(start, start + count):
        notify(users=[user], kind="session_started", key="session_started",
               params={"session": f"T4 #{index}"}, dedupe_key=f"s:{index}", url=f"/sessions/{index}/")  # fmt: skip


def _browser(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def _api(user) -> APIClient:
    client = APIClient()
    client.force_login(user)  # a browser session: the preferences middleware sets the user's language
    return client


def test_the_bell_shows_the_unread_count_and_an_empty_state():
    user = make_user("ada")
    page = _browser(user).get("/profile/").content.decode()
    assert 'data-testid="bell"' in page and "No notifications" in page and "bell-count" not in page
    _started(user, 3)
    page = _browser(user).get("/profile/").content.decode()
    assert 'data-testid="bell-count">3<' in page and "Your T4 #2 session is running." in page


def test_read_dismiss_and_read_all_by_form_post():
    user = make_user("ada")
    _started(user, 3)
    first, second, _third = Notice.objects.order_by("id")
    client = _browser(user)
    assert client.post(f"/notices/{first.id}/read", {"next": "/dashboard/"}).url == "/dashboard/"
    assert client.post(f"/notices/{second.id}/dismiss", {"next": "https://evil.example/"}).url == "/notices/"
    page = client.get("/notices/").content.decode()
    assert "T4 #0" in page and "T4 #1" not in page and 'data-testid="bell-count">1<' in page
    client.post("/notices/read-all")
    assert not Notice.objects.filter(read_at__isnull=True).exists()
    assert client.get(f"/notices/{first.id}/read").status_code == 405


def test_another_users_notice_is_404_on_the_page_and_the_api():
    ada, eve = make_user("ada"), make_user("eve")
    _started(ada, 1)
    notice = Notice.objects.get()
    for path in (f"/notices/{notice.id}/read", f"/notices/{notice.id}/dismiss"):
        assert _browser(eve).post(path).status_code == 404
    for path in (f"/api/v1/notices/{notice.id}/read", f"/api/v1/notices/{notice.id}/dismiss"):
        assert _api(eve).post(path).status_code == 404
    assert _api(eve).get("/api/v1/notices/").json() == {"unread": 0, "notices": []}
    notice.refresh_from_db()
    assert notice.read_at is None and notice.dismissed_at is None


def test_the_api_lists_reads_dismisses_and_reads_all():
    user = make_user("ada", language="zh-hans")
    _started(user, 2)
    first, second = Notice.objects.order_by("id")
    client = _api(user)
    listed = client.get("/api/v1/notices/").json()
    assert listed["unread"] == 2 and [n["id"] for n in listed["notices"]] == [second.id, first.id]
    assert listed["notices"][0]["url"] == "/sessions/1/" and "T4 #1" in listed["notices"][0]["text"]
    assert "running" not in listed["notices"][0]["text"]  # in the user's language
    assert client.post(f"/api/v1/notices/{first.id}/read").json()["read_at"] is not None
    assert client.post(f"/api/v1/notices/{second.id}/dismiss").json()["dismissed_at"] is not None
    assert client.get("/api/v1/notices/").json()["unread"] == 0
    assert client.post("/api/v1/notices/read-all").json() == {"marked": 0}
    assert APIClient().get("/api/v1/notices/").status_code in (401, 403)


def test_email_choices_are_saved_from_the_settings_page():
    user = make_user("ada")
    client = _browser(user)
    assert "A session started" in client.get("/notices/settings/").content.decode()
    client.post("/notices/settings/", {"email_session_started": "on"})  # everything else unticked
    chosen = dict(NoticePreference.objects.filter(user=user).values_list("kind", "email"))
    assert chosen["session_started"] is True and chosen["runway_low"] is False
    assert "ledger_hold" in chosen  # on by default, turned off


@pytest.mark.parametrize("path", ["/notices/", "/api/v1/notices/", "/dashboard/"])
def test_queries_do_not_grow_with_notices(path, django_assert_max_num_queries):
    user = make_user("ada")
    client = _api(user) if path.startswith("/api/") else _browser(user)
    _started(user, 2)
    client.get(path)
    with CaptureQueriesContext(connection) as few:
        assert client.get(path).status_code == 200
    _started(user, 30, start=2)
    with django_assert_max_num_queries(len(few)):
        assert client.get(path).status_code == 200
