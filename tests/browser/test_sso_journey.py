"""Single sign-on end to end in a real Chromium: the real ``oidc-provider`` (tests/oidc) and the real
product configured for it through the environment, as an operator would (portal under uvicorn, Celery
worker and beat, a node agent on a fake A100 fleet).

A student clicks the provider's button on the login page, signs in and consents on the provider's own
pages, lands on the dashboard with an account and in the course the ``groups`` claim names, redeems a
compute-card code and launches a 1/4-GPU session that reaches running. A student whose email is outside
the allowed domains is sent back to the login page with the reason, and no user is made.
"""

from __future__ import annotations

import re

import pytest
from playwright.sync_api import expect

from portal.models import Membership, User
from portal.services import team_create, user_create
from provisioner.models import Session
from tests.browser.steps import (
    DESKTOP,
    a100_offer,
    launch_and_wait_running,
    local_only,
    open_launch_page,
    product_stack,
    shoot,
    stack_env,
    wait_for_free_gpu,
)
from tests.oidc import CLIENT_ID, CLIENT_SECRET, INSTALLED, NOT_INSTALLED, SCOPES, oidc_provider
from tests.stack import free_port, start_web

pytestmark = [pytest.mark.browser, pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

if not INSTALLED:
    pytest.skip(NOT_INSTALLED, allow_module_level=True)

PROVIDER_PAGE = re.compile(r"^http://127\.0\.0\.1:\d+/interaction/")


def _sso_env(issuer: str) -> dict[str, str]:
    return stack_env(
        OIDC_ISSUER=issuer,
        OIDC_CLIENT_ID=CLIENT_ID,
        OIDC_CLIENT_SECRET=CLIENT_SECRET,
        OIDC_SCOPES=SCOPES,
        OIDC_TEAM_CLAIM="groups",
        OIDC_ALLOWED_EMAIL_DOMAINS="uni.example.edu",
        OIDC_PROVIDER_NAME="Example University",
    )


@pytest.fixture
def provider_port() -> int:
    return free_port()


@pytest.fixture
def sso_stack(tmp_path, provider_port):
    """The whole product, told of the provider; the provider starts once the portal's callback URL is
    known (the portal reads the provider's discovery document on the first sign-in, not at start)."""
    issuer = f"http://127.0.0.1:{provider_port}"
    with product_stack(tmp_path, env=_sso_env(issuer)) as stack:
        callback = f"{stack['web'].url}/oidc/callback/"
        with oidc_provider(port=provider_port, redirect_uris=[callback]) as started:
            assert started == issuer
            yield stack


@pytest.fixture
def sso_portal(tmp_path, provider_port):
    """The portal alone, told of the provider: enough for a sign-in that is refused."""
    web = start_web(tmp_path, env=_sso_env(f"http://127.0.0.1:{provider_port}"))
    try:
        with oidc_provider(port=provider_port, redirect_uris=[f"{web.url}/oidc/callback/"]):
            yield web
    finally:
        web.stop()


def _browser_page(browser, url: str):
    context = browser.new_context(base_url=url, viewport=DESKTOP)
    context.set_default_timeout(30_000)
    local_only(context)
    return context, context.new_page()


def _sign_in_with_the_provider(page, login: str) -> None:
    """From the portal's login page through the provider's own login and consent pages, as a person."""
    page.goto("/login/")
    page.get_by_role("link", name="Sign in with Example University").click()
    page.wait_for_url(PROVIDER_PAGE)
    page.fill("input[name=login]", login)
    page.fill("input[name=password]", "any password")
    page.get_by_role("button", name="Sign-in").click()
    page.wait_for_url(PROVIDER_PAGE)
    page.get_by_role("button", name="Continue").click()  # consent to the portal's scopes


def test_a_student_signs_in_with_the_provider_redeems_a_code_and_runs_a_session(
    browser, sso_stack, artifacts_dir
):
    course = team_create(
        creator=user_create(username="prof", email="", password="a-long-pass-phrase-9"), name="CS101"
    )
    code = a100_offer()
    wait_for_free_gpu(sso_stack)
    context, page = _browser_page(browser, sso_stack["web"].url)

    _sign_in_with_the_provider(page, "mei")
    page.wait_for_url(re.compile(r"/dashboard/$"))
    expect(page.get_by_role("heading", name="Dashboard")).to_be_visible()
    expect(page.get_by_role("link", name="CS101")).to_be_visible()  # joined by the groups claim
    user = User.objects.get(sso_subject__endswith="#mei")
    assert (user.username, user.email) == ("mei", "mei@uni.example.edu")
    assert user.account is not None and not user.has_usable_password()
    assert Membership.objects.get(team=course, user=user).role == Membership.Role.MEMBER
    shoot(page, artifacts_dir, "sso-dashboard")

    page.goto("/cards/")
    page.get_by_label("Invite code").fill(code)
    page.get_by_role("button", name="Redeem").click()
    expect(page.get_by_test_id("cards")).to_contain_text("2000 h")
    page.goto("/dashboard/")
    assert "2000 h" in page.content()

    open_launch_page(page)
    session = launch_and_wait_running(page, sso_stack)
    assert session.state == Session.State.RUNNING and session.account_id == user.account_id
    shoot(page, artifacts_dir, "sso-session")
    context.close()


def test_an_email_outside_the_allowed_domains_is_refused_with_the_reason(browser, sso_portal):
    context, page = _browser_page(browser, sso_portal.url)
    _sign_in_with_the_provider(page, "lin")  # lin@elsewhere.example.com
    page.wait_for_url(re.compile(r"/login/$"))
    expect(page.get_by_role("status")).to_contain_text(
        "Sign-in here is for @uni.example.edu email addresses."
    )
    assert not User.objects.filter(username="lin").exists()
    assert page.goto("/dashboard/").url.split("?")[0].endswith("/login/")  # not signed in
    context.close()
