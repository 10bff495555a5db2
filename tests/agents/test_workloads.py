"""The workload table under concurrent calls: a runtime's start or stop holds no lock that other
calls need, and racing PUTs and DELETEs of one session leave one workload or none, never two.

The runtime here is a real subclass registered by name whose start waits at a gate the test opens;
the GPUs are the CI fleet's, through the fake NVML (the hardware boundary)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from agents.api import AgentApi
from agents.gpuplan import GpuPlan, HostGpuTools, PlanError
from agents.nvml import GpuReader, nvml_source
from agents.runtimes import Runtime, RuntimeHandle, RuntimeOptions, RuntimeStartError, runtime_class
from agents.server import make_server
from agents.spec import SpecError, WorkloadSpec, parse_spec
from agents.workloads import WorkloadConflict, WorkloadRefused, Workloads, WorkloadStopping
from tests.agents.conftest import CI_FLEET, NODE_TOKEN, workload_spec

PROMPT_SECONDS = 5.0  # far more than any table operation takes, far less than a gated start
GATE_SECONDS = 60.0


@dataclass(frozen=True, kw_only=True)
class GatedHandle(RuntimeHandle):
    session_id: str


class GatedRuntime(Runtime):
    """Starts nothing real: ``start`` waits until the test opens that session's gate (open unless
    ``hold`` closed it) and raises what ``refuse`` holds; ``stop`` ends the workload at once."""

    name = "test-gated"
    handle_class = GatedHandle

    def __init__(self, options: RuntimeOptions) -> None:
        super().__init__(options)
        self._lock = threading.Lock()
        self.gates: dict[str, threading.Event] = {}
        self.entered: dict[str, threading.Event] = {}
        self.refuse: dict[str, BaseException] = {}
        self.starts: list[str] = []
        self.running: set[str] = set()

    def hold(self, session_id: str) -> None:
        self.gates[session_id] = threading.Event()
        self.entered[session_id] = threading.Event()

    def start(self, spec: WorkloadSpec, plan: GpuPlan) -> GatedHandle:
        if spec.session_id in self.gates:
            self.entered[spec.session_id].set()
            assert self.gates[spec.session_id].wait(GATE_SECONDS)
        with self._lock:
            self.starts.append(spec.session_id)
            if spec.session_id in self.refuse:
                raise self.refuse[spec.session_id]
            self.running.add(spec.session_id)
        return GatedHandle(base_url=spec.base_url, upstream_url="unix:/nowhere", session_id=spec.session_id)

    def poll(self, handle: GatedHandle) -> str | None:
        return None if handle.session_id in self.running else "stopped"

    def stop(self, handle: GatedHandle) -> None:
        with self._lock:
            self.running.discard(handle.session_id)


@pytest.fixture
def workloads(tmp_path: Path) -> Workloads:
    return Workloads(
        runtime=runtime_class("test-gated")(RuntimeOptions(state_dir=tmp_path)),
        reader=GpuReader(nvml_source("fake", fleet_path=str(CI_FLEET)).open()),
        tools=HostGpuTools(),
        state_dir=tmp_path,
    )


@pytest.fixture
def gpu(workloads: Workloads) -> str:
    return workloads.reader.inventory()["gpus"][0]["uuid"]


def _allocation(gpu: str, slot_start: int) -> dict:
    return {
        "device_uuid": gpu,
        "profile": "1/4",
        "slot_start": slot_start,
        "slot_count": 2,
        "sharing_policy": "best-effort",
    }


def _spec(session_id: str, gpu: str, slot_start: int) -> WorkloadSpec:
    return parse_spec(workload_spec(session_id, _allocation(gpu, slot_start)))


class Call(threading.Thread):
    """One call in a thread of its own: its result or its exception."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        super().__init__(daemon=True)
        self.fn, self.result, self.error = fn, None, None
        self.start()

    def run(self) -> None:
        try:
            self.result = self.fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            self.error = exc

    def outcome(self, timeout: float = GATE_SECONDS) -> Any:
        self.join(timeout)
        assert not self.is_alive(), "the call did not return"
        if self.error is not None:
            raise self.error
        return self.result


