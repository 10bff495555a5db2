"""The intermediate between the agent and a workload: ``python -m agents.runtimes.launcher``.

The agent starts it in a session of its own, so the workload outlives an agent restart (bubblewrap's
``--die-with-parent`` then follows this process, not the agent). It becomes a child subreaper, so
every descendant of the workload stays in its tree (nothing escapes ``stop``); applies the host
limits; runs the command; forwards SIGTERM gracefully; kills any leftover descendant; and writes
the exit status to ``--exit-file`` for whichever agent polls next.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import resource
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime

PR_SET_CHILD_SUBREAPER = 36
GRACE_SECONDS = 5.0


def children_by_parent() -> dict[int, list[int]]:
    """One scan of /proc (host PID view): live process ids by parent id."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as stat:
                fields = stat.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] == b"Z":
            continue
        children.setdefault(int(fields[1]), []).append(int(entry.name))
    return children


def descendants(root_pid: int, children: dict[int, list[int]] | None = None) -> list[int]:
    """Every live descendant of root_pid (pass ``children`` to reuse one /proc scan)."""
    children = children_by_parent() if children is None else children
    found, stack = [], [root_pid]
    while stack:
        for child in children.get(stack.pop(), ()):
            found.append(child)
            stack.append(child)
    return found


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as comm:
            return comm.read().strip()
    except OSError:
        return ""


def _signal_all(pids: list[int], signum: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="agents.runtimes.launcher")
    parser.add_argument("--exit-file", required=True)
    parser.add_argument("--cpus", default="", help="comma-separated CPU ids to pin the workload to")
    parser.add_argument("--rlimit-data-bytes", type=int, default=0)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    if args.cpus:
        os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})
    if args.rlimit_data_bytes:
        resource.setrlimit(resource.RLIMIT_DATA, (args.rlimit_data_bytes, args.rlimit_data_bytes))

    stopping = {"at": None}

    def on_signal(signum: int, _frame: object) -> None:
        if stopping["at"] is None:
            stopping["at"] = time.monotonic()
        # Jupyter and its kernels shut down cleanly on SIGTERM. bubblewrap is left alone: once
        # its child is gone it ends, taking its PID namespace with it.
        _signal_all([p for p in descendants(os.getpid()) if _comm(p) != "bwrap"], signal.SIGTERM)

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, on_signal)
    child = subprocess.Popen(command)  # noqa: S603 - the agent built this command
    exit_code = None
    while exit_code is None:
        try:
            exit_code = child.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            if stopping["at"] is not None and time.monotonic() - stopping["at"] > GRACE_SECONDS:
                _signal_all(descendants(os.getpid()), signal.SIGKILL)
    # Whatever the workload left behind (a kernel in its own session) ends with it.
    leftovers = descendants(os.getpid())
    if leftovers:
        _signal_all(leftovers, signal.SIGTERM)
        deadline = time.monotonic() + GRACE_SECONDS
        while descendants(os.getpid()) and time.monotonic() < deadline:
            _reap()
            time.sleep(0.1)
        _signal_all(descendants(os.getpid()), signal.SIGKILL)
    _reap()
    record = {
        "exit_code": exit_code,
        "stopped": stopping["at"] is not None,
        "ended_at": datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z"),
    }
    tmp = f"{args.exit_file}.tmp"
    with open(tmp, "w") as out:
        json.dump(record, out)
    os.replace(tmp, args.exit_file)
    return 0


def _reap() -> None:
    while True:
        try:
            pid, _status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


if __name__ == "__main__":
    sys.exit(main())
