"""End to end: the portal under uvicorn, a real Celery worker, and two real node agents on fake fleets
(node-a: A100s and T4s; node-b: H200s, one in MIG) heartbeating to it. A session is launched through
the API, reached through the portal's Jupyter proxy, and stopped; an agent killed with SIGKILL loses
its sessions within the liveness window, billed no further, and cleans its orphans when it returns."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
from django.db import transaction
from django.test import Client
from django.utils import timezone

from billing.models import Meter
from billing.services.metering import metering_tick
from conftest import start_celery, subprocess_env
from core.clock import db_now
from portal.services import access_token_create
from provisioner.models import Allocation, AllocationSlot, Device, Node, Session
from provisioner.services.heartbeats import nodes_liveness_sweep
from provisioner.services.nodes import node_enroll
from tests.agents.conftest import (
    REPO,
    execute_request,
    free_port,
    kernel_channels,
    process_tree,
    processes_mentioning,
    start_kernel,
    wait_for,
)
from tests.provisioner.conftest import A100, ENV, make_catalog, make_user

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
FLEETS = REPO / "agents" / "fleets"


@dataclass
class Portal:
    url: str
    process: subprocess.Popen
    log: Path


@pytest.fixture
def portal(transactional_db, tmp_path, celery_worker_process):
    """uvicorn serving portal.asgi:application on the test database, telling agents to beat every second."""
    port = free_port()
    log = tmp_path / "uvicorn.log"
    env = subprocess_env(AGENT_HEARTBEAT_INTERVAL_SECONDS="1")
    command = [sys.executable, "-m", "uvicorn", "portal.asgi:application", "--host", "127.0.0.1",
               "--port", str(port), "--no-access-log", "--ws", "portal.ws_relay:WebSocketRelay"]  # fmt: skip
    with open(log, "wb") as out:
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"

    def up():
        if process.poll() is not None:
            raise AssertionError(f"uvicorn exited:\n{log.read_text()[-3000:]}")
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(f"{url}/livez", timeout=2).status_code == 200
        return False

    wait_for(up, 30, 0.2, "uvicorn")
    make_catalog()
    yield Portal(url, process, log)
    process.terminate()
    try:
        process.wait(10)
    except subprocess.TimeoutExpired:
        process.kill()


class Agents:
    """Starts agents for enrolled nodes; kills them and every workload they started afterwards."""

    def __init__(self, tmp_path: Path, portal: Portal):
        self.tmp_path = tmp_path
        self.portal = portal
        self.procs: dict[str, subprocess.Popen] = {}
        self.ports: dict[str, int] = {}
        self.tokens: dict[str, str] = {}
        self.options: dict[str, list[str]] = {}  # more command-line options per node (--homes-root)

    def state_dir(self, name: str) -> Path:
        return self.tmp_path / "agents" / name

    def enroll_and_start(self, name: str) -> Node:
        port = free_port()
        enrolment = node_enroll(name=name, address=f"http://127.0.0.1:{port}")
        self.ports[name], self.tokens[name] = port, enrolment.token
        token_file = self.tmp_path / f"{name}.token"
        token_file.write_text(enrolment.token + "\n")
        token_file.chmod(0o600)
        self.start(name)
        return enrolment.node

    def start(self, name: str) -> None:
        command = [sys.executable, "-m", "agents", "--listen", f"127.0.0.1:{self.ports[name]}",
                   "--token-file", str(self.tmp_path / f"{name}.token"), "--portal", self.portal.url,
                   "--runtime", "process", "--state-dir", str(self.state_dir(name)),
                   "--fleet", str(FLEETS / f"{name}.yaml"), "--heartbeat-seconds", "1",
                   *self.options.get(name, [])]  # fmt: skip
        log = open(self.tmp_path / f"agent-{name}-{time.monotonic_ns()}.log", "wb")  # noqa: SIM115
        self.procs[name] = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        wait_for(lambda: self._up(name), 20, 0.1, f"agent {name}")

    def _up(self, name: str) -> bool:
        if self.procs[name].poll() is not None:
            raise AssertionError(f"agent {name} exited")
        try:
            with self.client(name) as client:
                return client.get("/v1/health").status_code == 200
        except httpx.HTTPError:
            return False

    def client(self, name: str) -> httpx.Client:
        return httpx.Client(
            base_url=f"http://127.0.0.1:{self.ports[name]}",
            headers={"Authorization": f"Bearer {self.tokens[name]}"},
            timeout=10,
        )

    def workloads(self, name: str) -> list[dict]:
        with self.client(name) as client:
            return client.get("/v1/workloads").json()["workloads"]

    def kill(self, name: str) -> None:
        self.procs[name].send_signal(signal.SIGKILL)
        self.procs[name].wait(10)

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
        for name in self.procs:  # workloads outlive their agent by design: end ours
            for pid in processes_mentioning(str(self.state_dir(name))):
                for child in process_tree(pid):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(child, signal.SIGKILL)


@pytest.fixture
def agents(portal, tmp_path):
    started = Agents(tmp_path, portal)
    yield started
    started.close()


@pytest.fixture
def fleet(agents):
    """node-a and node-b enrolled, their agents running and their GPUs reported."""
    nodes = {name: agents.enroll_and_start(name) for name in ("node-a", "node-b")}
    wait_for(lambda: Device.objects.filter(node=nodes["node-a"]).count() == 6, 20, 0.2, "node-a's GPUs")
    wait_for(lambda: Device.objects.filter(node=nodes["node-b"]).count() == 2 + 7, 20, 0.2, "node-b's GPUs")
    return nodes


def api_for(portal: Portal, user) -> httpx.Client:
    _token, raw = access_token_create(user=user, name="e2e", scopes=["read", "sessions"])
    return httpx.Client(base_url=portal.url, headers={"Authorization": f"Bearer {raw}"}, timeout=30)


def wait_state(api: httpx.Client, session_id: str, states: tuple[str, ...], timeout: float = 60) -> dict:
    def reached():
        body = api.get(f"/api/v1/sessions/{session_id}").json()
        return body if body["state"] in states else None

    try:
        return wait_for(reached, timeout, 0.3, f"{session_id} to reach {states}")
    except AssertionError:
        events = api.get(f"/api/v1/sessions/{session_id}/events").json()
        raise AssertionError(f"{api.get(f'/api/v1/sessions/{session_id}').json()}\n{events}")


def launch(api: httpx.Client, **fields) -> dict:
    body = {"gpu_model": A100, "profile": "whole", "environment": ENV, "max_hours": 1, **fields}
    response = api.post("/api/v1/sessions", json=body)
    assert response.status_code == 201, response.text
    return response.json()


def test_launch_reach_jupyter_through_the_portal_and_stop(portal, agents, fleet):
    user = make_user()
    api = api_for(portal, user)
    on_a = launch(api)
    on_b = launch(api, gpu_model="H200", profile="1g.18gb")
    assert (on_a["node"], on_b["node"]) == ("node-a", "node-b")
    running = wait_state(api, on_a["id"], ("running", "failed"))
    assert running["state"] == "running", running
    assert running["jupyter_url"] == f"/jupyter/{on_a['id']}/lab/tree/Welcome.ipynb"
    assert wait_state(api, on_b["id"], ("running", "failed"))["state"] == "running"

    browser = Client()
    browser.force_login(user)
    cookies = {"sessionid": browser.cookies["sessionid"].value}
    with httpx.Client(base_url=portal.url, cookies=cookies, timeout=30) as web:
        status = web.get(f"/jupyter/{on_a['id']}/api/status")
        assert status.status_code == 200, status.text
        assert "started" in status.json()
        lab = web.get(running["jupyter_url"])
        assert lab.status_code == 200 and "jupyter-config-data" in lab.text
    stranger = Client()
    stranger.force_login(make_user())
    with httpx.Client(base_url=portal.url, cookies={"sessionid": stranger.cookies["sessionid"].value}) as web:
        assert web.get(f"/jupyter/{on_a['id']}/api/status").status_code == 404

    stopped = api.post(f"/api/v1/sessions/{on_a['id']}/stop")
    assert stopped.status_code == 200 and stopped.json()["state"] in ("stopping", "stopped")
    assert wait_state(api, on_a["id"], ("stopped",), 30)["jupyter_url"] is None
    wait_for(lambda: agents.workloads("node-a") == [], 20, 0.3, "node-a's workload gone")
    wait_for(lambda: not Allocation.objects.filter(session_id=on_a["id"]).exists(), 10, 0.2, "slots freed")
    assert Meter.objects.get(session_ref=on_a["id"]).state == "closed"
    assert [w["session_id"] for w in agents.workloads("node-b")] == [on_b["id"]]


def test_a_killed_agent_loses_its_sessions_and_cleans_orphans_when_it_returns(
    portal, agents, fleet, settings
):
    settings.NODE_LIVENESS_SECONDS = 4
    api = api_for(portal, make_user())
    doomed = launch(api)
    survivor = launch(api, gpu_model="H200")
    for session in (doomed, survivor):
        assert wait_state(api, session["id"], ("running", "failed"))["state"] == "running"
    assert [w["state"] for w in agents.workloads("node-a")] == ["running"]

    agents.kill("node-a")
    window = timedelta(seconds=settings.NODE_LIVENESS_SECONDS)

    def swept_down() -> Node | None:
        """node-a, swept down once it has been silent for the liveness window by the database clock and
        node-b has beaten since node-a's last word. The sweeps run on the clock of that last word: at
        the end of the window node-a is not down yet, just past it it is, and node-b, heard from later,
        is not down however late its heartbeats come on a busy machine."""
        with transaction.atomic():
            # locked as a heartbeat locks it: one node-a sent before it died lands before this reads its
            # last word or after the sweep, never between
            last_heard = Node.objects.select_for_update().get(name="node-a").last_heartbeat_at
            node_b_heard = Node.objects.get(name="node-b").last_heartbeat_at
            if db_now() - last_heard <= window or node_b_heard <= last_heard:
                return None
            assert nodes_liveness_sweep(now=last_heard + window) == []
            assert nodes_liveness_sweep(now=last_heard + window + timedelta(microseconds=1)) == ["node-a"]
            return Node.objects.get(name="node-a")

    node_a = wait_for(swept_down, 30, 0.25, "node-a silent for the liveness window")
    assert node_a.state == "down"
    session = Session.objects.get(id=doomed["id"])
    assert session.state == "lost"
    assert "stopped answering" in session.reason
    meter = Meter.objects.get(session_ref=doomed["id"])
    assert meter.state == "closed"
    # The last word from the node: its last heartbeat, or the poll that saw the session running when the
    # agent died before its next heartbeat.
    last_heard = max(node_a.last_heartbeat_at, session.running_at)
    assert meter.billed_until <= session.last_alive_at <= last_heard
    billed = meter.billed_seconds
    metering_tick()  # on the database clock, more than the window past its last alive time
    assert Meter.objects.get(id=meter.id).billed_seconds == billed  # billed no further
    assert Allocation.objects.filter(session_id=doomed["id"]).exists()  # until the agent confirms it gone
    assert Session.objects.get(id=survivor["id"]).state == "running"  # node-b kept beating

    agents.start("node-a")  # same state dir: it adopts the workload, the portal does not want it
    wait_for(lambda: agents.workloads("node-a") == [], 30, 0.3, "the orphan cleaned on node-a")
    wait_for(
        lambda: not Allocation.objects.filter(session_id=doomed["id"]).exists(),
        15,
        0.3,
        "the lost slots freed",
    )
    assert Node.objects.get(name="node-a").state == "active"
    assert Session.objects.get(id=doomed["id"]).state == "lost"
    assert [w["session_id"] for w in agents.workloads("node-b")] == [survivor["id"]]


IDLE_SECONDS = 4


def test_a_kernel_busy_on_the_cpu_is_never_idle_stopped_and_an_untouched_session_is(portal, agents, tmp_path):
    """Two CPU sessions on node-a with a 4 s idle stop: one kernel loops on the CPU (no browser
    connected), the other session is left alone. Celery beat runs the limits sweep every half second on
    the worker. Over four idle periods the untouched one is stopped for idleness and the busy one never
    is."""
    node = agents.enroll_and_start("node-a")
    wait_for(lambda: Device.objects.filter(node=node).exists(), 20, 0.2, "node-a's GPUs")
    api = api_for(portal, make_user())
    busy, untouched = (launch(api, gpu_model="", profile="cpu") for _ in range(2))
    for session in (busy, untouched):
        assert wait_state(api, session["id"], ("running", "failed"))["state"] == "running"

    node_token = {"Authorization": f"Bearer {agents.tokens['node-a']}"}
    agent_url, base_url = f"http://127.0.0.1:{agents.ports['node-a']}", f"/jupyter/{busy['id']}/"
    kernel_id = start_kernel(agent_url, base_url, node_token)
    with kernel_channels(agent_url, base_url, kernel_id, node_token) as ws:
        ws.send(json.dumps(execute_request("while True: pass")[1]))
        time.sleep(1)  # the kernel is running the loop when the browser leaves
    Session.objects.filter(id__in=[busy["id"], untouched["id"]]).update(
        idle_seconds=IDLE_SECONDS, last_active_at=timezone.now()
    )

    beat = start_celery("beat", tmp_path, env=subprocess_env(SESSION_LIMITS_SWEEP_SECONDS="0.5"))
    stopped_at = None
    ends = time.monotonic() + 4 * IDLE_SECONDS
    while time.monotonic() < ends:
        if stopped_at is None and Session.objects.get(id=untouched["id"]).state != "running":
            stopped_at = time.monotonic()
        assert Session.objects.get(id=busy["id"]).state == "running"
        time.sleep(0.25)
    beat.stop()
    assert stopped_at is not None, "the untouched session was never stopped"
    assert "idle" in wait_state(api, untouched["id"], ("stopped",), 30)["reason"]
    kept = Session.objects.get(id=busy["id"])
    assert kept.state == "running" and kept.cpu_seconds > 0
    assert (timezone.now() - kept.last_active_at).total_seconds() < IDLE_SECONDS


def test_a_2x_session_runs_on_two_gpus_of_one_group_and_frees_both(portal, agents, fleet):
    """Launched through the API onto node-a's NVLink group of four A100s: the agent runs it with both
    GPUs visible, the API lists both, and stopping frees every slot of both."""
    api = api_for(portal, make_user())
    launched = launch(api, profile="2x")
    assert launched["node"] == "node-a"
    running = wait_state(api, launched["id"], ("running", "failed"))
    assert running["state"] == "running", running
    uuids = sorted(d["uuid"] for d in running["limits"]["devices"])
    assert len(uuids) == 2
    assert Device.objects.filter(uuid__in=uuids).values("topology_group").distinct().count() == 1
    (workload,) = agents.workloads("node-a")
    assert sorted(workload["gpu_plan"]["env"]["CUDA_VISIBLE_DEVICES"].split(",")) == uuids
    api.post(f"/api/v1/sessions/{launched['id']}/stop")
    wait_state(api, launched["id"], ("stopped",), 30)
    wait_for(
        lambda: not AllocationSlot.objects.filter(device__uuid__in=uuids).exists(), 10, 0.2, "slots freed"
    )