def prompt(fn: Callable[[], Any]) -> Any:
    """fn's outcome, which must come within PROMPT_SECONDS."""
    started = time.monotonic()
    call = Call(fn)
    call.join(PROMPT_SECONDS)
    assert not call.is_alive(), f"blocked for over {PROMPT_SECONDS} s"
    assert time.monotonic() - started < PROMPT_SECONDS
    return call.outcome(0)


def _start_held(workloads: Workloads, spec: WorkloadSpec) -> Call:
    """A PUT whose runtime start is under way and held at its gate."""
    workloads.runtime.hold(spec.session_id)
    put = Call(lambda: workloads.put(spec))
    assert workloads.runtime.entered[spec.session_id].wait(GATE_SECONDS)
    return put


def test_a_slow_start_blocks_no_other_call(workloads, gpu):
    slow = _spec("slow-1", gpu, 0)
    put = _start_held(workloads, slow)
    try:
        assert prompt(lambda: workloads.get("slow-1")).state == "starting"
        assert [w.session_id for w in prompt(workloads.all)] == ["slow-1"]
        assert prompt(workloads.statuses)[0]["upstream"] is None  # reserved, not started yet
        assert prompt(workloads.pids_by_session) == {}
        prompt(workloads.refresh)
        created, same = prompt(lambda: workloads.put(slow))  # the same PUT again: the reservation
        assert created is False and same is workloads.get("slow-1")
        with pytest.raises(WorkloadConflict):
            prompt(lambda: workloads.put(_spec("slow-1", gpu, 2)))
        with pytest.raises(PlanError) as overlap:  # the reservation holds its slots
            prompt(lambda: workloads.put(_spec("overlap-1", gpu, 0)))
        assert overlap.value.code == "gpu_busy"
        created, other = prompt(lambda: workloads.put(_spec("quick-1", gpu, 2)))
        assert created and other.handle is not None
        assert prompt(lambda: workloads.delete("quick-1")) is True
    finally:
        workloads.runtime.gates["slow-1"].set()
    created, workload = put.outcome()
    assert created and workload.handle.session_id == "slow-1"
    assert workloads.runtime.starts == ["quick-1", "slow-1"]


def test_racing_puts_of_one_session_start_it_once(workloads, gpu):
    spec = _spec("race-1", gpu, 4)
    first = _start_held(workloads, spec)
    others = [Call(lambda: workloads.put(spec)) for _ in range(8)]
    assert [call.outcome(PROMPT_SECONDS)[0] for call in others] == [False] * 8
    workloads.runtime.gates["race-1"].set()
    assert first.outcome()[0] is True
    assert workloads.runtime.starts == ["race-1"]
    assert [w.state for w in workloads.all()] == ["starting"]


def test_a_delete_during_a_start_waits_for_it_then_stops_what_it_started(workloads, gpu):
    spec = _spec("doomed-1", gpu, 0)
    put = _start_held(workloads, spec)
    delete = Call(lambda: workloads.delete("doomed-1"))
    try:
        time.sleep(0.2)
        assert delete.is_alive()  # it waits for the start, holding nothing anyone else needs
        assert prompt(lambda: workloads.get("doomed-1")).stopping
        with pytest.raises(WorkloadStopping):
            prompt(lambda: workloads.put(spec))
        with pytest.raises(PlanError):  # its slots stay taken until the workload has ended
            prompt(lambda: workloads.put(_spec("next-1", gpu, 0)))
    finally:
        workloads.runtime.gates["doomed-1"].set()
    assert put.outcome()[0] is True
    assert delete.outcome() is True
    assert workloads.runtime.starts == ["doomed-1"] and workloads.runtime.running == set()
    assert workloads.all() == [] and list(workloads.records_dir.iterdir()) == []
    assert workloads.put(_spec("next-1", gpu, 0))[0] is True  # the slots are free again


