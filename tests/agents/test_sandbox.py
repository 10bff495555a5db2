"""The workload sandbox's /dev: a multi-GPU workload sees every GPU of its plan and no other, on a fake
fleet's inventory and a stand-in /dev (bubblewrap binds what the plan names, nothing else)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from agents import sandbox
from agents.gpuplan import Allocation, gpu_plan
from agents.nvml.fake import FakeNvml
from agents.nvml.fleet import load_fleet
from agents.nvml.reader import GpuReader

ROOT = Path(__file__).resolve().parents[2]

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


# One node's agent taking uids from the shared table: a process of its own (spawned, not forked: a fork
# of the test process would inherit its threads' locks and the browser's pipe).
_NODE = """
import json, sys
from pathlib import Path
from agents import sandbox
table, users, first = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
pool = sandbox.UidPool(Path(table), (first, first + 999))
print(json.dumps([pool.for_user(user) for user in users]))
"""


def test_nodes_sharing_a_uid_table_give_each_user_one_uid_and_never_one_uid_to_two_users(tmp_path):
    """Agents on several hosts of a pool take uids from the shared homes root's table at once: each user
    gets the same uid on every node, and no uid goes to two users (a flock, not a thread lock, holds)."""
    table = tmp_path / "homes" / ".suanli" / "sandbox-uids.json"
    users = [f"user{i}" for i in range(40)]
    wanted = [users[i::2] + users for i in range(4)]
    nodes = [
        subprocess.Popen(  # noqa: S603
            [sys.executable, "-c", _NODE, str(table), json.dumps(node_users), "60000"],
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )  # fmt: skip
        for node_users in wanted
    ]
    seen = [json.loads(node.communicate(timeout=60)[0]) for node in nodes]
    assert all(node.returncode == 0 for node in nodes)
    for node_users, uids in zip(wanted, seen, strict=True):
        assert len(uids) == len(node_users)
    by_user: dict[str, set[int]] = {}
    for node_users, uids in zip(wanted, seen, strict=True):
        for user, uid in zip(node_users, uids, strict=True):
            by_user.setdefault(user, set()).add(uid)
    assert all(len(uids) == 1 for uids in by_user.values()), by_user
    assert len({next(iter(uids)) for uids in by_user.values()}) == len(users)
    assert json.loads(table.read_text()) == {user: next(iter(uids)) for user, uids in by_user.items()}
