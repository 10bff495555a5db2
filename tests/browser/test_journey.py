"""The student's journey in a real Chromium against the real product: portal under uvicorn, Celery
worker and beat, a node agent on a fake A100 fleet running a real JupyterLab.

A new visitor signs up with an invite code, launches a 1/4-GPU session, opens JupyterLab through the
proxy, runs a cell that prints the GPU the kernel was given, sees the cost rise, stops, and finds the
charge in the wallet history; a second user gets a 404 on the first one's /jupyter/<session>/.
Screenshots of each main page at desktop and phone width go to test-artifacts/.
"""

from __future__ import annotations

import re
import sys

import pytest

from billing.services.cards import card_batch_issue
from billing.services.pricing import burn_rate_set, price_set
from conftest import subprocess_env
from portal.services import user_create
from provisioner.demo import seed_hardware
from provisioner.models import Environment, GpuModel, Session
from provisioner.selectors import availability
from provisioner.services.nodes import node_enroll
from tests.stack import agent_get, delete_workloads, start_agent, start_celery, start_web, wait_for

pytestmark = [pytest.mark.browser, pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

A100 = "A100-SXM4-80GB"
DESKTOP = {"width": 1280, "height": 900}
PHONE = {"width": 390, "height": 844}


@pytest.fixture
def stack(tmp_path):
    env = subprocess_env(
        METERING_TICK_SECONDS="1",
        BILLING_POSTING_INTERVAL_SECONDS="3",
        QUEUE_DISPATCH_SECONDS="2",
        AGENT_HEARTBEAT_INTERVAL_SECONDS="1",
    )
    processes = []
    try:
        web = start_web(tmp_path, env=env)
        processes.append(web)
        processes += [start_celery("worker", tmp_path, env=env), start_celery("beat", tmp_path, env=env)]
        # No HAMi-core here: slices share the GPU best-effort (memory cap, time slicing).
        enrolment = node_enroll(
            name="node-e2e", address="http://127.0.0.1:1", labels={"sharing_policy": "best-effort"}
        )  # the address is the agent's, set once it listens
        agent = start_agent(tmp_path, node="node-e2e", token=enrolment.token, portal=web.url)
        node_enroll_address(enrolment.node, agent.url)
        processes.append(agent)
        yield {"web": web, "agent": agent, "node": enrolment.node, "processes": processes}
    finally:
        for process in processes:  # an agent leaves its workloads running when it stops: end them first
            if process.name.startswith("agent") and process.alive():
                delete_workloads(process)
        for process in reversed(processes):
            process.stop()
        for process in processes:
            if process.process.returncode not in (0, -15, None):
                print(f"--- {process.name} ---\n{process.tail()}")


def node_enroll_address(node, url: str) -> None:
    type(node).objects.filter(pk=node.pk).update(address=url)


@pytest.fixture
def offer():
    seed_hardware()  # profiles come from a migration, which an earlier transactional test's flush removed
    GpuModel.objects.update_or_create(
        name=A100,
        defaults={
            "memory_mib": 81920,
            "peak_tflops": 312.0,
            "profiles": ["whole", "1/2", "1/4", "1/8"],
            "nvml_names": [A100, f"NVIDIA {A100}"],
        },
    )
    Environment.objects.update_or_create(name="python-3.11", defaults={"python": sys.executable})
    price_set(gpu_model=A100, profile="whole", price_micros_per_hour=3_600_000_000)  # 1.00 a second
    burn_rate_set(gpu_model=A100, multiplier_milli=14_400_000)  # 1/4 burns one card-hour a second
    _batch, codes = card_batch_issue(hours_micros=2_000 * 1_000_000, count=1, valid_days=30, label="DL101")
    return codes[0]


def _shoot(page, artifacts_dir, name: str) -> None:
    for label, size in (("desktop", DESKTOP), ("phone", PHONE)):
        page.set_viewport_size(size)
        page.screenshot(path=str(artifacts_dir / f"{name}-{label}.png"), full_page=True)
    page.set_viewport_size(DESKTOP)


def _log_in(page, username: str, password: str) -> None:
    page.goto("/login/")
    page.fill("input[name=username]", username)
    page.fill("input[name=password]", password)
    page.click("form button[type=submit]")
    page.wait_for_url(re.compile(r"/dashboard/"))


def _cost(page) -> str:
    return page.get_by_test_id("cost").inner_text()


def test_invite_code_to_a_notebook_on_a_quarter_gpu_and_back(browser, stack, offer, artifacts_dir):
    web, agent = stack["web"], stack["agent"]
    try:
        wait_for(lambda: availability().get((A100, "1/4"), 0) > 0, timeout=90, what="a free quarter A100")
    except AssertionError as exc:  # the logs as they are when it gave up
        node = type(stack["node"]).objects.get(pk=stack["node"].pk)
        devices = list(node.devices.values_list("uuid", "gpu_model__name", "health", "sharing_policy"))
        raise AssertionError(
            f"{exc}\nnode last heartbeat {node.last_heartbeat_at}, devices {devices}"
            f"\n--- agent\n{agent.tail()}\n--- web\n{web.tail()}"
        ) from None
    context = browser.new_context(base_url=web.url, viewport=DESKTOP)
    context.set_default_timeout(30_000)
    page = context.new_page()

    page.goto("/")
    _shoot(page, artifacts_dir, "home")
    page.goto(f"/signup/?code={offer}")
    page.fill("input[name=username]", "mei")
    page.fill("input[name=email]", "mei@example.com")
    page.fill("input[name=password]", "a-long-passphrase-42")
    page.click("form button[type=submit]")
    page.wait_for_url(re.compile(r"/(dashboard|cards)/"))
    page.goto("/dashboard/")
    assert "2000 h" in page.content()
    _shoot(page, artifacts_dir, "dashboard")

    page.goto(f"/launch/?gpu_model={A100}&profile=1/4")
    quote = page.get_by_test_id("quote").inner_text()
    assert "900.00" in quote and "now" in quote.lower()
    _shoot(page, artifacts_dir, "launch")
    page.click("#launch-form button[type=submit]")
    page.wait_for_url(re.compile(r"/sessions/[0-9a-f-]{36}/$"))
    session_id = page.url.rstrip("/").rsplit("/", 1)[1]
    try:  # queued → placing → starting → running
        page.get_by_test_id("open-jupyter").wait_for(timeout=90_000)
    except Exception:
        events = list(Session.objects.get(id=session_id).events.values_list("kind", "message"))
        logs = "\n".join(f"--- {p.name}\n{p.tail()}" for p in stack["processes"])
        raise AssertionError(f"the session did not run: {events}\n{logs}") from None
    session = Session.objects.select_related("device").get(id=session_id)
    assert session.state == Session.State.RUNNING and session.slot_count == 2
    _shoot(page, artifacts_dir, "session")
    first = _cost(page)
    wait_for(lambda: _cost(page) != first, timeout=20, what="the cost to rise on the page")

    lab = context.new_page()
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
    assert session.jupyter_token_sealed not in lab.content()
    lab.screenshot(path=str(artifacts_dir / "jupyterlab-desktop.png"))

    stranger = user_create(username="eve", email="eve@example.com", password="another-passphrase-7")
    other = browser.new_context(base_url=web.url)
    other_page = other.new_page()
    _log_in(other_page, stranger.username, "another-passphrase-7")
    assert other_page.goto(f"/jupyter/{session_id}/lab").status == 404
    assert other_page.goto(f"/sessions/{session_id}/").status == 404
    other.close()

    user_create(username="ops", email="ops@example.com", password="operator-passphrase-9", is_staff=True)
    staff = browser.new_context(base_url=web.url, viewport=DESKTOP)
    staff_page = staff.new_page()
    _log_in(staff_page, "ops", "operator-passphrase-9")
    staff_page.goto("/operations/")
    assert "node-e2e" in staff_page.content() and staff_page.locator(".slot.taken").count() == 2
    _shoot(staff_page, artifacts_dir, "operations")
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
    _shoot(page, artifacts_dir, "wallet")
    page.goto("/cards/")
    _shoot(page, artifacts_dir, "cards")

    with page.expect_navigation():  # remembered on the user: every page follows
        page.select_option("#language-switch", "zh-hans")
    page.goto(f"/sessions/{session_id}/")
    assert "已停止" in page.content() and "工作负载的限制" in page.content()
    _shoot(page, artifacts_dir, "session-zh")
    page.goto("/dashboard/")
    _shoot(page, artifacts_dir, "dashboard-zh")
    context.close()
