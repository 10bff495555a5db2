"""What a workload is doing, for the portal's idle stop: its JupyterLab's own activity and the CPU time of
its processes (docs/AGENT_PROTOCOL.md, a workload's ``activity``). The GPU's share comes from NVML
(agents/nvml/reader.py); everything here reads the host, never the workload's word.

Jupyter is asked ``GET api/kernels`` and ``GET api/terminals`` with ``?no_track_activity=1``, so the
agent's polling never counts as the user's activity. ``api/status``'s ``last_activity`` is not used: the
browser's own API polling bumps it, so an open but untouched lab would never be idle. Every failure
(no answer within the timeout, a 403, garbage) gives null for that figure, never an exception.
"""

from __future__ import annotations

import http.client
import json
import os
from datetime import UTC, datetime
from pathlib import Path

from agents.gateway import GatewayError, Upstream, local_request

JUPYTER_TIMEOUT_SECONDS = 1.0
_TICKS_PER_SECOND = os.sysconf("SC_CLK_TCK")
_CGROUP_ROOT = Path("/sys/fs/cgroup")


def _jupyter_list(handle: Upstream, path: str, token: str, timeout: float) -> list[dict] | None:
    """The JSON list one Jupyter API answers; [] when the server has no such API (404: terminals
    disabled), None on any other failure."""
    headers = {"Authorization": f"token {token}"}
    try:
        status, body = local_request(handle, "GET", f"{path}?no_track_activity=1", headers, timeout=timeout)
    except (OSError, GatewayError, http.client.HTTPException):
        return None
    if status == 404:
        return []
    try:
        items = json.loads(body) if status == 200 else None
    except ValueError:
        return None
    if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
        return None
    return items


def _instant(value) -> datetime | None:
    """An aware time from Jupyter's ISO 8601 text (``…Z`` or ``…+00:00``), or None."""
    try:
        at = datetime.fromisoformat(value) if isinstance(value, str) else None
    except ValueError:
        return None
    return at if at is None or at.tzinfo else at.replace(tzinfo=UTC)


def jupyter_activity(
    handle: Upstream, token: str | None, *, timeout: float = JUPYTER_TIMEOUT_SECONDS
) -> dict | None:
    """``{"last_activity", "busy_kernels", "connections"}`` of the workload's JupyterLab: the latest
    kernel or terminal activity (ISO 8601 as Jupyter wrote it, or None), the kernels executing now, and
    the browsers connected to its kernels. None when Jupyter cannot say (no token, no answer)."""
    if not token:
        return None
    kernels = _jupyter_list(handle, f"{handle.base_url}api/kernels", token, timeout)
    if kernels is None:
        return None
    terminals = _jupyter_list(handle, f"{handle.base_url}api/terminals", token, timeout) or []
    stamps = [at for item in [*kernels, *terminals] if (at := _instant(item.get("last_activity")))]
    latest = max(stamps, default=None)
    return {
        "last_activity": latest.isoformat().replace("+00:00", "Z") if latest else None,
        "busy_kernels": sum(1 for k in kernels if k.get("execution_state") == "busy"),
        "connections": sum(c for k in kernels if isinstance(c := k.get("connections"), int)),
    }


def process_cpu_seconds(pids: set[int]) -> float | None:
    """CPU seconds (user and system) spent by these processes and by the children they reaped; None
    when none of them could be read. A workload's launcher is a subreaper, so what its tree spent
    stays counted after a process in it ends; the figure may still drop when a process ends unreaped,
    which the portal reads as no figure for that heartbeat."""
    ticks, read = 0, False
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as stat:
                fields = stat.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        # after the command: state is fields[0], so utime, stime, cutime, cstime are 11..14
        ticks += sum(int(value) for value in fields[11:15])
        read = True
    return round(ticks / _TICKS_PER_SECOND, 2) if read else None


def cgroup_cpu_seconds(pid: int) -> float | None:
    """CPU seconds of the whole cgroup (v2) that process ``pid`` is in, from its ``cpu.stat``: the
    figure for a workload with a cgroup of its own (a container). None where there is no such file."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
        path = next(line.split("::", 1)[1] for line in lines if line.startswith("0::"))
        stat = (_CGROUP_ROOT / path.lstrip("/") / "cpu.stat").read_text()
        usage_usec = next(int(row.split()[1]) for row in stat.splitlines() if row.startswith("usage_usec "))
    except (OSError, StopIteration, IndexError, ValueError):
        return None
    return round(usage_usec / 1_000_000, 2)
