"""``make load``'s account of where the cores go (load/cpu.py): a process's CPU lands on its part, found
from its command line or its nearest ancestor's, and work outside the run's tree is never counted."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from load import cpu

BURN = "import time, sys\nend = time.process_time() + 0.4\nwhile time.process_time() < end: pass\nsys.stdin.read()"


def test_cpu_lands_on_the_part_its_command_line_names(tmp_path):
    before = cpu.snapshot(os.getpid(), tmp_path)
    started = time.monotonic()
    web = subprocess.Popen([sys.executable, "-c", BURN, "portal.asgi"], stdin=subprocess.PIPE)
    # a child of the "web" that names no part of its own: counted as the web's
    child = subprocess.Popen(
        [sys.executable, "-c", f"import subprocess, sys; subprocess.run([sys.executable, '-c', {BURN!r}])"],
        stdin=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            after = cpu.snapshot(os.getpid(), tmp_path)
            if after.get(web.pid) and after[web.pid].seconds >= 0.35:
                break
            time.sleep(0.1)
        parts = cpu.by_part(before, after, time.monotonic() - started)
    finally:
        for process in (web, child):
            process.kill()
            process.wait()
    elapsed = time.monotonic() - started
    assert parts["web (uvicorn)"] * elapsed >= 0.35
    assert set(parts) <= {name for name, _ in cpu.PARTS} | {"other (this runner, shells)"}


def test_processes_outside_the_run_are_not_counted(tmp_path):
    """Only the run's tree and the servers whose command line names its data folder: not our parent,
    not another checkout's processes."""
    named = subprocess.Popen(
        [sys.executable, "-c", BURN, str(tmp_path)], stdin=subprocess.PIPE, start_new_session=True
    )
    try:
        seen = cpu.snapshot(os.getpid(), tmp_path)
        assert os.getpid() in seen and named.pid in seen
        assert os.getppid() not in seen  # whoever started this test is not part of the stack
        assert set(cpu.snapshot(named.pid, tmp_path / "nothing-names-this")) == {named.pid}
    finally:
        named.kill()
        named.wait()


def test_the_stand_in_hosts_get_only_the_cpu_the_portal_leaves(tmp_path):
    """The agents and the JupyterLabs they start stand in for other machines: under `make load` they are
    in a CPU control group of low weight, and so is what they start in sessions of their own (where the
    kernel's autogroups make their niceness count for nothing against the portal)."""
    from chaos.stack import Proc, Stack

    stack = Stack(data_dir=tmp_path, agent_nice=19, agent_cpu_shares=64)
    procs = stack._host_group()
    if procs is None:
        pytest.skip("this machine lets no CPU control group be made")
    script = "import subprocess, sys, time; time.sleep(0.5); subprocess.Popen(['sleep', '60'], start_new_session=True); time.sleep(60)"
    agent = Proc("agent", [sys.executable, "-c", script], dict(os.environ), tmp_path / "agent.log", nice=19)
    agent.start()
    try:
        procs.write_text(str(agent.popen.pid))
        deadline = time.monotonic() + 10
        while not (children := _children(agent.popen.pid)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert children, "the stand-in agent started nothing"
        for pid in (agent.popen.pid, *children):
            assert procs.parent.name in Path(f"/proc/{pid}/cgroup").read_text()
        autogroup = Path(f"/proc/{agent.popen.pid}/autogroup")
        assert not autogroup.exists() or autogroup.read_text().strip().endswith("nice 19")
    finally:
        for pid in _children(agent.popen.pid):
            os.kill(pid, 9)
        agent.kill()
        stack.host_group_remove()
    assert not procs.parent.exists()


def _children(pid: int) -> list[int]:
    return [
        int(p)
        for p in subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    ]
