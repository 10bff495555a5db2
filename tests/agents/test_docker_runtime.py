"""The docker runtime's container spec (pure), and the engine calls where an engine exists."""

from __future__ import annotations

import json

import docker
import docker.types
import pytest

from agents.gpuplan import Allocation, HostGpuTools, cpu_plan, gpu_plan
from agents.runtimes import RuntimeOptions, runtime_class
from agents.runtimes.base import LABEXTENSIONS_DIR
from agents.runtimes.docker import container_spec
from agents.spec import parse_spec
from tests.agents.conftest import workload_spec
from tests.agents.test_gpuplan import GPU, MIGS, inventory

TOOLS = HostGpuTools(
    vgpu_lib="/opt/hami/libvgpu.so",
    vgpu_preload_file="/var/lib/agent/vgpu/ld.so.preload",
    mps_control="/usr/bin/nvidia-cuda-mps-control",
    mps_root="/var/lib/agent/mps",
)


def _spec(allocation: dict | None, **overrides):
    return parse_spec(workload_spec("dock-1", allocation, token="secret-token-42", **overrides))


def _build(spec, plan, egress_dir=None):
    return container_spec(
        spec,
        plan,
        private_dir="/var/lib/agent/run/dock-1/private",
        egress_dir=egress_dir,
        default_image="quay.io/jupyter/base-notebook",
        shm_mib=1024,
        pids_limit=4096,
    )


def test_fixed_share_container_spec():
    allocation = {
        "device_uuid": GPU,
        "profile": "1/4",
        "slot_start": 2,
        "slot_count": 2,
        "sharing_policy": "fixed-share",
    }
    spec = _spec(allocation, limits={"cpu_cores": 2.5, "memory_mib": 8192})
    plan = gpu_plan(Allocation(**allocation), inventory(), tools=TOOLS)
    kwargs = _build(spec, plan)
    assert kwargs["image"] == "quay.io/jupyter/base-notebook" and kwargs["name"] == "suanli-dock-1"
    assert kwargs["device_requests"] == [docker.types.DeviceRequest(device_ids=[GPU], capabilities=[["gpu"]])]
    assert kwargs["mem_limit"] == "8192m" == kwargs["memswap_limit"]
    assert (
        kwargs["nano_cpus"] == 2_500_000_000
        and kwargs["shm_size"] == "1024m"
        and kwargs["pids_limit"] == 4096
    )
    assert kwargs["network_mode"] == "none" and "ports" not in kwargs  # nothing to reach, nothing published
    assert kwargs["user"] == "1000:100" and kwargs["cap_drop"] == ["ALL"]
    assert kwargs["security_opt"] == ["no-new-privileges:true"] and kwargs["read_only"] is True
    assert set(kwargs["tmpfs"]) == {"/tmp"}
    assert kwargs["labels"] == {
        "io.suanli.session": "dock-1",
        "io.suanli.user": "alice",
        "io.suanli.profile": "1/4",
    }
    env = kwargs["environment"]
    assert env["CUDA_VISIBLE_DEVICES"] == GPU == env["NVIDIA_VISIBLE_DEVICES"]
    assert env["CUDA_DEVICE_MEMORY_LIMIT"] == "20480m" and env["CUDA_DEVICE_SM_LIMIT"] == "25"
    assert json.loads(env["SUANLI_JUPYTER_CONFIG"])["IdentityProvider"] == {"token": "secret-token-42"}
    mounts = {m["Target"]: m for m in kwargs["mounts"]}
    assert (
        mounts["/home/jovyan"]["Source"] == "suanli-home-alice" and mounts["/home/jovyan"]["Type"] == "volume"
    )
    assert (
        mounts["/etc/ld.so.preload"]["Source"] == TOOLS.vgpu_preload_file
        and mounts["/etc/ld.so.preload"]["ReadOnly"]
    )
    assert mounts["/usr/local/vgpu/libvgpu.so"]["Source"] == TOOLS.vgpu_lib
    command = " ".join(kwargs["command"])
    assert "secret-token-42" not in command  # the token is not in argv
    assert "--ServerApp.base_url=/jupyter/dock-1/" in command
    assert "--ServerApp.sock=/run/jupyter/jupyter.sock" in command and "--ServerApp.port" not in command
    assert mounts["/run/jupyter"]["Source"] == "/var/lib/agent/run/dock-1/private"
    assert "HTTP_PROXY" not in env and "/run/suanli-egress" not in mounts  # outbound off
    assert kwargs["ipc_mode"] is None


