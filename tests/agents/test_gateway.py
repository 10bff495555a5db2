"""The agent as its node's gateway: ``/jupyter/<session>/…`` reaches the workload's JupyterLab on its
Unix socket, for the node token only, and only for a session this agent runs."""

from __future__ import annotations

import httpx
import pytest

from tests.agents.conftest import NODE_TOKEN, run_in_kernel, workload_spec

pytestmark = pytest.mark.slow


def test_the_gateway_serves_its_sessions_only_to_the_node_token(start_agent):
    agent = start_agent()
    spec = workload_spec("gw-1", None)
    assert agent.put_workload(spec).status_code == 201
    running = agent.wait_state("gw-1", ("running",))
    assert running["upstream"].startswith("unix:")  # no TCP port for anyone to dial
    base = f"{agent.url}/jupyter/gw-1/"

    assert httpx.get(f"{base}api/status").status_code == 401
    assert httpx.get(f"{base}api/status", headers={"Authorization": "Bearer wrong"}).status_code == 401
    # The Jupyter token is the agent's to add; a client holding it still gets nothing.
    assert (
        httpx.get(f"{base}api/status", headers={"Authorization": f"token {spec['token']}"}).status_code == 401
    )
    stranger = httpx.get(f"{agent.url}/jupyter/gw-other/api/status", headers=agent.client.headers)
    assert stranger.status_code == 404 and stranger.json()["error"]["code"] == "not_found"

    lab = agent.client.get("/jupyter/gw-1/lab")
    assert lab.status_code == 200 and "JupyterLab" in lab.text
    assert spec["token"] not in lab.text  # scrubbed: the token never leaves the node
    # The environment is read-only: no rebuild offered, no build check on each page load.
    assert '"buildCheck": false' in lab.text and '"buildAvailable": false' in lab.text
    assert run_in_kernel(agent.url, spec["base_url"], "print(6 * 7)").strip().endswith("42")

    assert agent.client.delete("/v1/workloads/gw-1").json() == {"deleted": True}
    gone = httpx.get(f"{base}api/status", headers={"Authorization": f"Bearer {NODE_TOKEN}"})
    assert gone.status_code == 404


def test_a_running_session_has_its_welcome_notebook_and_kernel_up_before_anyone_opens_it(start_agent):
    agent = start_agent()
    assert agent.put_workload(workload_spec("gw-2", None)).status_code == 201
    agent.wait_state("gw-2", ("running",))
    # Running means the welcome kernel is in already: Jupyter answers 500 to api/status and api/kernels
    # while a kernel starts (its last_activity unset), so nobody is sent there before.
    for path in ("api/status", "api/kernels", "api/sessions"):
        assert agent.client.get(f"/jupyter/gw-2/{path}").status_code == 200, path
    sessions = agent.client.get("/jupyter/gw-2/api/sessions").json()
    (session,) = [s for s in sessions if s["path"] == "Welcome.ipynb"]
    kernel = session["kernel"]
    assert kernel["name"] == "python3" and kernel["connections"] == 0  # started before anyone opened it
    assert kernel["id"] in [k["id"] for k in agent.client.get("/jupyter/gw-2/api/kernels").json()]
    notebook = agent.client.get("/jupyter/gw-2/api/contents/Welcome.ipynb").json()
    assert notebook["type"] == "notebook" and "GPU" in notebook["content"]["cells"][0]["source"]
    assert (agent.state_dir / "homes" / "alice" / "Welcome.ipynb").stat().st_uid != 0  # the tenant's file
