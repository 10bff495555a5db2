"""Helpers to run the agent as a real subprocess and talk to it and to its Jupyter workloads."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.stack import free_port, wait_for  # noqa: F401 - the agent tests import them from here

REPO = Path(__file__).resolve().parents[2]
CI_FLEET = REPO / "agents" / "fleets" / "ci-small.yaml"
NODE_TOKEN = "node-token-0123456789abcdef"


def alive(pid: int) -> bool:
    """Running (not gone, not a zombie)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except OSError:
        return False


def process_stop(process: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL after 10 s: a test's server or agent, gone when this returns."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def process_tree(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(name))
    found, stack = {root}, [root]
    while stack:
        for child in children.get(stack.pop(), ()):
            found.add(child)
            stack.append(child)
    return {pid for pid in found if alive(pid)}


def processes_mentioning(text: str) -> set[int]:
    found = set()
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != os.getpid():
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    if text.encode() in f.read() and alive(int(name)):
                        found.add(int(name))
            except OSError:
                continue
    return found


@dataclass
class Agent:
    proc: subprocess.Popen
    url: str
    state_dir: Path
    log_path: Path
    client: httpx.Client = field(repr=False)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def get(self, path: str) -> httpx.Response:
        return self.client.get(path)

    def put_workload(self, spec: dict) -> httpx.Response:
        return self.client.put(f"/v1/workloads/{spec['session_id']}", json=spec)

    def workload(self, session_id: str) -> dict:
        return self.client.get(f"/v1/workloads/{session_id}").json()

    def wait_state(self, session_id: str, states: tuple[str, ...], timeout: float = 60.0) -> dict:
        def reached():
            status = self.workload(session_id)
            return status if status.get("state") in states else None

        try:
            return wait_for(reached, timeout, 0.25, f"{session_id} to reach {states}")
        except AssertionError:
            raise AssertionError(f"{self.workload(session_id)}\n--- agent log ---\n{self.log()[-3000:]}")

    def inventory(self) -> dict:
        return self.get("/v1/inventory").json()

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.client.close()


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "node-token"
    path.write_text(NODE_TOKEN + "\n")
    return path


@pytest.fixture
def start_agent(tmp_path: Path, token_file: Path):
    """start_agent(state_dir, *extra_args) -> Agent; stops agents and their workloads afterwards."""
    started: list[Agent] = []
    state_dirs: set[Path] = set()

    def start(state_dir: Path | None = None, *extra: str, port: int | None = None) -> Agent:
        state_dir = state_dir or tmp_path / "state"
        state_dirs.add(state_dir)
        port = port or free_port()
        log_path = tmp_path / f"agent-{len(started)}.log"
        command = [
            sys.executable, "-m", "agents",
            "--listen", f"127.0.0.1:{port}",
            "--token-file", str(token_file),
            "--state-dir", str(state_dir),
            "--fleet", str(CI_FLEET),
            "--runtime", "process",
            *extra,
        ]  # fmt: skip
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        client = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {NODE_TOKEN}"}, timeout=30)
        agent = Agent(proc, url, state_dir, log_path, client)
        started.append(agent)

        def healthy():
            if proc.poll() is not None:
                raise AssertionError(f"agent exited: {log_path.read_text()}")
            try:
                return client.get("/v1/health").status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(healthy, 20, 0.1, "agent health")
        return agent

    yield start
    for agent in started:
        agent.terminate()
    for state_dir in state_dirs:  # workloads outlive agents by design: end ours
        for pid in processes_mentioning(str(state_dir)):
            for child in process_tree(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child, signal.SIGKILL)


def workload_spec(session_id: str, allocation: dict | None, **overrides) -> dict:
    spec = {
        "session_id": session_id,
        "user": "alice",
        "token": f"jupyter-{uuid.uuid4().hex}",
        "base_url": f"/jupyter/{session_id}/",
        "environment": {"name": "python-3.11", "python": None, "image": None},
        "allocation": allocation,
        "limits": {"cpu_cores": 1.0, "memory_mib": 4096},
    }
    spec.update(overrides)
    return spec


def start_kernel(upstream: str, base_url: str, headers: dict) -> str:
    """A new kernel over Jupyter's REST API; its id."""
    with httpx.Client(base_url=f"{upstream}{base_url}", headers=headers, timeout=30) as jupyter:
        assert jupyter.get("api/status").status_code == 200
        kernel = jupyter.post("api/kernels", json={"name": "python3"})
        assert kernel.status_code == 201, kernel.text
        return kernel.json()["id"]


def kernel_channels(upstream: str, base_url: str, kernel_id: str, headers: dict):
    """The kernel's WebSocket (a context manager): a browser connected to it."""
    from websockets.sync.client import connect

    ws_url = f"{upstream.replace('http://', 'ws://')}{base_url}api/kernels/{kernel_id}/channels"
    ws_url = ws_url.replace("https://", "wss://")
    return connect(ws_url, additional_headers=headers, open_timeout=30, origin=upstream)


def execute_request(code: str) -> tuple[str, dict]:
    """An ``execute_request`` message for ``code``, and its msg_id."""
    msg_id = uuid.uuid4().hex
    message = {
        "header": {
            "msg_id": msg_id,
            "username": "test",
            "session": uuid.uuid4().hex,
            "msg_type": "execute_request",
            "version": "5.3",
            "date": "2026-01-01T00:00:00Z",
        },
        "parent_header": {},
        "metadata": {},
        "content": {"code": code, "silent": False, "store_history": False, "user_expressions": {},
                    "allow_stdin": False, "stop_on_error": True},
        "channel": "shell",
        "buffers": [],
    }  # fmt: skip
    return msg_id, message


def run_in_kernel(
    upstream: str, base_url: str, code: str, *, headers: dict | None = None, timeout: float = 60.0
) -> str:
    """Start a kernel over Jupyter's REST API, run code over its WebSocket, return its stdout.
    ``upstream`` is the agent (its gateway adds the Jupyter token; ``headers`` default to the node
    token) or the portal (``headers`` carry the browser's cookie)."""
    headers = {"Authorization": f"Bearer {NODE_TOKEN}"} if headers is None else headers
    kernel_id = start_kernel(upstream, base_url, headers)
    msg_id, message = execute_request(code)
    output: list[str] = []
    deadline = time.monotonic() + timeout
    with kernel_channels(upstream, base_url, kernel_id, headers) as ws:
        ws.send(json.dumps(message))
        while time.monotonic() < deadline:
            reply = json.loads(ws.recv(timeout=max(0.1, deadline - time.monotonic())))
            if reply.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            kind = reply["msg_type"]
            if kind == "stream":
                output.append(reply["content"]["text"])
            elif kind == "error":
                raise AssertionError("kernel error: " + "\n".join(reply["content"]["traceback"]))
            elif kind == "status" and reply["content"]["execution_state"] == "idle" and output:
                break
    return "".join(output)
