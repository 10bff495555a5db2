"""The agent API refuses bad input with a JSON error naming the field, and starts nothing."""

from __future__ import annotations

import httpx
import pytest

from tests.agents.conftest import processes_mentioning, workload_spec

pytestmark = pytest.mark.slow


@pytest.fixture
def agent(start_agent, tmp_path):
    return start_agent(tmp_path / "state", "--sandbox", "none", "--vgpu-lib", str(tmp_path / "no-libvgpu.so"))


def _alloc(
    uuid: str, profile: str = "1/4", start: int = 0, count: int = 2, policy: str = "best-effort"
) -> dict:
    return {
        "device_uuid": uuid,
        "profile": profile,
        "slot_start": start,
        "slot_count": count,
        "sharing_policy": policy,
    }


def _refused(agent, spec: dict, status: int, field: str) -> dict:
    answer = agent.put_workload(spec)
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert field in error["fields"], error
    assert error["code"] and error["message"]
    return error


def test_every_call_needs_the_node_token(agent):
    for headers in ({}, {"Authorization": "Bearer wrong-token"}, {"Authorization": "token node"}):
        for method, path in (("GET", "/v1/health"), ("GET", "/v1/workloads"), ("PUT", "/v1/workloads/x")):
            answer = httpx.request(method, agent.url + path, headers=headers, json={})
            assert answer.status_code == 401
            assert answer.json()["error"]["code"] == "unauthorised"


def test_health_inventory_and_metrics(agent):
    health = agent.get("/v1/health").json()
    expected = {"status": "ok", "runtime": "process", "nvml": "fake", "gpus": 2, "workloads": 0}
    assert {k: health[k] for k in expected} == expected and health["agent_version"]
    inventory = agent.inventory()
    assert [g["mig_mode"] for g in inventory["gpus"]] == [False, True]
    metrics = agent.get("/v1/metrics").json()
    assert metrics["gpus"][0]["gpu_util_percent"] == 37 and metrics["gpus"][1]["gpu_util_percent"] is None
    assert agent.get("/v1/nowhere").status_code == 404


def test_bad_allocations_are_refused_naming_the_field(agent, tmp_path):
    gpus = agent.inventory()["gpus"]
    whole, mig_gpu = gpus[0]["uuid"], gpus[1]
    small_mig = next(m["uuid"] for m in mig_gpu["mig_devices"] if m["profile"] == "1g.10gb")
    cases = [
        (_alloc("GPU-00000000-0000-0000-0000-000000000000"), "allocation.device_uuid"),
        (_alloc(whole, "1/2", 6, 4), "allocation.slot_start"),  # 6..10 lies outside the GPU
        (_alloc(whole, "1/4", 1, 2), "allocation.slot_start"),  # unaligned
        (_alloc(whole, "1/4", 0, 4), "allocation.slot_count"),
        (_alloc(small_mig, "3g.40gb", 0, 8, "exclusive"), "allocation.profile"),  # larger than the device
        (_alloc(whole, "1g.10gb", 0, 8, "exclusive"), "allocation.profile"),  # MIG profile, non-MIG GPU
        (_alloc(small_mig, "1/8", 0, 1), "allocation.profile"),  # slice on a MIG device
        (_alloc(mig_gpu["uuid"], "1/8", 0, 1), "allocation.profile"),  # slice on a MIG-mode GPU
        (_alloc(whole, "1/4", 0, 2, "fixed-share"), "allocation.sharing_policy"),  # no libvgpu.so
        (_alloc(whole, "1/4", 0, 2, "equal-share"), "allocation.sharing_policy"),  # no MPS
        (_alloc(whole, "whole", 0, 8, "best-effort"), "allocation.sharing_policy"),
        (_alloc(whole, "3/4", 0, 6), "allocation.profile"),
    ]
    for allocation, field in cases:
        error = _refused(agent, workload_spec("bad-1", allocation), 422, field)
        assert error["code"] == "invalid_allocation"
        if "libvgpu" in str(error):
            assert "no-libvgpu.so" in error["fields"][field]
    assert agent.get("/v1/workloads").json() == {"workloads": []}
    assert not processes_mentioning(str(tmp_path / "state")) - {agent.proc.pid}


