"""A workload's activity as the agent finds it: the CPU time of a real process tree read from /proc,
a real JupyterLab's kernels asked over its socket without the asking counting as activity, and the
heartbeat that carries both with the session's own GPU use (the fake NVML's per-process figures)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import pytest

from agents.activity import cgroup_cpu_seconds, jupyter_activity, process_cpu_seconds
from agents.runtimes import RuntimeOptions, runtime_class
from agents.runtimes.launcher import descendants
from tests.agents.conftest import (
    NODE_TOKEN,
    execute_request,
    free_port,
    kernel_channels,
    start_kernel,
    wait_for,
    workload_spec,
)
from tests.agents.test_heartbeat import StandInPortal

MIB = 1024 * 1024
NODE_HEADERS = {"Authorization": f"Bearer {NODE_TOKEN}"}
# A parent that starts a child burning one CPU second (CPU time, whatever the load), reaps it, then waits.
BURN_THEN_REAP = (
    "import subprocess, sys, time\n"
    "subprocess.run([sys.executable, '-c', 'import time\\nwhile time.process_time() < 1.0: pass'])\n"
    "print('reaped', flush=True)\n"
    "time.sleep(60)\n"
)


def test_cpu_seconds_count_a_busy_child_while_it_runs_and_after_it_is_reaped():
    parent = subprocess.Popen([sys.executable, "-c", BURN_THEN_REAP], stdout=subprocess.PIPE, text=True)
    try:
        child = wait_for(lambda: descendants(parent.pid), 10, 0.05, "the burning child")[0]
        wait_for(lambda: process_cpu_seconds({child}) >= 0.2, 20, 0.05, "the child to burn CPU")
        # Clock ticks in seconds: 0.04 + 0.2 is 0.24000000000000002, so compare in whole hundredths.
        together, alone = process_cpu_seconds({parent.pid, child}), process_cpu_seconds({parent.pid})
        assert round((together - alone) * 100) >= 20
        assert parent.stdout.readline() == "reaped\n"
        assert descendants(parent.pid) == []
        assert process_cpu_seconds({parent.pid}) >= 1.0  # the reaped child's second stays counted
    finally:
        parent.kill()
        parent.wait()
    assert process_cpu_seconds({parent.pid}) is None  # gone: no figure, not zero


def test_cgroup_cpu_seconds_read_this_process_cgroup_or_say_nothing():
    seconds = cgroup_cpu_seconds(os.getpid())
    assert seconds is None or seconds >= process_cpu_seconds({os.getpid()}) - 0.5
    assert cgroup_cpu_seconds(2**22 + 1) is None  # no such process


@pytest.mark.slow
def test_jupyter_activity_counts_busy_kernels_and_browsers_and_never_itself(start_agent, tmp_path):
    state = tmp_path / "state"
    agent = start_agent(state, "--sandbox", "none")
    spec = workload_spec("act-1", None)
    assert agent.put_workload(spec).status_code == 201
    agent.wait_state("act-1", ("running",))
    record = json.loads((state / "workloads" / "act-1.json").read_text())
    runtime = runtime_class("process")(RuntimeOptions(state_dir=state))
    handle = runtime.restore(record["runtime_state"])
    jupyter = httpx.Client(base_url=f"{agent.url}{spec['base_url']}", headers=NODE_HEADERS, timeout=10)

    def api_last_activity() -> str:
        return jupyter.get("api/status", params={"no_track_activity": "1"}).json()["last_activity"]

    kernel_id = start_kernel(agent.url, spec["base_url"], NODE_HEADERS)

    def settled() -> dict | None:  # the kernels started and went quiet (a loaded machine is slow to)
        first = jupyter_activity(handle, spec["token"])
        time.sleep(2)
        return first if first == jupyter_activity(handle, spec["token"]) else None

    wait_for(settled, 30, what="the kernels to settle")
    before = api_last_activity()
    quiet = jupyter_activity(handle, spec["token"])
    assert quiet["busy_kernels"] == 0 and quiet["connections"] == 0 and quiet["last_activity"] is not None
    time.sleep(0.5)
    assert jupyter_activity(handle, spec["token"]) == quiet  # asking is not activity
    assert api_last_activity() == before

    with kernel_channels(agent.url, spec["base_url"], kernel_id, NODE_HEADERS) as ws:
        ws.send(json.dumps(execute_request("while True: pass")[1]))
        busy = wait_for(
            lambda: (found := jupyter_activity(handle, spec["token"]))["busy_kernels"] == 1 and found,
            30,
            what="the kernel to be busy",
        )
        assert busy["connections"] == 1 and busy["last_activity"] > quiet["last_activity"]
    wait_for(lambda: jupyter_activity(handle, spec["token"])["connections"] == 0, 10, what="the browser gone")
    assert jupyter_activity(handle, "wrong-token") is None  # Jupyter refused: no figure
    assert jupyter_activity(handle, None) is None


@pytest.mark.slow
def test_heartbeats_carry_each_running_workloads_activity(start_agent, tmp_path):
    port = free_port()
    portal = StandInPortal(port)
    try:
        start_agent(
            tmp_path / "state", "--sandbox", "none", "--portal", f"http://127.0.0.1:{port}",
            "--heartbeat-seconds", "0.5",
        )  # fmt: skip
        gpu = portal.beats_after(0, 1)["inventory"]["gpus"][0]["uuid"]
        allocation = {
            "device_uuid": gpu,
            "profile": "1/2",
            "slot_start": 0,
            "slot_count": 4,
            "sharing_policy": "best-effort",
        }
        portal.desired = [workload_spec("cpu-1", None), workload_spec("gpu-1", allocation, user="bob")]

        def activities() -> dict | None:
            beat = portal.beats_after(len(portal.beats), 1)
            found = {w["session_id"]: w.get("activity") for w in beat["workloads"]}
            return found if len(found) == 2 and all(found.values()) else None

        found = wait_for(activities, 60, 0.5, "both workloads running with their activity")
        cpu, on_gpu = found["cpu-1"], found["gpu-1"]
        assert cpu["jupyter"]["busy_kernels"] == 0 and cpu["jupyter"]["connections"] == 0
        assert isinstance(cpu["cpu_seconds"], float) and cpu["cpu_seconds"] > 0
        assert cpu["gpu_util_percent"] is None and cpu["gpu_memory_bytes"] is None
        # every process of the GPU session uses the fake GPU at the fleet's figures (10 %, 256 MiB each)
        assert on_gpu["gpu_memory_bytes"] > 0 and on_gpu["gpu_memory_bytes"] % (256 * MIB) == 0
        assert on_gpu["gpu_util_percent"] >= 10
        assert on_gpu["jupyter"] is not None and on_gpu["cpu_seconds"] > 0
    finally:
        portal.close()
