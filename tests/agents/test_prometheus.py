"""The agent's /metrics: DCGM exporter names and labels per GPU, and one series per running session."""

from __future__ import annotations

import socket

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.agents.conftest import NODE_TOKEN, workload_spec

pytestmark = pytest.mark.slow


def _samples(text: str) -> dict[str, list]:
    return {family.name: family.samples for family in text_string_to_metric_families(text)}


def test_metrics_need_the_node_token_and_speak_dcgm_names_with_per_slice_series(start_agent, tmp_path):
    agent = start_agent(tmp_path / "state", "--sandbox", "none", "--vgpu-lib", str(tmp_path / "absent.so"))
    for headers in ({}, {"Authorization": "Bearer wrong-token"}):
        assert httpx.get(agent.url + "/metrics", headers=headers).status_code == 401
    gpu = agent.inventory()["gpus"][0]
    spec = workload_spec(
        "slice-1",
        {"device_uuid": gpu["uuid"], "profile": "1/8", "slot_start": 7, "slot_count": 1,
         "sharing_policy": "best-effort"},
        user="bob",
    )  # fmt: skip
    assert agent.put_workload(spec).status_code == 201
    agent.wait_state("slice-1", ("running",))

    answer = httpx.get(agent.url + "/metrics", headers={"Authorization": f"Bearer {NODE_TOKEN}"})
    assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/plain")
    samples = _samples(answer.text)
    first = {s.labels["gpu"]: s for s in samples["DCGM_FI_DEV_GPU_UTIL"]}["0"]
    assert first.labels["UUID"] == gpu["uuid"] and first.labels["modelName"] == gpu["name"]
    assert first.labels["Hostname"] == socket.gethostname() and first.labels["device"] == "nvidia0"
    assert first.value == 37 and not first.labels["session"]  # a slice does not own the GPU
    used = {s.labels["gpu"]: s.value for s in samples["DCGM_FI_DEV_FB_USED"]}
    free = {s.labels["gpu"]: s.value for s in samples["DCGM_FI_DEV_FB_FREE"]}
    assert used["0"] >= 2048 and used["0"] + free["0"] == 81920
    assert {s.labels["gpu"]: s.value for s in samples["DCGM_FI_DEV_POWER_USAGE"]} == {"0": 88.5, "1": 70.0}
    assert {s.labels["gpu"]: s.value for s in samples["DCGM_FI_DEV_GPU_TEMP"]} == {"0": 45.0, "1": 41.0}

    (running,) = samples["suanli_session_running"]
    assert running.value == 1
    assert {k: running.labels[k] for k in ("session", "profile", "user", "UUID", "sharing_policy")} == {
        "session": "slice-1", "profile": "1/8", "user": "bob", "UUID": gpu["uuid"],
        "sharing_policy": "best-effort",
    }  # fmt: skip
    (limit,) = samples["suanli_session_fb_limit_mib"]
    assert limit.value == 10240  # an eighth of 80 GiB
    (status,) = agent.get("/v1/workloads").json()["workloads"]
    (session_used,) = samples["suanli_session_fb_used_mib"]
    assert session_used.value == status["gpu_memory_used_mib"] and session_used.value > 0

    assert agent.client.delete("/v1/workloads/slice-1").json() == {"deleted": True}
    after = _samples(agent.get("/metrics").text)
    assert after["suanli_session_running"] == [] and len(after["DCGM_FI_DEV_GPU_TEMP"]) == 2
