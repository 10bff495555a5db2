"""The agent as a real subprocess running real JupyterLab workloads (process runtime)."""

from __future__ import annotations

import json
import os
import shutil
import signal

import pytest

from tests.agents.conftest import alive, process_tree, run_in_kernel, wait_for, workload_spec

pytestmark = pytest.mark.slow
STAND_IN_LIBRARY = next(
    (
        p
        for p in (
            "/lib/x86_64-linux-gnu/libdl.so.2",
            "/lib/aarch64-linux-gnu/libdl.so.2",
            "/lib64/libdl.so.2",
        )
        if os.path.exists(p)
    ),
    None,
)

PRINT_GPU_ENV = (
    "import os, json; print(json.dumps({k: os.environ.get(k) for k in "
    "('CUDA_VISIBLE_DEVICES', 'NVIDIA_VISIBLE_DEVICES', 'CUDA_DEVICE_MEMORY_LIMIT', 'CUDA_DEVICE_SM_LIMIT', "
    "'LD_PRELOAD', 'HOME')} | {'pid': os.getpid(), 'cwd': os.getcwd()}))"
)


def _kernel_env(agent, spec: dict) -> dict:
    out = run_in_kernel(agent.url, spec["base_url"], PRINT_GPU_ENV)
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")
@pytest.mark.skipif(STAND_IN_LIBRARY is None, reason="no libdl.so.2 to stand in for libvgpu.so")
def test_fixed_share_in_bwrap_survives_agent_restart_and_delete_leaves_nothing(start_agent, tmp_path):
    vgpu_lib = tmp_path / "libvgpu.so"
    # A stand-in: a real, harmless shared object under HAMi-core's name, so the loader can preload it.
    shutil.copy(STAND_IN_LIBRARY, vgpu_lib)
    state = tmp_path / "state"
    agent = start_agent(state, "--sandbox", "bwrap", "--vgpu-lib", str(vgpu_lib))
    gpu = agent.inventory()["gpus"][0]
    spec = workload_spec(
        "fixed-1",
        {
            "device_uuid": gpu["uuid"],
            "profile": "1/4",
            "slot_start": 4,
            "slot_count": 2,
            "sharing_policy": "fixed-share",
        },
    )
    created = agent.put_workload(spec)
    assert created.status_code == 201, created.text
    assert agent.put_workload(spec).status_code == 200  # idempotent
    running = agent.wait_state("fixed-1", ("running",))
    assert running["gpu_plan"]["memory_limit_mib"] == 20480 and running["gpu_plan"]["sm_percent"] == 25

    env = _kernel_env(agent, spec)
    assert env["CUDA_VISIBLE_DEVICES"] == gpu["uuid"] == env["NVIDIA_VISIBLE_DEVICES"]
    assert env["CUDA_DEVICE_MEMORY_LIMIT"] == "20480m" and env["CUDA_DEVICE_SM_LIMIT"] == "25"
    assert env["LD_PRELOAD"] is None  # no variable to unset: the sandbox's /etc/ld.so.preload names it
    assert running["enforcement"] == {
        "device": {"enforced": True, "by": "device-nodes"},
        "memory": {"enforced": True, "by": "libvgpu"},
        "compute": {"enforced": True, "by": "libvgpu"},
    }
    # The tenant tries to get rid of it: unset the variable, start a clean process, rewrite the list.
    escape = run_in_kernel(
        agent.url,
        spec["base_url"],
        "import os, subprocess; os.environ.pop('LD_PRELOAD', None); "
        "maps = subprocess.run(['cat', '/proc/self/maps'], env={}, capture_output=True, text=True).stdout\n"
        "try:\n    open('/etc/ld.so.preload', 'w').write('')\n    wrote = 'written'\n"
        "except OSError as e:\n    wrote = type(e).__name__\n"
        "print(open('/etc/ld.so.preload').read().strip(), 'libvgpu.so' in maps, wrote)",
    )
    assert escape.strip().splitlines()[-1] == f"{vgpu_lib} True OSError"
    assert env["HOME"] == "/home/alice" == env["cwd"]  # its home, at a path that names nothing of the host
    assert env["pid"] < 50  # its own PID namespace

    # The fake NVML sees the workload's processes on its GPU (by their CUDA_VISIBLE_DEVICES).
    listed = wait_for(
        lambda: [w for w in agent.get("/v1/workloads").json()["workloads"] if w["gpu_memory_used_mib"]],
        10,
        what="per-workload GPU memory",
    )
    assert listed[0]["session_id"] == "fixed-1" and listed[0]["gpu_util_percent"] is not None

    # SIGTERM the agent: the workload keeps running; a new agent adopts it.
    launcher_pid = json.loads((state / "workloads" / "fixed-1.json").read_text())["runtime_state"]["pid"]
    agent.terminate()
    assert agent.proc.returncode == 0
    assert alive(launcher_pid)
    again = start_agent(state, "--sandbox", "bwrap", "--vgpu-lib", str(vgpu_lib))
    adopted = again.wait_state("fixed-1", ("running",), timeout=20)
    assert adopted["upstream"] == running["upstream"]
    assert _kernel_env(again, spec)["CUDA_VISIBLE_DEVICES"] == gpu["uuid"]
    assert [w["state"] for w in again.get("/v1/workloads").json()["workloads"]] == ["running"]

    tree = process_tree(launcher_pid)
    assert len(tree) >= 4  # launcher, bwrap ×2, jupyter, kernel
    assert again.client.delete("/v1/workloads/fixed-1").json() == {"deleted": True}
    assert again.client.delete("/v1/workloads/fixed-1").json() == {"deleted": False}
    wait_for(lambda: not any(alive(pid) for pid in tree), 10, what="every workload process to end")
    assert again.get("/v1/workloads/fixed-1").status_code == 404
    assert (state / "homes" / "alice").is_dir()  # the home outlives the session


