"""The real product as subprocesses for end-to-end tests: the portal under uvicorn (with the Jupyter
proxy), Celery worker and beat, and node agents on fake fleets heartbeating to the portal, all on the
test database. Use inside a ``transactional_db`` test so what the test writes is visible to them."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
FLEETS = ROOT / "agents" / "fleets"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for(predicate, timeout: float = 30.0, interval: float = 0.2, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


@dataclass
class Process:
    name: str
    process: subprocess.Popen
    log: Path
    url: str = ""
    extra: dict = field(default_factory=dict)

    def tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL the whole process group (a crash, not a shutdown)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()

    def stop(self, timeout: float = 15) -> None:
        if self.process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()


def _spawn(name: str, command: list[str], *, env: dict, log_dir: Path) -> Process:
    log = log_dir / f"{name}-{time.monotonic_ns()}.log"
    process = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True
    )
    return Process(name, process, log)


def start_web(log_dir: Path, *, env: dict) -> Process:
    """The portal (Django + the Jupyter proxy) under uvicorn, as ``make run`` serves it."""
    port = free_port()
    command = [
        sys.executable, "-m", "uvicorn", "portal.asgi:application", "--host", "127.0.0.1",
        "--port", str(port), "--no-access-log",
        "--ws", "portal.ws_relay:WebSocketRelay", "--ws-per-message-deflate", "false",
    ]  # fmt: skip
    web = _spawn("web", command, env=env | {"SITE_URL": f"http://127.0.0.1:{port}"}, log_dir=log_dir)
    web.url = f"http://127.0.0.1:{port}"

    def up():
        if not web.alive():
            raise AssertionError(f"the portal exited:\n{web.tail()}")
        try:
            return httpx.get(f"{web.url}/login/", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(up, timeout=60, what="the portal to answer")
    return web


def start_agent(
    log_dir: Path,
    *,
    node: str,
    token: str,
    portal: str,
    fleet: str = "ci-small.yaml",
    port: int | None = None,
) -> Process:
    """A node agent on a fake fleet, heartbeating to ``portal`` with the node's token."""
    state = log_dir / f"agent-{node}"
    state.mkdir(parents=True, exist_ok=True)
    token_file = state / "token"
    token_file.write_text(token)
    token_file.chmod(0o600)
    port = port or free_port()
    command = [
        sys.executable, "-m", "agents", "--listen", f"127.0.0.1:{port}", "--token-file", str(token_file),
        "--portal", portal, "--runtime", "process", "--state-dir", str(state), "--fleet", str(FLEETS / fleet),
    ]  # fmt: skip
    env = dict(os.environ) | {"PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    agent = _spawn(f"agent-{node}", command, env=env, log_dir=log_dir)
    agent.url = f"http://127.0.0.1:{port}"
    agent.extra = {"port": port, "token": token, "node": node}

    def up():
        if not agent.alive():
            raise AssertionError(f"the agent exited:\n{agent.tail()}")
        try:
            return agent_get(agent, "/v1/health").status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(up, timeout=30, what=f"agent {node} to answer")
    return agent


def agent_get(agent: Process, path: str) -> httpx.Response:
    """A call to the agent's own API, with its node token."""
    headers = {"Authorization": f"Bearer {agent.extra['token']}"}
    return httpx.get(f"{agent.url}{path}", headers=headers, timeout=5)


def start_celery(kind: str, log_dir: Path, *, env: dict) -> Process:
    command = [sys.executable, "-m", "celery", "-A", "portal", kind, "--loglevel", "INFO"]
    if kind == "worker":
        command += [
            "--pool", "threads", "--concurrency", "8", "--without-gossip", "--without-mingle",
            "--hostname", f"e2e-{os.getpid()}-{time.monotonic_ns()}@%h",
        ]  # fmt: skip
    else:
        command += ["--schedule", str(log_dir / f"beat-{time.monotonic_ns()}")]
    return _spawn(f"celery-{kind}", command, env=env, log_dir=log_dir)


def delete_workloads(agent: Process) -> None:
    """End every workload on the agent (test teardown: the agent itself leaves them running)."""
    headers = {"Authorization": f"Bearer {agent.extra['token']}"}
    with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, AssertionError):
        listed = agent_get(agent, "/v1/workloads").json()
        for workload in listed.get("workloads", listed) if isinstance(listed, dict) else listed:
            httpx.delete(f"{agent.url}/v1/workloads/{workload['session_id']}", headers=headers, timeout=15)
        wait_for(lambda: agent_get(agent, "/v1/health").json()["workloads"] == 0, 20, 0.5, "workloads gone")
