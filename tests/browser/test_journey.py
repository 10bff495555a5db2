"""The student's journey in a real Chromium against the real product: portal under uvicorn, Celery
worker and beat, a node agent on a fake A100 fleet running a real JupyterLab.

A new visitor signs up with an invite code, launches a 1/4-GPU session, opens JupyterLab through the
proxy, runs a cell that prints the GPU the kernel was given, sees the cost rise, stops, and finds the
charge in the wallet history; a second user gets a 404 on the first one's /jupyter/<session>/.
Screenshots of each main page at desktop and phone width go to test-artifacts/.
"""

from __future__ import annotations

import contextlib
import re

import pytest

from portal.services import user_create
from provisioner.models import Session
from provisioner.sealing import unseal
from tests.browser.steps import (
    DESKTOP,
    a100_offer,
    launch_and_wait_running,
    log_in,
    open_launch_page,
    product_stack,
    shoot,
    sign_up_with_code,
    stack_env,
    wait_for_free_gpu,
)
from tests.stack import agent_get, wait_for

pytestmark = [pytest.mark.browser, pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def stack(tmp_path):
    with product_stack(tmp_path, env=stack_env()) as started:
        yield started


@pytest.fixture
def offer():
    return a100_offer()


def _cost(page) -> str:
    return page.get_by_test_id("cost").inner_text()


def test_invite_code_to_a_notebook_on_a_quarter_gpu_and_back(browser, stack, offer, artifacts_dir):
    web, agent = stack["web"], stack["agent"]
    wait_for_free_gpu(stack)
    context = browser.new_context(base_url=web.url, viewport=DESKTOP)
    context.set_default_timeout(30_000)
    page = context.new_page()

    page.goto("/")
    shoot(page, artifacts_dir, "home")
    sign_up_with_code(page, offer, "mei")
    page.goto("/dashboard/")
    assert "2000 h" in page.content()
    shoot(page, artifacts_dir, "dashboard")

    open_launch_page(page)
    quote = page.get_by_test_id("quote").inner_text()
    assert "900.00" in quote and "now" in quote.lower()
    shoot(page, artifacts_dir, "launch")
    session = launch_and_wait_running(page, stack)
    session_id = str(session.id)
    assert session.state == Session.State.RUNNING and session.slot_count == 2
    shoot(page, artifacts_dir, "session")
    first = _cost(page)
    wait_for(lambda: _cost(page) != first, timeout=20, what="the cost to rise on the page")

    lab = context.new_page()
    seen = []  # what the browser received: every URL, header and JSON or HTML body

    def record(response):
        seen.append(response.url + repr(response.headers))
        if response.headers.get("content-type", "").startswith(("application/json", "text/html")):
            with contextlib.suppress(Exception):  # a body the page navigated away from
                seen.append(response.text())

    lab.on("response", record)
    lab.goto(f"/jupyter/{session_id}/lab")
    lab.locator(".jp-LauncherCard[data-category='Notebook']").first.click(timeout=90_000)
    try:
        # the kernel is up: the status bar reads "Python 3 (ipykernel) | Idle"
        lab.get_by_text(re.compile(r"\| Idle")).first.wait_for(timeout=90_000)
        cell = lab.locator(".jp-Cell .cm-content").first
        cell.click()
        cell.type('import os; print("GPU", os.environ.get("CUDA_VISIBLE_DEVICES"))')
        lab.keyboard.press("Shift+Enter")
        output = lab.locator(".jp-OutputArea-output").first
        output.wait_for(timeout=90_000)
    except Exception:
        lab.screenshot(path=str(artifacts_dir / "jupyterlab-failed.png"))
        raise
    assert f"GPU {session.device.uuid}" in output.inner_text()
    # The Jupyter token stays between the agent and JupyterLab: nothing the browser got carries it.
    jupyter_token = unseal(session.jupyter_token_sealed)
    assert seen and any("/api/" in text for text in seen)
    assert not [text[:200] for text in seen if jupyter_token in text]
    assert jupyter_token not in lab.content()
    assert not [c for c in context.cookies() if jupyter_token in c["value"]]
    lab.screenshot(path=str(artifacts_dir / "jupyterlab-desktop.png"))

    stranger = user_create(username="eve", email="eve@example.com", password="another-passphrase-7")
    other = browser.new_context(base_url=web.url)
    other_page = other.new_page()
    log_in(other_page, stranger.username, "another-passphrase-7")
    assert other_page.goto(f"/jupyter/{session_id}/lab").status == 404
    assert other_page.goto(f"/sessions/{session_id}/").status == 404
    other.close()

    user_create(username="ops", email="ops@example.com", password="operator-passphrase-9", is_staff=True)
    staff = browser.new_context(base_url=web.url, viewport=DESKTOP)
    staff_page = staff.new_page()
    log_in(staff_page, "ops", "operator-passphrase-9")
    staff_page.goto("/operations/")
    assert "node-e2e" in staff_page.content() and staff_page.locator(".slot.taken").count() == 2
    shoot(staff_page, artifacts_dir, "operations")
    staff.close()

    page.bring_to_front()
    page.click("form[action$='/stop'] button[type=submit]")
    wait_for(
        lambda: Session.objects.get(id=session_id).state == Session.State.STOPPED,
        timeout=60,
        what=f"the session to stop\n{agent.tail()}",
    )
    wait_for(
        lambda: agent_get(agent, "/v1/health").json()["workloads"] == 0,
        timeout=30,
        what="the workload to go from the agent",
    )
    page.goto("/wallet/")
    history = page.content()
    assert "Card burn" in history or "Usage" in history
    shoot(page, artifacts_dir, "wallet")
    page.goto("/cards/")
    shoot(page, artifacts_dir, "cards")

    with page.expect_navigation():  # remembered on the user: every page follows
        page.select_option("#language-switch", "zh-hans")
    page.goto(f"/sessions/{session_id}/")
    assert "已停止" in page.content() and "工作负载的限制" in page.content()
    shoot(page, artifacts_dir, "session-zh")
    page.goto("/dashboard/")
    shoot(page, artifacts_dir, "dashboard-zh")
    context.close()
