"""Staff open the usage report and the audit log in Chromium, in English and in Simplified Chinese."""

import pytest
from playwright.sync_api import expect

from billing.services.pricing import price_set
from billing.services.topups import wallet_credit_promotion
from portal.services import user_create
from tests.billing.conftest import A100, seed_prices
from tests.portal.usage_fixtures import catalog_ensure, metered_session

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def test_staff_read_usage_and_audit_in_english_and_chinese(browser, live_server, artifacts_dir):
    seed_prices()
    catalog_ensure()
    root = user_create(username="root", email="", password="a-long-pass-phrase", is_staff=True)
    ada = user_create(username="ada", email="", password="a-long-pass-phrase")
    wallet_credit_promotion(account=ada.account, amount_micros=20_000_000, idempotency_key="f-ada")
    metered_session(owner=ada, account=ada.account, gpu_model=A100, profile="whole", seconds=1800)  # ¥6.00
    price_set(gpu_model="T4", profile="whole", price_micros_per_hour=3_000_000, actor=root, reason="new T4s")

    context = browser.new_context(base_url=live_server.url, viewport={"width": 1280, "height": 900})
    page = context.new_page()
    page.goto("/login/")
    page.get_by_label("Username").fill("root")
    page.get_by_label("Password").fill("a-long-pass-phrase")
    page.get_by_role("button", name="Log in").click()
    page.wait_for_url("**/dashboard/")

    page.goto("/operations/usage/?group=user")
    expect(page.get_by_role("heading", name="Usage report")).to_be_visible()
    expect(page.get_by_test_id("total-money")).to_have_text("¥6.00")
    expect(page.get_by_test_id("total-gpu-hours")).to_have_text("0.5000")
    expect(page.get_by_test_id("usage-chart")).to_be_visible()
    expect(page.get_by_test_id("usage-table")).to_contain_text("ada")
    page.screenshot(path=str(artifacts_dir / "usage-report-en.png"), full_page=True)
    page.goto("/operations/audit/")
    expect(page.get_by_role("heading", name="Audit log")).to_be_visible()
    expect(page.get_by_test_id("audit-table")).to_contain_text("price.set")
    expect(page.get_by_test_id("audit-table")).to_contain_text('{"price_micros_per_hour": 3000000}')

    page.select_option("#language-switch", "zh-hans")
    expect(page.get_by_role("heading", name="审计日志")).to_be_visible()
    expect(page.get_by_role("columnheader", name="变更前")).to_be_visible()
    expect(page.get_by_test_id("audit-table")).to_contain_text("new T4s")
    page.goto("/operations/usage/?group=gpu_model")
    expect(page.get_by_role("heading", name="用量报告")).to_be_visible()
    expect(page.get_by_text("GPU 小时").first).to_be_visible()
    expect(page.get_by_test_id("total-money")).to_have_text("¥6.00")
    expect(page.get_by_test_id("usage-table")).to_contain_text(A100)
    page.screenshot(path=str(artifacts_dir / "usage-report-zh.png"), full_page=True)
    page.goto("/operations/usage/?from=2024-01-01&to=2024-01-02")
    expect(page.get_by_test_id("report-empty")).to_contain_text("2024-01-01")
    context.close()
