import re

import pytest
from django.core import mail
from playwright.sync_api import expect

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def test_a_visitor_signs_up_logs_in_and_sees_the_dashboard(page, artifacts_dir):
    page.goto("/")
    page.get_by_role("link", name="Sign up").first.click()
    page.get_by_label("Username").fill("xiaoming")
    page.get_by_label("Password").fill("a-long-pass-phrase")
    page.get_by_role("button", name="Sign up").click()
    page.wait_for_url("**/dashboard/")
    assert page.get_by_role("heading", name="Dashboard").is_visible()
    page.get_by_role("button", name="Log out").click()
    page.get_by_role("link", name="Log in").first.click()
    page.get_by_label("Username").fill("xiaoming")
    page.get_by_label("Password").fill("a-long-pass-phrase")
    page.get_by_role("button", name="Log in").click()
    page.wait_for_url("**/dashboard/")
    page.screenshot(path=str(artifacts_dir / "dashboard-desktop.png"), full_page=True)
    page.select_option("#language-switch", "zh-hans")
    expect(page.get_by_role("heading", name="仪表盘")).to_be_visible()


def test_an_unconfirmed_visitor_has_the_link_resent_and_confirms_with_it(page, settings):
    settings.SIGNUP_EMAIL_VERIFICATION = True
    page.goto("/signup/")
    page.get_by_label("Username").fill("xiaoming")
    page.get_by_label("Email").fill("xiaoming@example.edu")
    page.get_by_label("Password").fill("a-long-pass-phrase")
    page.get_by_role("button", name="Sign up").click()
    expect(page.get_by_test_id("verify-sent")).to_contain_text("xiaoming@example.edu")
    page.get_by_role("button", name="Resend the confirmation email").click()
    expect(page.get_by_role("status")).to_contain_text(
        "We sent a new confirmation link to xiaoming@example.edu"
    )
    assert [message.to for message in mail.outbox] == [["xiaoming@example.edu"]] * 2
    page.goto(re.search(r"https?://[^/\s]+(/signup/verify/\S+/)", mail.outbox[-1].body).group(1))
    page.wait_for_url("**/dashboard/")
    expect(page.get_by_role("heading", name="Dashboard")).to_be_visible()
