"""Heartbeats to the portal, and convergence to the ``desired_workloads`` in each answer.

``build_heartbeat`` makes the body: one pass of NVML metric calls over cached handles and the
cached inventory, one /proc scan for every workload's process ids and CPU time, and each running
workload's Jupyter asked for its activity (at once, within a second); nothing rediscovered.
While the portal cannot be reached the agent backs off (doubling, capped) and touches nothing:
every workload keeps running.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping

from agents import __version__
from agents.environments import present
from agents.gpuplan import HostGpuTools, served_policies
from agents.home_usage import HomeMeter
from agents.nvml import GpuReader
from agents.runtimes.launcher import children_by_parent
from agents.workloads import Workload, Workloads

log = logging.getLogger("agents.heartbeat")
MAX_BACKOFF_SECONDS = 60.0


def build_heartbeat(
    *,
    listen_url: str,
    runtime: str,
    reader: GpuReader,
    workloads: Iterable[Workload],
    pids_by_session: Mapping[str, set[int]],
    gpu_of_session: Mapping[str, str] | None = None,
    tools: HostGpuTools | None = None,
    activity: Mapping[str, dict] | None = None,
    homes: list[dict] | None = None,
    environments: list[str] | None = None,
    interfaces: Iterable[str] = ("jupyterlab",),
) -> dict:
    """The heartbeat's body; ``activity`` is ``Workloads.activity()``, which the running workloads'
    statuses carry with their GPU figures, and ``homes`` the homes and team folders measured since the
    portal last had their figures (``HomeMeter.pending``; docs/AGENT_PROTOCOL.md): a home's go in
    ``homes``, a team folder's in ``team_folders``. ``environments``: the interpreters of the portal's
    environments that this node has (``agents.environments.present``); ``interfaces`` what its workloads
    can serve (``jupyterlab``, and ``vscode`` where code-server is installed)."""
    activity = activity or {}
    metrics, per_session = reader.metrics(pids_by_session, gpu_of_session)
    body = {
        "capabilities": {
            "sharing_policies": served_policies(tools or HostGpuTools()),
            # the agent's own interpreter runs workloads too (an environment without one names it)
            "environments": sorted({sys.executable, *(environments or [])}),
            "interfaces": list(interfaces),
        },
        "agent_version": __version__,
        "listen_url": listen_url,
        "runtime": runtime,
        "inventory": reader.inventory(),
        "metrics": metrics,
        "workloads": [w.status(per_session.get(w.session_id), activity.get(w.session_id)) for w in workloads],
    }
    for key, figures in (
        ("homes", [f for f in homes or () if "user" in f]),
        ("team_folders", [f for f in homes or () if "team" in f]),
    ):
        if figures:
            body[key] = figures
    return body


class PortalError(Exception):
    pass


REASON_CHARS = 300
_TITLE = re.compile(r"<title>(?P<title>.*?)</title>", re.IGNORECASE | re.DOTALL)
_TAGS = re.compile(r"<[^>]+>")


def refusal_reason(exc: urllib.error.HTTPError) -> str:
    """Why the portal refused, from its error body: the JSON error's code and message, an HTML
    page's title (Django's DisallowedHost, a proxy's 502), else the start of the text."""
    try:
        raw = exc.read(64 * 1024).decode("utf-8", errors="replace")
    except OSError:
        raw = ""
    with contextlib.suppress(ValueError):
        data = json.loads(raw)
        error = data.get("error") if isinstance(data, dict) else None
        if isinstance(error, dict):
            return f"{error.get('code', '?')}: {error.get('message', '')}"[:REASON_CHARS]
        if isinstance(data, dict) and "detail" in data:
            return str(data["detail"])[:REASON_CHARS]
    title = _TITLE.search(raw)
    text = title["title"] if title else _TAGS.sub(" ", raw)
    text = " ".join(text.split())
    return (text or exc.reason or "no reason given")[:REASON_CHARS]


