"""The dashboard follows the money without a reload, from one polled answer for all its live parts."""

import pytest
from playwright.sync_api import expect

from billing.services.topups import wallet_credit_promotion
from portal.services import user_create

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def test_a_top_up_shows_on_the_open_dashboard_from_one_request_a_poll(browser, live_server):
    user = user_create(username="lin", email="lin@example.com", password="a-long-pass-phrase")
    context = browser.new_context(base_url=live_server.url)
    page = context.new_page()
    page.goto("/login/")
    page.get_by_label("Username").fill("lin")
    page.get_by_label("Password").fill("a-long-pass-phrase")
    page.get_by_role("button", name="Log in").click()
    page.goto("/dashboard/")
    live = []
    page.on("request", lambda request: "/live/" in request.url and live.append(request.url))
    expect(page.get_by_test_id("wallet-balance")).to_contain_text("0.00")
    wallet_credit_promotion(account=user.account, amount_micros=12_340_000, idempotency_key="lin-gift")
    expect(page.get_by_test_id("wallet-balance")).to_contain_text("12.34", timeout=15_000)
    assert live and all("/live/dashboard" in url for url in live), live  # no separate funds/sessions polls
    assert page.get_by_test_id("wallet-balance").count() == 1  # the part replaced, not added
    context.close()
