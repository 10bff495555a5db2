"""Gift a whole card from the cards page, take it back, gift it again, and a classmate redeems it.

tests/browser/test_cards.py already drives redeem → split → a second user redeems a part; this covers
the rest of the page's flows (gift all, revoke) with the same two-browser setup."""

import re

import pytest
from playwright.sync_api import expect

from billing.services.cards import card_batch_issue
from portal.services import user_create

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]
PASSWORD = "a-long-pass-phrase-9"


def _log_in(context, username):
    page = context.new_page()
    page.goto("/login/")
    page.get_by_label("Username").fill(username)
    page.get_by_label("Password").fill(PASSWORD)
    page.get_by_role("button", name=re.compile("log in|sign in", re.I)).click()
    page.wait_for_url("**/dashboard/")
    return page


def _codes(page) -> list[str]:
    box = page.get_by_test_id("new-codes")
    expect(box).to_be_visible()
    return re.findall(r"[0-9A-Z]{4}(?:-[0-9A-Z]{4}){3}-[0-9A-Z*~$=]", box.inner_text())  # check: mod 37


def test_gift_revoke_and_gift_again_then_a_classmate_redeems(browser, live_server, artifacts_dir):
    for name in ("giver", "taker"):
        user_create(username=name, email=f"{name}@example.com", password=PASSWORD)
    _batch, (code,) = card_batch_issue(hours_micros=6_000_000, count=1, valid_days=30, label="RL101")

    first = browser.new_context(base_url=live_server.url)
    page = _log_in(first, "giver")
    page.goto("/cards/")
    page.get_by_label("Invite code").fill(code)
    page.get_by_role("button", name="Redeem").click()
    expect(page.get_by_test_id("cards")).to_contain_text("6 h")

    page.get_by_role("button", name="Gift all").click()
    (gift,) = _codes(page)
    expect(page.get_by_role("button", name="Revoke")).to_have_count(1)
    page.get_by_role("button", name="Revoke").click()
    expect(page.get_by_text("Revoked")).to_be_visible()
    expect(page.get_by_test_id("cards")).to_contain_text("6 h")  # the hours came back

    page.get_by_role("button", name="Gift all").click()
    (second_gift,) = _codes(page)
    assert second_gift != gift

    other = browser.new_context(base_url=live_server.url, viewport={"width": 390, "height": 844})
    friend = _log_in(other, "taker")
    friend.goto("/cards/")
    friend.get_by_label("Invite code").fill(gift)  # the revoked one
    friend.get_by_role("button", name="Redeem").click()
    expect(friend.get_by_text("withdrawn")).to_be_visible()
    friend.get_by_label("Invite code").fill(second_gift)
    friend.get_by_role("button", name="Redeem").click()
    cards = friend.get_by_test_id("cards")
    expect(cards).to_contain_text("6 h")
    expect(cards).to_contain_text("gift from giver")
    expect(cards).to_contain_text("RL101")
    friend.screenshot(path=str(artifacts_dir / "cards-gift-phone.png"), full_page=True)

    page.reload()
    expect(page.get_by_role("button", name="Revoke")).to_have_count(0)  # redeemed: nothing to revoke
    first.close()
    other.close()