def test_best_effort_without_sandbox_and_a_workload_killed_while_the_agent_was_down(start_agent, tmp_path):
    state = tmp_path / "state"
    agent = start_agent(state, "--sandbox", "none", "--vgpu-lib", str(tmp_path / "absent.so"))
    gpu = agent.inventory()["gpus"][0]
    spec = workload_spec(
        "effort-1",
        {
            "device_uuid": gpu["uuid"],
            "profile": "1/8",
            "slot_start": 7,
            "slot_count": 1,
            "sharing_policy": "best-effort",
        },
        user="bob",
    )
    assert agent.put_workload(spec).status_code == 201
    status = agent.wait_state("effort-1", ("running",))
    assert status["gpu_plan"]["memory_limit_mib"] == 10240 and status["gpu_plan"]["preload_vgpu"] is False
    env = _kernel_env(agent, spec)
    assert env["CUDA_VISIBLE_DEVICES"] == gpu["uuid"]
    assert env["CUDA_DEVICE_MEMORY_LIMIT"] == "10240m" and env["CUDA_DEVICE_SM_LIMIT"] is None
    assert env["pid"] > 50 and env["LD_PRELOAD"] is None

    launcher_pid = json.loads((state / "workloads" / "effort-1.json").read_text())["runtime_state"]["pid"]
    tree = process_tree(launcher_pid)
    agent.terminate()
    for pid in tree:  # the workload dies while no agent watches
        os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not any(alive(pid) for pid in tree), 10, what="the workload to die")
    again = start_agent(state, "--sandbox", "none")
    status = again.workload("effort-1")
    assert status["state"] == "exited"
    assert "while the agent was down" in status["exit_reason"]
    assert again.client.delete("/v1/workloads/effort-1").json() == {"deleted": True}


def test_mig_device_passthrough_and_cpu_session(start_agent, tmp_path):
    agent = start_agent(tmp_path / "state", "--sandbox", "none")
    mig = next(m for m in agent.inventory()["gpus"][1]["mig_devices"] if m["profile"] == "1g.10gb")
    spec = workload_spec(
        "mig-1",
        {
            "device_uuid": mig["uuid"],
            "profile": "1g.10gb",
            "slot_start": 0,
            "slot_count": 8,
            "sharing_policy": "exclusive",
        },
    )
    cpu = workload_spec("cpu-1", None, user="carol")
    assert agent.put_workload(spec).status_code == 201
    assert agent.put_workload(cpu).status_code == 201
    agent.wait_state("mig-1", ("running",))
    agent.wait_state("cpu-1", ("running",))
    assert _kernel_env(agent, spec)["CUDA_VISIBLE_DEVICES"] == mig["uuid"]
    assert _kernel_env(agent, cpu)["CUDA_VISIBLE_DEVICES"] == ""
    for sid in ("mig-1", "cpu-1"):
        assert agent.client.delete(f"/v1/workloads/{sid}").json() == {"deleted": True}