def test_the_portals_lab_extensions_are_mounted_read_only_and_named_to_jupyterlab():
    kwargs = _build(_spec(None), cpu_plan())
    mounts = {m["Target"]: m for m in kwargs["mounts"]}
    extensions = mounts["/run/suanli-labextensions"]
    assert extensions["Source"] == str(LABEXTENSIONS_DIR) and extensions["Type"] == "bind"
    assert extensions["ReadOnly"] is True
    assert "--LabApp.extra_labextensions_path=/run/suanli-labextensions" in " ".join(kwargs["command"])


def test_equal_share_mounts_the_mps_pipe_and_mig_and_cpu_sessions():
    allocation = {
        "device_uuid": GPU,
        "profile": "1/2",
        "slot_start": 4,
        "slot_count": 4,
        "sharing_policy": "equal-share",
    }
    plan = gpu_plan(Allocation(**allocation), inventory(), tools=TOOLS)
    kwargs = _build(_spec(allocation), plan)
    pipe = f"/var/lib/agent/mps/{GPU}/pipe"
    assert {m["Target"]: m["Source"] for m in kwargs["mounts"]}[pipe] == pipe
    assert kwargs["environment"]["CUDA_MPS_PIPE_DIRECTORY"] == pipe and kwargs["ipc_mode"] == "host"

    mig_allocation = {
        "device_uuid": MIGS["1g.10gb"],
        "profile": "1g.10gb",
        "slot_start": 0,
        "slot_count": 8,
        "sharing_policy": "exclusive",
    }
    torch = {"name": "torch", "python": None, "image": "example/torch:2"}
    mig_plan = gpu_plan(Allocation(**mig_allocation), inventory())
    mig = _build(_spec(mig_allocation, environment=torch), mig_plan)
    assert mig["image"] == "example/torch:2"
    assert mig["device_requests"][0]["DeviceIDs"] == [MIGS["1g.10gb"]]
    cpu = _build(_spec(None), cpu_plan())
    assert cpu["device_requests"] == [] and cpu["environment"]["NVIDIA_VISIBLE_DEVICES"] == "void"


def test_outbound_goes_through_the_egress_relay_and_nothing_else():
    kwargs = _build(_spec(None), cpu_plan(), egress_dir="/var/lib/agent/egress")
    assert kwargs["network_mode"] == "none"
    mounts = {m["Target"]: m for m in kwargs["mounts"]}
    assert (
        mounts["/run/suanli-egress"]["Source"] == "/var/lib/agent/egress"
        and mounts["/run/suanli-egress"]["ReadOnly"]
    )
    assert kwargs["environment"]["HTTPS_PROXY"] == "http://127.0.0.1:3128"
    command = kwargs["command"]
    assert command[:2] == ["python3", "-I"] and "/run/suanli-egress/egress.sock" in command
    assert command[command.index("--") + 1 :][:2] == ["bash", "-c"]  # then JupyterLab, as without it


def _engine_available() -> bool:
    try:
        docker.from_env().ping()
        return True
    except Exception:
        return False


@pytest.mark.slow
@pytest.mark.skipif(not _engine_available(), reason="no Docker engine reachable on this machine")
def test_docker_engine_start_poll_stop(tmp_path):  # pragma: no cover - needs an engine
    runtime = runtime_class("docker")(RuntimeOptions(state_dir=tmp_path))
    spec = _spec(None)
    state = runtime.start(spec, cpu_plan())
    try:
        assert runtime.poll(state) is None
    finally:
        runtime.stop(state)
    assert runtime.poll(state) == "the container is gone"
