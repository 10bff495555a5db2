"""A stop warning shows inside JupyterLab, and "I'm still here" there keeps the session: in Chromium against
the real product (portal, Celery, an agent running the session in its bubblewrap sandbox with the
portal's lab extension), the page opened through the portal's proxy as a student opens it.

The portal tells the extension to ask every second (SESSION_NOTICES_POLL_SECONDS), so the banner shows
soon after the warning is written."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.utils import timezone

from provisioner.messages import message, message_columns
from provisioner.models import Session, SessionEvent, StopWarning
from tests.browser.steps import (
    DESKTOP,
    a100_offer,
    launch_and_wait_running,
    open_launch_page,
    product_stack,
    sign_up_with_code,
    stack_env,
    wait_for_free_gpu,
)
from tests.stack import wait_for

pytestmark = [pytest.mark.browser, pytest.mark.e2e, pytest.mark.django_db(transaction=True)]
# The lab open in Chromium, its notebook's kernel idle, must read as idle here: a browser connected to a
# kernel is not counted, and a fake GPU's figure for the session's processes (its fleet's, always the same)
# is under the bar.
OPEN_LAB_IS_IDLE = {"SESSION_IDLE_COUNT_CONNECTED": "0", "SESSION_IDLE_GPU_PERCENT": "99"}
WARNING_TEXT = "No activity: this session stops in about 5 minutes unless used."


@pytest.fixture
def stack(tmp_path):
    env = stack_env(SESSION_NOTICES_POLL_SECONDS="1", **OPEN_LAB_IS_IDLE)
    with product_stack(tmp_path, env=env) as started:
        yield started


def _idle_warning(session: Session) -> StopWarning:
    key, params, _text = message_columns(message("idle_warning", minutes=5))
    return StopWarning.objects.create(
        session=session,
        kind=StopWarning.Kind.IDLE,
        due_at=timezone.now() + timedelta(minutes=5),
        message_key=key,
        message_params=params,
    )


def _student_in_the_lab(browser, stack, username: str):
    """A student signed up with a code launches a 1/4 A100 and opens its JupyterLab through the portal,
    its notebook's kernel idle. Returns (context, session page, session, lab page)."""
    code = a100_offer()
    wait_for_free_gpu(stack)
    context = browser.new_context(base_url=stack["web"].url, viewport=DESKTOP)
    context.set_default_timeout(30_000)
    page = context.new_page()
    sign_up_with_code(page, code, username)
    open_launch_page(page)
    session = launch_and_wait_running(page, stack)
    with context.expect_page() as opened:
        page.get_by_test_id("open-jupyter").click()
    lab = opened.value
    lab.get_by_text(re.compile(r"\| Idle")).first.wait_for(timeout=90_000)
    return context, page, session, lab


def test_an_idle_warning_shows_in_the_lab_and_im_still_here_keeps_the_session(browser, stack, artifacts_dir):
    context, page, session, lab = _student_in_the_lab(browser, stack, "mei")
    banner = lab.locator("#suanli-notices")
    assert banner.count() == 0  # nothing to say yet

    def quiet() -> bool:  # the kernel's start is activity, seen for a few heartbeats: let it pass
        last = Session.objects.get(pk=session.pk).last_active_at
        return (timezone.now() - last).total_seconds() > 4

    wait_for(quiet, timeout=30, what="the lab to fall quiet")
    long_ago = timezone.now() - timedelta(minutes=55)
    Session.objects.filter(pk=session.pk).update(last_active_at=long_ago)
    warning = _idle_warning(session)
    banner.wait_for(state="visible", timeout=20_000)
    assert WARNING_TEXT in banner.inner_text()
    shell_top = lab.locator("#main").bounding_box()["y"]
    assert shell_top >= banner.bounding_box()["height"] - 1  # the lab moved down: the banner hides none of it
    countdown = banner.locator(".suanli-notice-left")
    assert re.fullmatch(r"Stops in [45]:\d\d", countdown.inner_text()), countdown.inner_text()
    first = countdown.inner_text()
    wait_for(lambda: countdown.inner_text() != first, timeout=5, what="the time left to count down")
    lab.screenshot(path=str(artifacts_dir / "lab-notice.png"))

    clicked_at = timezone.now()
    banner.get_by_role("button", name="I'm still here").click()
    banner.wait_for(state="detached", timeout=10_000)
    warning.refresh_from_db()
    session.refresh_from_db()
    assert warning.cleared_at is not None and warning.cleared_at >= clicked_at
    assert session.last_active_at >= clicked_at
    assert SessionEvent.objects.filter(session=session, kind="kept_alive").count() == 1
    lab.wait_for_timeout(2_500)  # a few more polls: the cleared warning stays gone
    assert banner.count() == 0 and lab.locator("#main").bounding_box()["y"] == 0
    context.close()


@pytest.fixture
def idle_stack(tmp_path):
    env = stack_env(
        SESSION_NOTICES_POLL_SECONDS="1",
        SESSION_LIMITS_SWEEP_SECONDS="1",
        **OPEN_LAB_IS_IDLE,
        SESSION_STOP_WARN_SECONDS="25",
        EMAIL_URL=f"file://{tmp_path / 'mail'}",
    )
    with product_stack(tmp_path, env=env) as started:
        yield started


def test_an_untouched_session_is_warned_on_the_page_by_email_and_in_the_lab_then_stopped(
    browser, idle_stack, artifacts_dir, tmp_path
):
    """Beat runs the limits sweep every second; the session may idle 40 s and is warned 25 s ahead. The
    lab stays open in Chromium, untouched (``OPEN_LAB_IS_IDLE``)."""
    stack = idle_stack
    context, page, session, lab = _student_in_the_lab(browser, stack, "idle")
    Session.objects.filter(pk=session.pk).update(idle_seconds=40, last_active_at=timezone.now())

    banner = lab.locator("#suanli-notices")
    banner.wait_for(state="visible", timeout=40_000)
    assert "No activity: this session stops in about" in banner.inner_text()
    assert "Your home folder is kept." in banner.inner_text()
    page.reload()
    assert "No activity" in page.get_by_test_id("stop-warning").inner_text()
    page.screenshot(path=str(artifacts_dir / "session-stop-warning.png"), full_page=True)
    mail = tmp_path / "mail"
    wait_for(lambda: mail.exists() and any("No activity" in p.read_text() for p in mail.iterdir()), 10,
             what="the warning's email")  # fmt: skip
    wait_for(lambda: Session.objects.get(pk=session.pk).state in ("stopping", "stopped"), 60, what="the stop")
    assert "idle" in Session.objects.get(pk=session.pk).reason
    context.close()
