"""The fault schedule and the injectors. Each kind of fault runs on its own thread along the run, so faults
overlap the way they do in production (Redis restarting while an agent is gone, a worker killed while
the web restarts). Every fault is recorded with database-clock times, for the checks and the report.

- ``worker-kill``: SIGKILL the Celery worker that holds the metering tick's advisory lock, caught in the
  act (``pg_locks`` joined to ``pg_stat_activity``'s ``application_name``), then start it again.
- ``agent-kill``: SIGKILL a node agent, keep it away past the liveness window, bring it back on the same
  port and state directory (it adopts its workloads and must drop those the portal has given up).
- ``redis-restart``: SIGKILL (or SIGTERM) the embedded Redis, start it again a few seconds later.
- ``web-restart``: restart the web process while WebSocket traffic runs through the Jupyter proxy.
- ``agent-delay``: the delaying proxy in front of one agent holds its answers (below and above the
  portal's agent HTTP timeout).
"""

from __future__ import annotations

import random
import signal
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime

import psycopg

from billing.services.metering import TICK_LOCK_KEY
from chaos.stack import Stack, db_now, wait_for
from chaos.traffic import Traffic


@dataclass
class Fault:
    kind: str
    target: str
    at: datetime
    until: datetime | None = None
    detail: str = ""


@dataclass
class Plan:
    """How many faults of each kind, spread over ``seconds`` (after the warm-up)."""

    seconds: float
    worker_kills: int
    agent_kills: int
    redis_restarts: int
    web_restarts: int
    delay_periods: int

    @classmethod
    def full(cls) -> Plan:
        return cls(
            seconds=480, worker_kills=24, agent_kills=3, redis_restarts=2, web_restarts=2, delay_periods=2
        )

    @classmethod
    def short(cls) -> Plan:
        return cls(
            seconds=130, worker_kills=8, agent_kills=1, redis_restarts=1, web_restarts=1, delay_periods=1
        )


def _spread(count: int, start: float, end: float, rng: random.Random) -> list[float]:
    if count <= 0:
        return []
    step = (end - start) / count
    return [start + step * i + rng.uniform(0, step * 0.5) for i in range(count)]


