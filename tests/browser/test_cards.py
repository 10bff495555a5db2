"""A student redeems a course's invite code, splits the card, and a classmate redeems a part."""

import re

import pytest
from playwright.sync_api import expect

from billing.services.cards import card_batch_issue

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def _sign_up(page, username, code=""):
    page.goto("/signup/" + (f"?code={code}" if code else ""))
    page.get_by_label("Username").fill(username)
    page.get_by_label("Password", exact=True).fill("a-long-pass-phrase")
    page.get_by_role("button", name="Sign up").click()


def test_redeem_split_and_a_classmate_redeems_a_part(browser, live_server, artifacts_dir):
    _batch, (code,) = card_batch_issue(
        hours_micros=12_000_000, count=1, valid_days=30, max_parts=3, label="DL101"
    )
    first = browser.new_context(base_url=live_server.url)
    page = first.new_page()
    _sign_up(page, "xiaoming", code)
    page.wait_for_url("**/dashboard/")
    expect(page.get_by_text("Your compute card is redeemed")).to_be_visible()
    page.get_by_role("link", name="Cards").first.click()
    cards = page.get_by_test_id("cards")
    expect(cards).to_contain_text("12 h")
    expect(cards).to_contain_text("DL101")
    page.get_by_label("Hours per part").fill("4, 2.5")
    page.get_by_role("button", name="Split").click()
    codes = page.get_by_test_id("new-codes")
    expect(codes).to_be_visible()
    gifted = re.findall(r"[0-9A-Z]{4}(?:-[0-9A-Z*~$=]{1,4})+", codes.inner_text())
    assert len(gifted) == 2
    expect(page.get_by_test_id("cards")).to_contain_text("5.5 h")
    page.screenshot(path=str(artifacts_dir / "cards-desktop.png"), full_page=True)
    page.reload()
    expect(page.get_by_test_id("new-codes")).to_have_count(0)  # codes are shown once

    second = browser.new_context(base_url=live_server.url, viewport={"width": 390, "height": 844})
    friend = second.new_page()
    _sign_up(friend, "xiaohong")
    friend.wait_for_url("**/dashboard/")
    friend.goto("/cards/")
    friend.get_by_label("Invite code").fill(gifted[0].lower())
    friend.get_by_role("button", name="Redeem").click()
    expect(friend.get_by_test_id("cards")).to_contain_text("4 h")
    expect(friend.get_by_test_id("cards")).to_contain_text("gift from xiaoming")
    friend.screenshot(path=str(artifacts_dir / "cards-phone.png"), full_page=True)
    friend.get_by_label("Invite code").fill(gifted[0])
    friend.get_by_role("button", name="Redeem").click()
    expect(friend.get_by_text("already been redeemed")).to_be_visible()
    first.close()
    second.close()
