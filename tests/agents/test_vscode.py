"""VS Code in the browser: a real code-server workload started by the agent, in the bubblewrap sandbox,
reached through the agent's gateway (HTTP and WebSocket). Skipped where agents/editors/install.sh has
not installed code-server."""

from __future__ import annotations

import json
import os
import shutil
import uuid

import httpx
import pytest

from agents.gpuplan import GpuPlan
from agents.runtimes import RuntimeOptions, RuntimeStartError, runtime_class
from agents.runtimes.base import CODE_SERVER_DIR, code_server_installed, code_server_node
from agents.spec import SpecError, parse_spec
from tests.agents.conftest import NODE_TOKEN, alive, process_tree, wait_for, workload_spec

NO_CODE_SERVER = f"code-server is not installed at {CODE_SERVER_DIR} (run agents/editors/install.sh)"
VSCODE = {"name": "vscode", "python": None, "image": None, "interface": "vscode"}


def test_the_interface_is_optional_and_a_jupyterlab_spec_keeps_its_fingerprint():
    plain = workload_spec("s-1", None)
    parsed = parse_spec(plain)
    assert parsed.environment.interface == "jupyterlab"
    assert parsed.to_json() == plain  # what agents before the interface recorded, fingerprint included
    explicit = parse_spec(plain | {"environment": plain["environment"] | {"interface": "jupyterlab"}})
    assert explicit.fingerprint() == parsed.fingerprint()
    vscode = parse_spec(workload_spec("s-1", None, token=plain["token"], environment=VSCODE))
    assert vscode.environment.interface == "vscode"
    assert vscode.to_json()["environment"]["interface"] == "vscode"
    assert vscode.fingerprint() != parsed.fingerprint()


def test_an_unknown_interface_is_refused():
    with pytest.raises(SpecError) as refused:
        parse_spec(workload_spec("s-1", None, environment=VSCODE | {"interface": "emacs"}))
    assert refused.value.fields == {"environment.interface": "must be one of jupyterlab, vscode"}


def test_a_node_without_code_server_refuses_a_vscode_workload_and_makes_nothing(tmp_path):
    options = RuntimeOptions(state_dir=tmp_path / "state", sandbox="none", code_server=tmp_path / "absent")
    assert options.interfaces == ("jupyterlab",)
    runtime = runtime_class("process")(options)
    with pytest.raises(RuntimeStartError) as refused:
        runtime.start(
            parse_spec(workload_spec("s-1", None, environment=VSCODE)), GpuPlan(None, None, None, None)
        )
    assert refused.value.code == "environment_unavailable"
    assert "agents/editors/install.sh" in str(refused.value)
    assert not (tmp_path / "state" / "run" / "s-1").exists()


def test_the_docker_runtime_refuses_a_vscode_workload(tmp_path):
    runtime = runtime_class("docker")(RuntimeOptions(state_dir=tmp_path))
    with pytest.raises(RuntimeStartError) as refused:
        runtime.start(
            parse_spec(workload_spec("s-1", None, environment=VSCODE)), GpuPlan(None, None, None, None)
        )
    assert refused.value.code == "environment_unavailable"


def _uid(pid: int) -> int:
    return os.stat(f"/proc/{pid}").st_uid


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            return cmdline.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


@pytest.mark.slow
@pytest.mark.skipif(not code_server_installed(CODE_SERVER_DIR), reason=NO_CODE_SERVER)
@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")
def test_code_server_runs_sandboxed_and_answers_through_the_gateway(start_agent, tmp_path):
    agent = start_agent(tmp_path / "state", "--sandbox", "bwrap")
    spec = workload_spec("vscode-1", None, environment=VSCODE)
    created = agent.put_workload(spec)
    assert created.status_code == 201, created.text
    status = agent.wait_state("vscode-1", ("running", "failed"), timeout=120)
    assert status["state"] == "running", status
    base = spec["base_url"]

    with httpx.Client(base_url=agent.url, headers={"Authorization": f"Bearer {NODE_TOKEN}"}) as client:
        # code-server's own links are relative: the gateway strips the base URL, the redirect stays under it
        root = client.get(base)
        assert root.status_code == 302, root.text
        assert root.headers["location"] == "./?folder=/home/alice"
        page = client.get(f"{base}?folder=/home/alice")
        assert page.status_code == 200, page.text
        assert "vscode-workbench-web-configuration" in page.text
        assert client.get(f"{base}healthz").json()["status"] == "alive"
        # a path outside the session's base URL never reaches it
        assert client.get("/jupyter/vscode-2/healthz").status_code == 404

    # The workbench's remote connection: a WebSocket upgrade through the gateway, answered by code-server.
    from websockets.sync.client import connect

    ws_url = agent.url.replace("http://", "ws://") + (
        f"{base}?reconnectionToken={uuid.uuid4()}&reconnection=false&skipWebSocketFrames=false"
    )
    with connect(ws_url, additional_headers={"Authorization": f"Bearer {NODE_TOKEN}"}, open_timeout=30) as ws:
        assert ws.protocol.state.name == "OPEN"

    # code-server and everything it started run as the user's sandbox uid, never as the agent's
    record = json.loads((agent.state_dir / "workloads" / "vscode-1.json").read_text())
    tree = process_tree(record["runtime_state"]["pid"])
    node = code_server_node(CODE_SERVER_DIR)  # the node install.sh put beside it
    servers = [pid for pid in tree if _cmdline(pid).split(" ")[0] == node]  # not bwrap's, which names it too
    assert servers, [_cmdline(pid) for pid in tree]
    assert {_uid(pid) for pid in servers} == {record["runtime_state"]["uid"]}
    assert record["runtime_state"]["uid"] != 0
    assert record["runtime_state"]["interface"] == "vscode"

    assert agent.client.delete("/v1/workloads/vscode-1").json() == {"deleted": True}
    wait_for(lambda: not any(alive(pid) for pid in tree), 15, what="every workload process to end")