@dataclass
class Injector:
    stack: Stack
    traffic: Traffic
    plan: Plan
    seed: int = 11
    faults: list[Fault] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # an injector that could not do its job
    _lock: threading.Lock = field(default_factory=threading.Lock)
    # set while a killed agent is away: a web restart waits for it to be back, so the WebSocket it cuts
    # belongs to a session that still runs and can reconnect (not one its node's death just ended)
    _agent_away: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        """Inject the whole plan; returns when every fault is over and every process is back."""
        self.t0 = time.monotonic()
        rng = random.Random(self.seed)
        s = self.plan.seconds
        jobs = [
            (self._worker_kills, _spread(self.plan.worker_kills, 0.02 * s, 0.95 * s, rng)),
            (self._agent_kills, _spread(self.plan.agent_kills, 0.12 * s, 0.8 * s, rng)),
            (self._redis_restarts, _spread(self.plan.redis_restarts, 0.3 * s, 0.9 * s, rng)),
            (self._web_restarts, _spread(self.plan.web_restarts, 0.45 * s, 0.95 * s, rng)),
            (self._delays, _spread(self.plan.delay_periods, 0.05 * s, 0.7 * s, rng)),
        ]
        threads = [
            threading.Thread(target=self._guarded, args=(job, times), name=job.__name__, daemon=True)
            for job, times in jobs
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    def _guarded(self, job, times: list[float]) -> None:
        try:
            job(times)
        except Exception as exc:
            self.problems.append(f"{job.__name__}: {type(exc).__name__}: {exc}")

    def _sleep_until(self, offset: float) -> None:
        time.sleep(max(0.0, self.t0 + offset - time.monotonic()))

    def _record(self, fault: Fault) -> Fault:
        with self._lock:
            self.faults.append(fault)
        return fault

    def count(self, kind: str) -> int:
        return sum(1 for f in self.faults if f.kind == kind)

    # -- Celery workers ----------------------------------------------------------------------------------

    def _tick_holder(self, conn: psycopg.Connection, seconds: float) -> str | None:
        """The application_name of the worker holding the metering tick's lock, caught within
        ``seconds``, or None."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            row = conn.execute(
                "SELECT a.application_name FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
                "WHERE l.locktype = 'advisory' AND l.granted AND l.classid = 0 AND l.objid::bigint = %s",
                [TICK_LOCK_KEY],
            ).fetchone()
            if row and row[0].startswith("worker-"):
                return row[0]
            time.sleep(0.003)
        return None

    def _worker_kills(self, times: list[float]) -> None:
        rng = random.Random(self.seed + 1)
        url = self.stack.database_url + "&application_name=chaos-injector"
        with psycopg.connect(url, autocommit=True) as conn:
            for offset in times:
                self._sleep_until(offset)
                holder = self._tick_holder(conn, 5.0)
                index = int(holder.split("-")[1]) if holder else rng.randrange(len(self.stack.workers))
                at = db_now()
                self.stack.workers[index].kill(signal.SIGKILL)
                time.sleep(rng.uniform(0.5, 2.5))
                self.stack.start_worker(index)
                detail = "in a metering tick (held the tick lock)" if holder else "not caught in a tick"
                self._record(Fault("worker-kill", f"worker-{index}", at, db_now(), detail))

    # -- agents ------------------------------------------------------------------------------------------

    def _agent_kills(self, times: list[float]) -> None:
        from provisioner.models import Session

        nodes = list(self.stack.agents)
        for i, offset in enumerate(times):
            self._sleep_until(offset)
            # the node with the most running sessions (ties: in turn), so the kill loses something
            busy = {n: Session.objects.filter(node__name=n, state="running").count() for n in nodes}
            node = max(nodes, key=lambda n: (busy[n], -((nodes.index(n) - i) % len(nodes))))
            agent = self.stack.agents[node]
            at = db_now()
            self._agent_away.set()
            agent.proc.kill(signal.SIGKILL)
            time.sleep(self.stack.timings.node_liveness_seconds + 8)
            self.stack.start_agent(agent)
            self._agent_away.clear()
            self._record(
                Fault("agent-kill", node, at, db_now(), f"{busy[node]} running sessions at the kill")
            )

    # -- Redis ---------------------------------------------------------------------------------------------

    def _redis_restarts(self, times: list[float]) -> None:
        for i, offset in enumerate(times):
            self._sleep_until(offset)
            kill = i % 2 == 0
            at = db_now()
            self.stack.redis_stop(kill=kill)
            time.sleep(3)
            self.stack.redis_start()
            self._record(Fault("redis-restart", "redis", at, db_now(), "SIGKILL" if kill else "SIGTERM"))

    # -- web -------------------------------------------------------------------------------------------------

    def _web_restarts(self, times: list[float]) -> None:
        for i, offset in enumerate(times):
            self._sleep_until(offset)
            try:
                wait_for(
                    lambda: not self._agent_away.is_set() and self.traffic.ws.open_now > 0,
                    timeout=90,
                    interval=0.5,
                    what="WebSocket traffic, every agent up",
                )
                open_ws = self.traffic.ws.open_now
            except TimeoutError:
                open_ws = 0
            before = self.traffic.ws.round_trips
            at = db_now()
            wall = time.time()
            sig = signal.SIGTERM if i % 2 == 0 else signal.SIGKILL
            if sig == signal.SIGTERM:
                self.stack.web.stop(timeout=10)
            else:
                self.stack.web.kill(signal.SIGKILL)
            self.stack.start_web()
            until = db_now()
            try:
                wait_for(
                    lambda wall=wall: any(t > wall for t in self.traffic.ws.ok_at[-50:]),
                    timeout=150,
                    interval=0.5,
                    what="a WebSocket round trip after the restart",
                )
                resumed = "WebSocket round trips resumed"
            except TimeoutError:
                resumed = "NO WebSocket round trip after the restart"
                self.problems.append(f"web restart {i + 1}: {resumed}")
            detail = (
                f"{'SIGTERM' if sig == signal.SIGTERM else 'SIGKILL'} with {open_ws} WebSockets open "
                f"({before} round trips before); {resumed}"
            )
            self._record(Fault("web-restart", "web", at, until, detail))

    # -- slow agent answers ------------------------------------------------------------------------------

    def _delays(self, times: list[float]) -> None:
        delayed = [a for a in self.stack.agents.values() if a.delay is not None]
        if not delayed:
            return
        agent = delayed[0]
        timeout = self.stack.timings.agent_http_timeout_seconds
        for i, offset in enumerate(times):
            self._sleep_until(offset)
            seconds = timeout * 0.5 if i % 2 == 0 else timeout + 1.5
            at = db_now()
            agent.delay.delay_seconds = seconds
            time.sleep(30)
            agent.delay.delay_seconds = 0.0
            how = "below" if seconds < timeout else "above"
            detail = f"{seconds:.1f} s per answer for 30 s ({how} the {timeout:.0f} s agent HTTP timeout)"
            self._record(Fault("agent-delay", agent.node, at, db_now(), detail))
