"""The bell's buttons in a real browser: one form for the list, each button posting to its own notice."""

import pytest
from playwright.sync_api import expect

from notices.models import Notice
from notices.services import notify
from portal.services import user_create
from tests.browser.steps import log_in

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def test_the_bells_buttons_mark_read_and_dismiss_their_own_notice_and_come_back(browser, live_server):
    user = user_create(username="lin", email="", password="a-long-pass-phrase")
    for index in range(3):
        notify(users=[user], kind="session_started", key="session_started",
               params={"session": f"T4 #{index}"}, dedupe_key=f"bell-{index}", url="/sessions/")  # fmt: skip
    context = browser.new_context(base_url=live_server.url)
    page = context.new_page()
    log_in(page, "lin", "a-long-pass-phrase")
    page.goto("/wallet/")
    expect(page.get_by_test_id("bell-count")).to_have_text("3")

    bell = page.get_by_test_id("bell")
    bell.locator("summary").click()
    second = bell.get_by_test_id("notice").filter(has_text="T4 #1")
    second.get_by_role("button", name="Mark read").click()
    expect(page).to_have_url(f"{live_server.url}/wallet/")  # back where the reader was
    expect(page.get_by_test_id("bell-count")).to_have_text("2")
    read = {n.message_params["session"]: n.read_at is not None for n in Notice.objects.filter(user=user)}
    assert read == {"T4 #0": False, "T4 #1": True, "T4 #2": False}

    page.get_by_test_id("bell").locator("summary").click()
    first = page.get_by_test_id("bell").get_by_test_id("notice").filter(has_text="T4 #0")
    first.get_by_role("button", name="Dismiss").click()
    expect(page.get_by_test_id("bell-count")).to_have_text("1")
    dismissed = Notice.objects.get(user=user, dedupe_key="bell-0").dismissed_at
    assert dismissed is not None and Notice.objects.get(user=user, dedupe_key="bell-2").dismissed_at is None
    context.close()
