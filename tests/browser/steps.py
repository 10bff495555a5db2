"""Steps the end-to-end browser journeys share: the real product as subprocesses on the test database
(``product_stack``), an A100 offer and a compute-card code made through the service layer, and the
pages a student goes through (log in, launch a session and wait for it to run)."""

from __future__ import annotations

import contextlib
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx

from billing.services.cards import card_batch_issue
from billing.services.pricing import burn_rate_set, price_set
from conftest import subprocess_env
from portal.services import access_token_create
from provisioner.demo import seed_hardware
from provisioner.models import Environment, GpuModel, Node, Session
from provisioner.selectors import availability
from provisioner.services.nodes import node_enroll
from tests.stack import delete_workloads, start_agent, start_celery, start_web, wait_for

A100 = "A100-SXM4-80GB"
DESKTOP = {"width": 1280, "height": 900}
PHONE = {"width": 390, "height": 844}
LOCAL = re.compile(r"^https?://(127\.0\.0\.1|localhost)(:\d+)?/")


def stack_env(**extra: str) -> dict[str, str]:
    """The product's environment for a journey: the test database, and clocks fast enough to watch."""
    fast = {
        "METERING_TICK_SECONDS": "1",
        "BILLING_POSTING_INTERVAL_SECONDS": "3",
        "QUEUE_DISPATCH_SECONDS": "2",
        "AGENT_HEARTBEAT_INTERVAL_SECONDS": "1",
    }
    return subprocess_env(**(fast | extra))


@contextlib.contextmanager
def product_stack(log_dir: Path, *, env: dict[str, str]) -> Iterator[dict]:
    """The portal under uvicorn, Celery worker and beat, and one node agent on a fake A100 fleet,
    enrolled as ``node-e2e``. Yields ``{"web", "agent", "node", "processes"}``; on exit ends the agent's
    workloads, stops everything and prints the log of any process that did not exit cleanly."""
    processes = []
    try:
        web = start_web(log_dir, env=env)
        processes.append(web)
        processes += [start_celery("worker", log_dir, env=env), start_celery("beat", log_dir, env=env)]
        # No HAMi-core here: slices share the GPU best-effort (memory cap, time slicing).
        enrolment = node_enroll(
            name="node-e2e", address="http://127.0.0.1:1", labels={"sharing_policy": "best-effort"}
        )  # the address is the agent's, set once it listens
        agent = start_agent(log_dir, node="node-e2e", token=enrolment.token, portal=web.url)
        Node.objects.filter(pk=enrolment.node.pk).update(address=agent.url)
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


def a100_offer(*, hours: int = 2_000, label: str = "DL101") -> str:
    """A100s on sale (1/4 burns one card-hour a second) and one unredeemed card of ``hours``; its code."""
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
    burn_rate_set(gpu_model=A100, multiplier_milli=14_400_000)
    _batch, (code,) = card_batch_issue(hours_micros=hours * 1_000_000, count=1, valid_days=30, label=label)
    return code


def wait_for_free_gpu(stack: dict, *, profile: str = "1/4") -> None:
    """Wait for the agent's first heartbeat to offer an A100 slice; on a timeout, say what the node is."""
    try:
        wait_for(
            lambda: availability().get((A100, profile), 0) > 0, timeout=90, what=f"a free {profile} A100"
        )
    except AssertionError as exc:  # the logs as they are when it gave up
        node = Node.objects.get(pk=stack["node"].pk)
        devices = list(node.devices.values_list("uuid", "gpu_model__name", "health", "sharing_policy"))
        raise AssertionError(
            f"{exc}\nnode last heartbeat {node.last_heartbeat_at}, devices {devices}"
            f"\n--- agent\n{stack['agent'].tail()}\n--- web\n{stack['web'].tail()}"
        ) from None


def local_only(context) -> None:
    """Refuse every request of a browser context that leaves this machine (a provider's page that
    imports a web font): the tests reach nothing on the internet."""
    context.route(lambda url: not LOCAL.match(url), lambda route: route.abort())


def sign_up_with_code(page, code: str, username: str, password: str = "a-long-passphrase-42") -> None:
    """Sign up from an invite link (``/signup/?code=…``) and land on the dashboard or the cards page."""
    page.goto(f"/signup/?code={code}")
    page.fill("input[name=username]", username)
    page.fill("input[name=email]", f"{username}@example.com")
    page.fill("input[name=password]", password)
    page.click("form button[type=submit]")
    page.wait_for_url(re.compile(r"/(dashboard|cards)/"))


def log_in(page, username: str, password: str) -> None:
    page.goto("/login/")
    page.fill("input[name=username]", username)
    page.fill("input[name=password]", password)
    page.click("form button[type=submit]")
    page.wait_for_url(re.compile(r"/dashboard/"))


def open_launch_page(page, *, profile: str = "1/4") -> None:
    page.goto(f"/launch/?gpu_model={A100}&profile={profile}")


def launch_and_wait_running(page, stack: dict) -> Session:
    """On the launch page: launch, follow to the session's page and wait there until it offers
    JupyterLab (queued → placing → starting → running). Returns the session; on a timeout, its events
    and every process's log."""
    page.click("#launch-form button[type=submit]")
    page.wait_for_url(re.compile(r"/sessions/[0-9a-f-]{36}/$"))
    session_id = page.url.rstrip("/").rsplit("/", 1)[1]
    try:
        page.get_by_test_id("open-jupyter").wait_for(timeout=90_000)
    except Exception:
        events = list(Session.objects.get(id=session_id).events.values_list("kind", "message"))
        logs = "\n".join(f"--- {p.name}\n{p.tail()}" for p in stack["processes"])
        raise AssertionError(f"the session did not run: {events}\n{logs}") from None
    return Session.objects.select_related("device").get(id=session_id)


def shoot(page, artifacts_dir: Path, name: str) -> None:
    for label, size in (("desktop", DESKTOP), ("phone", PHONE)):
        page.set_viewport_size(size)
        page.screenshot(path=str(artifacts_dir / f"{name}-{label}.png"), full_page=True)
    page.set_viewport_size(DESKTOP)


def api_for(web_url: str, user) -> httpx.Client:
    """The product's API as ``user``, with a fresh token that may read and launch."""
    _token, raw = access_token_create(user=user, name="e2e", scopes=["read", "sessions"])
    return httpx.Client(base_url=web_url, headers={"Authorization": f"Bearer {raw}"}, timeout=30)


def mail_text(log_dir: Path) -> str:
    """Every email the stack wrote to ``log_dir/mail`` (``EMAIL_URL=file://…``), in one text."""
    folder = log_dir / "mail"
    return "\n".join(p.read_text() for p in sorted(folder.glob("*"))) if folder.exists() else ""


def api_launch(api: httpx.Client, *, profile: str = "1/4", **fields) -> str:
    """Launch an A100 ``profile`` session through the API (fields override the defaults); its id."""
    body = {"gpu_model": A100, "profile": profile, "environment": "python-3.11", "max_hours": 1, **fields}
    response = api.post("/api/v1/sessions", json=body)
    assert response.status_code == 201, response.text
    return response.json()["id"]
