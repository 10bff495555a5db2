"""Where the cores go under load: CPU time by part of the stack, read from /proc.

``snapshot(roots)`` takes every process descended from ``roots`` (this process, and the embedded
servers that ``pg_ctl`` and Redis leave re-parented to init: their command line names the stack's data
folder), with its user and system time and that of the children it has reaped (a kernel's or a
database backend's time reaches its parent when it ends). ``by_part(before, after, seconds)`` gives the
cores each part used in between, a part being the first of ``PARTS`` that matches a process or, failing
that, its nearest ancestor. Other work on the machine (another checkout's tests) is never counted. A
process that began before the first snapshot and ended before the second counts its whole life (through
its parent): the stack's long-lived processes do not end during a phase, so this stays small.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

# (part, words that must all appear in the command line), first match wins
PARTS = (
    ("workloads (JupyterLab, kernels)", ("jupyter",)),
    ("workloads (JupyterLab, kernels)", ("ipykernel",)),
    ("web (uvicorn)", ("portal.asgi",)),
    ("web (uvicorn)", ("multiprocessing.spawn",)),  # uvicorn --workers children
    ("Celery worker", ("celery", "worker")),
    ("Celery beat", ("celery", "beat")),
    ("agents", ("-m", "agents")),
    ("PostgreSQL", ("postgres",)),
    ("Redis", ("redis-server",)),
    ("load generator (locust)", ("locust",)),
)
TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Process:
    pid: int
    ppid: int
    cmdline: str
    seconds: float  # own user + system time, and the reaped children's


def _read(pid: int) -> Process | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    # fields[0] is the state (field 3 of stat); utime, stime, cutime, cstime are fields 14–17
    own = sum(int(value) for value in fields[11:15]) / TICKS
    return Process(
        pid=pid, ppid=int(fields[1]), cmdline=cmdline or stat.split("(", 1)[1].split(")")[0], seconds=own
    )


def snapshot(root_pid: int, data_dir: Path) -> dict[int, Process]:
    every = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (process := _read(int(entry))) is not None:
            every[process.pid] = process
    roots = {root_pid} | {pid for pid, p in every.items() if str(data_dir) in p.cmdline}
    children: dict[int, list[int]] = {}
    for process in every.values():
        children.setdefault(process.ppid, []).append(process.pid)
    kept, stack = {}, [pid for pid in roots if pid in every]
    while stack:
        pid = stack.pop()
        if pid not in kept:
            kept[pid] = every[pid]
            stack += children.get(pid, [])
    return kept


def _part(pid: int, processes: dict[int, Process]) -> str:
    seen = 0
    while pid in processes and seen < 64:
        words = processes[pid].cmdline
        for part, needed in PARTS:
            if all(word in words for word in needed):
                return part
        pid, seen = processes[pid].ppid, seen + 1
    return "other (this runner, shells)"


def by_part(before: dict[int, Process], after: dict[int, Process], seconds: float) -> dict[str, float]:
    """Cores each part used between the two snapshots, busiest first. A process that ended in between
    is counted through its parent's reaped-children time."""
    used: dict[str, float] = {}
    for pid, process in after.items():
        earlier = before.get(pid)
        spent = process.seconds - (earlier.seconds if earlier is not None else 0.0)
        part = _part(pid, after)
        used[part] = used.get(part, 0.0) + max(0.0, spent) / seconds
    return dict(sorted(used.items(), key=lambda item: -item[1]))
