import pytest
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