def test_malformed_bodies_are_refused_naming_the_field(agent, tmp_path):
    uuid = agent.inventory()["gpus"][0]["uuid"]
    good = workload_spec("body-1", _alloc(uuid))
    cases = [
        ({**good, "session_id": "no spaces"}, "session_id"),
        ({**good, "session_id": "other"}, "session_id"),  # differs from the URL
        ({k: v for k, v in good.items() if k != "token"}, "token"),
        ({**good, "user": "../root"}, "user"),
        ({**good, "base_url": "/jupyter/x"}, "base_url"),
        ({**good, "limits": {"cpu_cores": "2", "memory_mib": 4096}}, "limits.cpu_cores"),
        ({**good, "limits": {"cpu_cores": 1}}, "limits.memory_mib"),
        ({**good, "allocation": {**good["allocation"], "slot_start": True}}, "allocation.slot_start"),
        ({**good, "allocation": {**good["allocation"], "colour": "red"}}, "allocation.colour"),
        (
            {**good, "environment": {"name": "x", "python": "relative/python", "image": None}},
            "environment.python",
        ),
        ({**good, "surprise": 1}, "surprise"),
    ]
    for body, field in cases:
        answer = agent.client.put("/v1/workloads/body-1", json=body)
        assert answer.status_code == 400, (field, answer.text)
        assert field in answer.json()["error"]["fields"], (field, answer.json())
    not_json = agent.client.put("/v1/workloads/body-1", content=b"{not json")
    assert not_json.status_code == 400 and not_json.json()["error"]["code"] == "malformed_json"
    listed = agent.client.put("/v1/workloads/body-1", json=[1, 2])
    assert listed.status_code == 400
    assert agent.get("/v1/workloads").json() == {"workloads": []}
    assert not processes_mentioning(str(tmp_path / "state")) - {agent.proc.pid}


def test_a_start_the_runtime_refuses_is_a_422_naming_why_and_is_listed_failed(agent, tmp_path):
    not_python = tmp_path / "not-a-python"
    not_python.write_text("")  # there, but not an executable
    environment = {"name": "broken", "python": str(not_python), "image": None}
    spec = workload_spec("env-1", None, environment=environment)
    answer = agent.put_workload(spec)
    assert answer.status_code == 422, answer.text
    error = answer.json()["error"]
    assert error["code"] == "environment_unavailable" and str(not_python) in error["message"]
    listed = agent.workload("env-1")
    assert listed["state"] == "failed" and "is not an executable" in listed["exit_reason"]
    assert not processes_mentioning(str(tmp_path / "state")) - {agent.proc.pid}
    # the same PUT again is the same failed workload, not a second try (the portal deletes it)
    again = agent.put_workload(spec)
    assert again.status_code == 200 and again.json()["state"] == "failed"


def test_conflicts_and_one_policy_per_gpu(agent):
    uuid = agent.inventory()["gpus"][0]["uuid"]
    first = workload_spec("share-1", _alloc(uuid, "1/4", 0, 2, "best-effort"))
    assert agent.put_workload(first).status_code == 201
    assert agent.put_workload({**first, "token": "another-token-123"}).status_code == 409
    mixed = workload_spec("share-2", _alloc(uuid, "1/4", 2, 2, "equal-share"))
    error = _refused(agent, mixed, 409, "allocation.sharing_policy")
    assert "best-effort" in error["fields"]["allocation.sharing_policy"]
    overlap = workload_spec("share-3", _alloc(uuid, "1/2", 0, 4, "best-effort"))
    _refused(agent, overlap, 409, "allocation.slot_start")
    assert [w["session_id"] for w in agent.get("/v1/workloads").json()["workloads"]] == ["share-1"]
    assert agent.client.delete("/v1/workloads/share-1").json() == {"deleted": True}


def test_equal_share_starts_one_mps_daemon_per_gpu_and_quits_it_after_the_last(start_agent, tmp_path):
    # A stand-in for NVIDIA's binary (no GPU here): it records how the agent drives it.
    calls = tmp_path / "mps-calls.log"
    control = tmp_path / "nvidia-cuda-mps-control"
    control.write_text(
        "#!/bin/sh\n"
        f'if [ "$1" = "-d" ]; then echo "start $CUDA_VISIBLE_DEVICES $CUDA_MPS_PIPE_DIRECTORY" >> {calls};\n'
        f'else read line; echo "$line $CUDA_VISIBLE_DEVICES" >> {calls}; fi\n'
    )
    control.chmod(0o755)
    agent = start_agent(tmp_path / "state", "--sandbox", "none", "--mps-control", str(control))
    uuid = agent.inventory()["gpus"][0]["uuid"]
    first = workload_spec("mps-1", _alloc(uuid, "1/2", 0, 4, "equal-share"))
    second = workload_spec("mps-2", _alloc(uuid, "1/4", 4, 2, "equal-share"), user="bob")
    created = agent.put_workload(first)
    assert created.status_code == 201, created.text
    plan = created.json()["gpu_plan"]
    assert plan["env"]["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
    assert plan["env"]["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=40960M"
    assert agent.put_workload(second).status_code == 201
    pipe = str(tmp_path / "state" / "mps" / uuid / "pipe")
    assert calls.read_text().splitlines() == [f"start {uuid} {pipe}"]
    assert agent.client.delete("/v1/workloads/mps-1").json() == {"deleted": True}
    assert calls.read_text().splitlines() == [f"start {uuid} {pipe}"]
    assert agent.client.delete("/v1/workloads/mps-2").json() == {"deleted": True}
    assert calls.read_text().splitlines() == [f"start {uuid} {pipe}", f"quit {uuid}"]
