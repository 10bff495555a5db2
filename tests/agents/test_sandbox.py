"""The workload sandbox's /dev: a multi-GPU workload sees every GPU of its plan and no other, on a fake
fleet's inventory and a stand-in /dev (bubblewrap binds what the plan names, nothing else)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from agents import sandbox
from agents.gpuplan import Allocation, gpu_plan
from agents.nvml.fake import FakeNvml
from agents.nvml.fleet import load_fleet
from agents.nvml.reader import GpuReader

REPO = Path(__file__).resolve().parents[2]
PROBE = 'for n in /dev/nvidia*; do [ -e "$n" ] && echo "${n#/dev/}"; done; true'


def _inventory(fleet: str) -> dict:
    nvml = FakeNvml(load_fleet(REPO / "agents" / "fleets" / fleet))
    nvml.nvmlInit()
    return GpuReader(nvml).inventory()


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")
def test_a_2x_sandbox_dev_holds_both_gpus_and_no_other(tmp_path):
    inventory = _inventory("node-c.yaml")
    second_group = [g["uuid"] for g in inventory["gpus"] if g["topology_group"] == "topo-4"][:2]
    plan = gpu_plan(Allocation(second_group[0], "2x", 0, 8, "exclusive", tuple(second_group)), inventory)
    devices = tmp_path / "dev"
    devices.mkdir()
    for name in ["nvidiactl", "nvidia-uvm", *(f"nvidia{i}" for i in range(8))]:
        (devices / name).write_text(name)
    home, private = tmp_path / "home", tmp_path / "private"
    home.mkdir()
    private.mkdir()
    command = sandbox.bwrap_command(
        bwrap=shutil.which("bwrap"),
        user="check",
        uid=None,
        home=home,
        private=private,
        hidden=[str(tmp_path)],
        kept=[],
        writable=[],
        device_dir=str(devices),
        device_nodes=plan.device_nodes,
        command=["sh", "-c", PROBE],
    )
    result = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)  # noqa: S603
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.split()) == ["nvidia-uvm", "nvidia4", "nvidia5", "nvidiactl"]
    assert plan.env["CUDA_VISIBLE_DEVICES"] == ",".join(second_group)