def post_heartbeat(portal: str, token: str, body: dict, *, timeout_seconds: float = 10.0) -> dict:
    """POST one heartbeat; the portal's answer, checked to carry a list of desired workloads."""
    request = urllib.request.Request(  # noqa: S310 - the operator's portal URL
        f"{portal.rstrip('/')}/api/agent/heartbeat",
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_seconds) as response:  # noqa: S310
            answer = json.loads(response.read().decode("utf-8"))
    except urllib.error.HTTPError as exc:
        raise PortalError(f"portal answered {exc.code}: {refusal_reason(exc)}")
    except (OSError, ValueError) as exc:
        raise PortalError(f"portal unreachable: {exc}")
    if not isinstance(answer, dict) or not isinstance(answer.get("desired_workloads"), list):
        # Never converge on an answer we do not understand: it would stop every workload.
        raise PortalError("portal answer lacks a desired_workloads list")
    return answer


class Heartbeats(threading.Thread):
    def __init__(
        self,
        *,
        portal: str,
        token: str,
        listen_url: str,
        runtime_name: str,
        workloads: Workloads,
        interval_seconds: float,
        homes: HomeMeter | None = None,
    ) -> None:
        super().__init__(name="heartbeats", daemon=True)
        self.homes = homes
        self.portal = portal
        self.token = token
        self.listen_url = listen_url
        self.runtime_name = runtime_name
        self.workloads = workloads
        self.interval_seconds = interval_seconds
        self.failures = 0
        self.environment_pythons: list[str] = []  # the portal's published interpreters, from its last answer
        self._stop = threading.Event()

    def stop(self) -> None:
        self._stop.set()

    def beat(self) -> float:
        """One heartbeat and convergence; the delay before the next."""
        workloads = self.workloads
        children = children_by_parent() if any(w.live for w in workloads.all()) else {}
        homes = self._measure_homes()
        body = build_heartbeat(
            listen_url=self.listen_url,
            runtime=self.runtime_name,
            reader=workloads.reader,
            workloads=workloads.all(),
            pids_by_session=workloads.pids_by_session(children),
            gpu_of_session=workloads.gpu_of_session(),
            tools=workloads.tools,
            activity=workloads.activity(children),
            homes=homes,
            environments=present(self.environment_pythons),
            interfaces=workloads.runtime.options.interfaces,
        )
        try:
            answer = post_heartbeat(self.portal, self.token, body)
        except PortalError as exc:
            self.failures += 1
            delay = min(self.interval_seconds * 2**self.failures, MAX_BACKOFF_SECONDS)
            log.warning("heartbeat failed (%s); next try in %.1f s, workloads left running", exc, delay)
            return delay
        if self.failures:
            log.info("portal reachable again after %d failed heartbeats", self.failures)
        self.failures = 0
        if self.homes is not None:
            self.homes.acknowledge(homes)
        interval = answer.get("heartbeat_interval_seconds")
        if isinstance(interval, int | float) and not isinstance(interval, bool) and 0.2 <= interval <= 300:
            self.interval_seconds = float(interval)
        pythons = answer.get("environments")
        if isinstance(pythons, list):
            self.environment_pythons = [p for p in pythons[:1000] if isinstance(p, str)]
        workloads.converge(answer["desired_workloads"])
        return self.interval_seconds

    def _measure_homes(self) -> list[dict]:
        """One slice of the homes' measurement (bounded: agents/home_usage.py); the figures to send.
        A failure here costs the figures, never the heartbeat."""
        if self.homes is None:
            return []
        try:
            workloads = self.workloads.all()
            self.homes.note_users(str(w.spec.get("user") or "") for w in workloads)
            self.homes.note_teams(
                str(t.get("key") or "")
                for w in workloads
                for t in (w.spec.get("teams") or ())
                if isinstance(t, dict)
            )
            self.homes.step()
        except Exception:
            log.exception("measuring homes failed")
        return self.homes.pending()

    def run(self) -> None:
        delay = 0.0
        while not self._stop.wait(delay):
            try:
                delay = self.beat()
            except Exception:
                log.exception("heartbeat pass failed")
                delay = self.interval_seconds
