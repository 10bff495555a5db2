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
    assert run_in_kernel(agent.url, spec["base_url"], "print(6 * 7)").strip().endswith("42")

    assert agent.client.delete("/v1/workloads/gw-1").json() == {"deleted": True}
    gone = httpx.get(f"{base}api/status", headers={"Authorization": f"Bearer {NODE_TOKEN}"})
    assert gone.status_code == 404