def test_a_refused_start_is_recorded_failed_and_frees_its_slots(workloads, gpu):
    workloads.runtime.refuse["bad-1"] = RuntimeStartError("no such image", code="environment_unavailable")
    with pytest.raises(WorkloadRefused) as refused:
        workloads.put(_spec("bad-1", gpu, 0))
    assert refused.value.code == "environment_unavailable"
    failed = workloads.get("bad-1")
    assert failed.state == "failed" and "no such image" in failed.exit_reason
    assert workloads.put(_spec("good-1", gpu, 0))[0] is True


def test_an_unexpected_error_in_a_start_leaves_no_entry(workloads, gpu):
    workloads.runtime.refuse["bug-1"] = ZeroDivisionError("a bug")
    with pytest.raises(ZeroDivisionError):
        workloads.put(_spec("bug-1", gpu, 0))
    assert workloads.get("bug-1") is None
    workloads.runtime.refuse.clear()
    assert workloads.put(_spec("bug-1", gpu, 0))[0] is True  # tried again from scratch


def test_the_api_answers_while_a_put_waits_for_its_start(workloads, gpu):
    server = make_server(
        "127.0.0.1",
        0,
        AgentApi(token=NODE_TOKEN, workloads=workloads, runtime_name="test-gated", nvml_name="fake"),
    )
    threading.Thread(target=server.serve_forever, daemon=True).start()
    headers = {"Authorization": f"Bearer {NODE_TOKEN}"}
    api = httpx.Client(base_url=f"http://127.0.0.1:{server.server_address[1]}", headers=headers, timeout=30)
    spec = workload_spec("api-1", _allocation(gpu, 0))
    workloads.runtime.hold("api-1")
    put = Call(lambda: api.put("/v1/workloads/api-1", json=spec))
    try:
        assert workloads.runtime.entered["api-1"].wait(GATE_SECONDS)
        assert prompt(lambda: api.get("/v1/health")).json()["workloads"] == 1
        listed = prompt(lambda: api.get("/v1/workloads")).json()["workloads"]
        assert [(w["session_id"], w["state"]) for w in listed] == [("api-1", "starting")]
        again = prompt(lambda: api.put("/v1/workloads/api-1", json=spec))
        assert again.status_code == 200 and again.json()["state"] == "starting"
        busy = prompt(
            lambda: api.put("/v1/workloads/api-2", json=workload_spec("api-2", _allocation(gpu, 0)))
        )
        assert busy.status_code == 409 and busy.json()["error"]["code"] == "gpu_busy"
    finally:
        workloads.runtime.gates["api-1"].set()
    assert put.outcome().status_code == 201
    api.close()
    server.shutdown()
    server.server_close()


def test_a_multi_gpu_spec_lists_its_gpus_and_a_one_gpu_spec_reads_as_before():
    one = workload_spec("one", _allocation("GPU-00000000-0000", 0))
    assert parse_spec(one).to_json() == one  # no device_uuids: the fingerprint agents recorded before
    uuids = ["GPU-00000000-0000", "GPU-00000001-0000"]
    two = workload_spec(
        "two",
        {
            "device_uuid": uuids[0],
            "profile": "2x",
            "slot_start": 0,
            "slot_count": 8,
            "sharing_policy": "exclusive",
        }
        | {"device_uuids": uuids},
    )
    assert parse_spec(two).allocation.devices == tuple(uuids)
    assert parse_spec(two).to_json() == two
    two["allocation"]["device_uuids"] = "GPU-00000000-0000"
    with pytest.raises(SpecError) as refused:
        parse_spec(two)
    assert "allocation.device_uuids" in refused.value.fields
