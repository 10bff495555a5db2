"""The agent's workloads: create, delete, watch, adopt after a restart, converge to the portal.

One lock guards the table, and it is held only for steps that touch no runtime: the check that a
GPU serves one policy and the reservation of a new workload (state ``starting``, no handle yet) are
one step; the runtime starts with the lock released, and its result is recorded under it again.
Each workload has its own lock for the runtime's work on it (start, stop), so a DELETE during a
start waits for that start only and then stops what it started. Each workload's record is persisted
as JSON under ``<state-dir>/workloads/<session>.json`` (written atomically): the spec without its
token (only its SHA-256), the GPU plan, the runtime's handle, and the workload's state.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from agents import gateway, homes
from agents.activity import jupyter_activity
from agents.gpuplan import GpuPlan, HostGpuTools, PlanError, cpu_plan, gpu_plan
from agents.mps import MpsDaemons, MpsError
from agents.nvml import GpuReader
from agents.runtimes import Runtime, RuntimeHandle, RuntimeStartError
from agents.runtimes.launcher import children_by_parent
from agents.spec import SESSION_ID_RE, SpecError, WorkloadSpec, parse_spec

log = logging.getLogger("agents.workloads")
START_TIMEOUT_SECONDS = 120.0


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


class WorkloadConflict(Exception):
    """A different spec is already there for this session id."""


class WorkloadStopping(Exception):
    """The workload under this session id is being deleted."""


class WorkloadRefused(Exception):
    """The runtime (or MPS) refused to start the workload, which is recorded as failed; ``code``
    names the refusal for the API."""

    def __init__(self, code: str, reason: str) -> None:
        super().__init__(reason)
        self.code, self.reason = code, reason


@dataclass
class Workload:
    session_id: str
    spec: dict  # the spec without its token
    fingerprint: str
    token_sha256: str
    plan: GpuPlan
    handle: RuntimeHandle | None  # None until the runtime started it
    state: str  # starting | running | exited | failed
    exit_reason: str | None = None
    started_at: str | None = None
    last_alive_at: str | None = None
    token: str | None = field(default=None, repr=False)  # memory only
    start_deadline: float = 0.0  # monotonic, while starting
    stopping: bool = False  # a delete is under way: the entry keeps its GPU slots until the workload ended
    warming: bool = False  # Jupyter answers; its welcome kernel is being started, then it runs
    # held while the runtime starts or stops this workload (never the table's lock)
    runtime_lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def record(self) -> dict:
        return {
            "session_id": self.session_id,
            "spec": self.spec,
            "fingerprint": self.fingerprint,
            "token_sha256": self.token_sha256,
            "plan": self.plan.to_json(),
            # the key records had before the handle: an upgraded agent adopts what an older one started
            "runtime_state": self.handle.to_json() if self.handle else None,
            "state": self.state,
            "exit_reason": self.exit_reason,
            "started_at": self.started_at,
            "last_alive_at": self.last_alive_at,
        }

    def status(self, figures: dict | None = None, activity: dict | None = None) -> dict:
        """The workload's status (docs/AGENT_PROTOCOL.md): ``figures`` are its GPU figures from NVML
        (agents/nvml/reader.py), ``activity`` what ``Workloads.activity`` found of it while it runs."""
        figures = figures or {}
        return {
            "session_id": self.session_id,
            "state": self.state,
            **(self.handle.reported() if self.handle else {"upstream": None, "enforcement": None}),
            "exit_reason": self.exit_reason,
            "started_at": self.started_at,
            "last_alive_at": self.last_alive_at,
            "gpu_plan": self.plan.wire,
            "gpu_util_percent": figures.get("gpu_util_percent"),
            "gpu_memory_used_mib": figures.get("gpu_memory_used_mib"),
            **({"activity": self._activity(figures, activity)} if activity is not None else {}),
        }

    @staticmethod
    def _activity(figures: dict, activity: dict) -> dict:
        return {
            "jupyter": activity.get("jupyter"),
            "cpu_seconds": activity.get("cpu_seconds"),
            "gpu_util_percent": figures.get("gpu_util_percent"),
            "gpu_memory_bytes": figures.get("gpu_memory_bytes"),
        }

    @property
    def live(self) -> bool:
        return self.state in ("starting", "running")


class Workloads:
    def __init__(
        self,
        *,
        runtime: Runtime,
        reader: GpuReader,
        tools: HostGpuTools,
        state_dir: Path,
        start_timeout_seconds: float = START_TIMEOUT_SECONDS,
    ) -> None:
        self.runtime = runtime
        self.reader = reader
        self.tools = tools
        self.state_dir = state_dir
        self.records_dir = state_dir / "workloads"
        self.records_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.mps = MpsDaemons(tools.mps_control)
        self.start_timeout_seconds = start_timeout_seconds
        self._lock = threading.RLock()
        self._table: dict[str, Workload] = {}

    # -- persistence --------------------------------------------------------------------------
    def _save(self, workload: Workload) -> None:
        path = self.records_dir / f"{workload.session_id}.json"
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            json.dump(workload.record(), out)
        os.replace(tmp, path)

    def _forget(self, session_id: str) -> None:
        (self.records_dir / f"{session_id}.json").unlink(missing_ok=True)

    def adopt(self) -> list[str]:
        """Load the records a previous agent left; workloads still alive are adopted, those that
        ended meanwhile are marked exited (or failed if they never answered). Returns the ids."""
        adopted = []
        for path in sorted(self.records_dir.glob("*.json")):
            workload = self._load(path)
            if workload is None:
                continue
            if workload.live:
                reason = self.runtime.poll(workload.handle) if workload.handle else "never started"
                if reason is None:
                    workload.start_deadline = time.monotonic() + self.start_timeout_seconds
                    self.mps.adopt(workload.session_id, workload.plan)
                else:
                    workload.exit_reason = f"ended while the agent was down: {reason}"
                    workload.state = "exited" if workload.state == "running" else "failed"
                    self._save(workload)
            with self._lock:
                self._table[workload.session_id] = workload
            adopted.append(workload.session_id)
        return adopted

    def _load(self, path: Path) -> Workload | None:
        try:
            record = json.loads(path.read_text())
            persisted = record["runtime_state"]
            return Workload(
                session_id=record["session_id"],
                spec=record["spec"],
                fingerprint=record["fingerprint"],
                token_sha256=record["token_sha256"],
                plan=GpuPlan.from_json(record["plan"]),
                handle=self.runtime.restore(persisted) if persisted else None,
                state=record["state"],
                exit_reason=record.get("exit_reason"),
                started_at=record.get("started_at"),
                last_alive_at=record.get("last_alive_at"),
            )
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("ignoring unreadable workload record %s: %s", path, exc)
            return None

    # -- commands -----------------------------------------------------------------------------
    def _running_shares(self) -> list:
        return [share for w in self._table.values() if w.live for share in w.plan.shares(w.session_id)]

    def put(self, spec: WorkloadSpec) -> tuple[bool, Workload]:
        """Create the workload (True) or find the same one (False), starting or not. The table's
        lock is held to reserve the entry and to record the result, never while the runtime starts
        it: a slow start delays no other call. Raises WorkloadConflict for a different spec under
        the same id, WorkloadStopping while that id is being deleted, PlanError for an allocation
        this host cannot serve (or slots a live workload holds), WorkloadRefused when the runtime
        or MPS refused to start it (recorded as failed). Any other error, the agent's own fault
        (its state dir, a bug), leaves no entry behind, so that the same PUT again starts afresh."""
        created, workload = self._reserve(spec)
        if not created:
            return False, workload
        try:
            handle = self._launch(spec, workload.plan)
        except (RuntimeStartError, MpsError) as exc:
            with self._lock:
                workload.state = "failed"
                workload.exit_reason = f"could not start: {exc}"
                self._save(workload)
            code = exc.code if isinstance(exc, RuntimeStartError) else "mps_unavailable"
            raise WorkloadRefused(code, workload.exit_reason)
        except BaseException:
            with self._lock:
                if self._table.get(spec.session_id) is workload:
                    del self._table[spec.session_id]
            raise
        else:
            with self._lock:
                workload.handle = handle
                self._save(workload)
        finally:
            workload.runtime_lock.release()
        return True, workload

    def _reserve(self, spec: WorkloadSpec) -> tuple[bool, Workload]:
        """The workload already under this id (False), or a new entry in state ``starting`` (True)
        whose ``runtime_lock`` the caller then holds (taken here, under the table's lock)."""
        fingerprint = spec.fingerprint()
        with self._lock:
            existing = self._table.get(spec.session_id)
            if existing is not None and existing.fingerprint == "":
                del self._table[spec.session_id]  # a refusal recorded by converge: try again
                existing = None
            if existing is not None:
                if existing.fingerprint != fingerprint:
                    raise WorkloadConflict(spec.session_id)
                if existing.stopping:
                    raise WorkloadStopping(spec.session_id)
                existing.token = spec.token
                return False, existing
            workload = self._new_workload(spec, fingerprint)
            workload.runtime_lock.acquire()
            self._table[spec.session_id] = workload
            return True, workload

    def _new_workload(self, spec: WorkloadSpec, fingerprint: str) -> Workload:
        """A workload in state ``starting`` with its GPU plan checked against every live one's
        (called under the table's lock)."""
        if spec.allocation is None:
            plan = cpu_plan()
        else:
            plan = gpu_plan(
                spec.allocation,
                self.reader.inventory(),
                running=self._running_shares(),
                tools=self.tools,
                session_id=spec.session_id,
            )
        spec_record = spec.to_json()
        spec_record.pop("token")
        return Workload(
            session_id=spec.session_id,
            spec=spec_record,
            fingerprint=fingerprint,
            token_sha256=spec.token_sha256(),
            plan=plan,
            handle=None,
            state="starting",
            started_at=now_iso(),
            token=spec.token,
            start_deadline=time.monotonic() + self.start_timeout_seconds,
        )

    def _launch(self, spec: WorkloadSpec, plan: GpuPlan) -> RuntimeHandle:
        self.mps.acquire(spec.session_id, plan)
        try:
            return self.runtime.start(spec, plan)
        except BaseException:
            self.mps.release(spec.session_id, plan)
            raise

    def delete(self, session_id: str) -> bool:
        """Stop the workload and everything it started, and forget it. Idempotent. A delete during
        the workload's start waits for that start (the workload's own lock, not the table's), then
        stops what it started; the entry keeps its GPU slots until the workload has ended."""
        with self._lock:
            workload = self._table.get(session_id)
            if workload is None:
                return False
            workload.stopping = True
        with workload.runtime_lock:
            if workload.handle is not None:
                self.runtime.stop(workload.handle)
                if workload.handle.run_dir:
                    shutil.rmtree(workload.handle.run_dir, ignore_errors=True)
            with self._lock:
                ended_here = self._table.get(session_id) is workload
                # live until now: no refresh saw it end, so its MPS share is released here, once
                holds_mps = ended_here and workload.live and workload.handle is not None
                if ended_here:
                    del self._table[session_id]
                    self._forget(session_id)
            if holds_mps:
                self.mps.release(session_id, workload.plan)
        return True

    def home_remove(self, user: str) -> None:
        """Remove ``user``'s home from this node's homes root (agents/homes.py). Raises HomeInUse while a
        workload of the user is starting, running or stopping, FileNotFoundError when there is no such
        home, ValueError for a name that is not a home's. The home is moved away under the table's lock
        (a PUT for the user reserved before it is refused here; one after it finds no home and makes a
        fresh one) and emptied after, with the lock released."""
        root = self.runtime.options.homes
        with self._lock:
            if any(w.spec.get("user") == user and (w.live or w.stopping) for w in self._table.values()):
                raise homes.HomeInUse(user)
            detached = homes.home_detach(root, user)
        homes.detached_remove(root, detached)

    def get(self, session_id: str) -> Workload | None:
        with self._lock:
            return self._table.get(session_id)

    def all(self) -> list[Workload]:
        with self._lock:
            return list(self._table.values())

    def starting(self) -> bool:
        with self._lock:
            return any(w.state == "starting" for w in self._table.values())

    # -- watching -----------------------------------------------------------------------------
    def refresh(self) -> None:
        """One pass over live workloads: note which answer, which ended, which never started. The
        runtime is asked, a workload past its start deadline stopped and an MPS daemon told to quit
        without the table's lock."""
        warm: list[Workload] = []
        ended: list[Workload] = []  # by itself, or stopped below: each releases its MPS share once
        expired: list[Workload] = []
        for workload in self.all():
            if not workload.live or workload.handle is None:
                continue
            reason = self.runtime.poll(workload.handle)
            ready = (
                reason is None
                and workload.state == "starting"
                and not workload.warming
                and self.runtime.ready(workload.handle, workload.token)
            )
            with self._lock:
                if self._table.get(workload.session_id) is not workload or not workload.live:
                    continue  # deleted or changed meanwhile
                before = (workload.state, workload.exit_reason)
                if reason is not None:
                    workload.state = "exited" if workload.state == "running" else "failed"
                    workload.exit_reason = reason
                    ended.append(workload)
                else:
                    workload.last_alive_at = now_iso()
                    if ready and workload.token and workload.handle.interface == "jupyterlab":
                        # runs once its welcome kernel is started
                        workload.warming = True
                        warm.append(workload)
                    elif ready:  # code-server, or adopted with its token not re-sent yet: nothing to warm
                        workload.state = "running"
                    elif workload.state == "starting" and time.monotonic() > workload.start_deadline:
                        workload.state = "failed"
                        workload.exit_reason = (
                            f"Jupyter did not answer within {self.start_timeout_seconds:.0f} s"
                        )
                        expired.append(workload)
                        ended.append(workload)
                if (workload.state, workload.exit_reason) != before:
                    self._save(workload)
        for workload in expired:
            with workload.runtime_lock:
                self.runtime.stop(workload.handle)
        for workload in ended:
            self.mps.release(workload.session_id, workload.plan)
        for workload in warm:
            threading.Thread(target=self._warm_up, args=(workload,), name="warm-up", daemon=True).start()

    def _warm_up(self, workload: Workload) -> None:
        """Start the welcome notebook's kernel, then report the workload running. Jupyter lists a kernel
        before it has a ``last_activity`` while it starts, and answers ``api/status`` and ``api/kernels``
        with a 500 meanwhile (jupyter_server's race): nobody is sent there before the kernel is in. A
        warm-up that fails still lets the workload run."""
        try:
            gateway.warm_up(workload.handle, workload.handle.base_url, workload.token)
        except (OSError, gateway.GatewayError, http.client.HTTPException) as exc:
            log.info("warm-up of %s: %s", workload.session_id, exc)
        with self._lock:
            workload.warming = False
            if self._table.get(workload.session_id) is not workload or not workload.live:
                return
            if workload.state == "starting":
                workload.state = "running"
                self._save(workload)

    def pids_by_session(self, children: dict[int, list[int]] | None = None) -> dict[str, set[int]]:
        gpu_workloads = [
            w for w in self.all() if w.live and w.handle is not None and w.plan.device_uuid is not None
        ]
        if not gpu_workloads:
            return {}
        children = children_by_parent() if children is None else children
        return {w.session_id: self.runtime.pids(w.handle, children) for w in gpu_workloads}

    def activity(self, children: dict[int, list[int]] | None = None) -> dict[str, dict]:
        """Per running workload, ``{"jupyter", "cpu_seconds"}``: its JupyterLab's activity, asked of
        every workload at once (each answer within JUPYTER_TIMEOUT_SECONDS, so a heartbeat waits about
        that long at most), and the CPU seconds of its processes (one /proc scan for all). A workload
        that cannot say gets nulls; nothing here raises."""
        running = [w for w in self.all() if w.state == "running" and w.handle is not None]
        if not running:
            return {}
        children = children_by_parent() if children is None else children
        with ThreadPoolExecutor(max_workers=min(8, len(running)), thread_name_prefix="activity") as pool:
            jupyter = list(pool.map(self._jupyter_activity, running))
        return {
            w.session_id: {"jupyter": found, "cpu_seconds": self._cpu_seconds(w, children)}
            for w, found in zip(running, jupyter, strict=True)
        }

    def _jupyter_activity(self, workload: Workload) -> dict | None:
        if workload.handle.interface != "jupyterlab":
            return None  # code-server has no Jupyter API to ask
        token = workload.token or self.runtime.jupyter_token(workload.handle)
        return jupyter_activity(workload.handle, token)

    def _cpu_seconds(self, workload: Workload, children: dict[int, list[int]]) -> float | None:
        try:
            return self.runtime.cpu_seconds(workload.handle, children)
        except Exception:  # noqa: BLE001 - a racing container or an engine away: no figure, still a beat
            log.info("no CPU figure for %s", workload.session_id, exc_info=True)
            return None

    def gpu_of_session(self) -> dict[str, str]:
        return {w.session_id: w.plan.gpu_uuid for w in self.all() if w.plan.gpu_uuid is not None}

    def statuses(self, per_session: dict[str, dict] | None = None) -> list[dict]:
        per_session = per_session or {}
        return [w.status(per_session.get(w.session_id)) for w in self.all()]

    # -- convergence --------------------------------------------------------------------------
    def converge(self, desired: list[Any]) -> None:
        """Start what the portal wants and is missing, stop what it no longer lists (orphans),
        leave the rest. A desired spec that cannot be served is recorded as failed, not retried."""
        wanted: dict[str, WorkloadSpec | None] = {}
        for raw in desired:
            session_id = raw.get("session_id") if isinstance(raw, dict) else None
            if not isinstance(session_id, str) or not SESSION_ID_RE.match(session_id):
                log.warning("ignoring a desired workload without a valid session_id")
                continue
            try:
                wanted[session_id] = parse_spec(raw)
            except SpecError as exc:
                wanted[session_id] = None
                self._record_refusal(session_id, f"invalid spec: {exc}")
        for workload in self.all():
            if workload.session_id not in wanted:
                log.info("stopping orphan workload %s", workload.session_id)
                self.delete(workload.session_id)
        for session_id, spec in wanted.items():
            if spec is None:
                continue
            try:
                self.put(spec)
            except WorkloadConflict:
                log.warning("workload %s differs from the portal's spec; left as it is", session_id)
            except WorkloadStopping:
                log.warning("workload %s is being deleted; the next heartbeat starts it again", session_id)
            except PlanError as exc:
                self._record_refusal(session_id, f"refused: {exc}")
            except WorkloadRefused:
                pass  # recorded as failed by put
            except Exception:  # the agent's own fault: nothing recorded, the next heartbeat tries again
                log.exception("could not start desired workload %s", session_id)

    def _record_refusal(self, session_id: str, reason: str) -> None:
        with self._lock:
            if session_id in self._table:
                return
            self._table[session_id] = Workload(
                session_id=session_id,
                spec={},
                fingerprint="",
                token_sha256="",
                plan=cpu_plan(),
                handle=None,
                state="failed",
                exit_reason=reason,
                started_at=now_iso(),
            )
