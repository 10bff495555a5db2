"""The real product as processes on a data directory of its own, for ``make chaos`` and ``make load``.

Every process gets explicit ``DATABASE_URL`` and ``REDIS_URL`` (so none of them restarts the embedded
Redis behind the fault injector's back) and its own PostgreSQL ``application_name`` (so the injector can
see which worker holds the metering tick's advisory lock). Ports are fixed for the whole run, so a
restarted web or agent comes back where the others look for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

import httpx

ROOT = Path(__file__).resolve().parent.parent
FLEETS = ROOT / "agents" / "fleets"
PASSWORD = "chaos-pass-phrase-42"  # noqa: S105 - users of a throwaway data directory


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for(predicate, *, timeout: float, interval: float = 0.2, what: str) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            if value := predicate():
                return value
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")


@dataclass
class Proc:
    """One product process, started in a session of its own (so a kill reaches its whole group)."""

    name: str
    command: list[str]
    env: dict
    log: Path
    popen: subprocess.Popen | None = None
    nice: int = 0  # also the niceness of its session's scheduling group (see ``start``)

    def start(self) -> Proc:
        out = self.log.open("ab")
        out.write(f"\n===== start {time.strftime('%H:%M:%S')} =====\n".encode())
        out.flush()
        self.popen = subprocess.Popen(  # noqa: S603 - our own commands
            self.command, cwd=ROOT, env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        out.close()
        if self.nice:
            # With the kernel's autogroups (sched_autogroup_enabled), a process's niceness counts only
            # against the processes of its own session: a new session competes with the others as an
            # equal, whatever its processes' niceness, unless its group is niced too.
            with contextlib.suppress(OSError):
                Path(f"/proc/{self.popen.pid}/autogroup").write_text(str(self.nice))
        return self

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.popen is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, sig)
        if sig == signal.SIGKILL:
            self.popen.wait()

    def stop(self, timeout: float = 15) -> None:
        if not self.alive():
            return
        self.kill(signal.SIGTERM)
        try:
            self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def tail(self, chars: int = 2000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""


class DelayProxy:
    """A TCP proxy in front of one agent that holds each chunk of the agent's answers for ``delay_seconds``
    (0: pass straight through). The node's address points here, so every portal → agent call is slowed."""

    def __init__(self, *, target_port: int) -> None:
        self.target_port = target_port
        self.port = free_port()
        self.delay_seconds = 0.0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        threading.Thread(target=self._serve, name="delay-proxy", daemon=True).start()
        self._ready.wait(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(asyncio.start_server(self._client, "127.0.0.1", self.port))
        self._ready.set()
        self._loop.run_forever()
        server.close()

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.close()
            return

        async def pipe(source, sink, delayed: bool) -> None:
            with contextlib.suppress(OSError, asyncio.CancelledError):
                while chunk := await source.read(65536):
                    if delayed and self.delay_seconds:
                        await asyncio.sleep(self.delay_seconds)
                    sink.write(chunk)
                    await sink.drain()
            with contextlib.suppress(OSError):
                sink.close()

        await asyncio.gather(pipe(reader, up_writer, False), pipe(up_reader, writer, True))


@dataclass
class Timings:
    """Short intervals, so a ten-minute run holds many ticks, sweeps and outages."""

    metering_tick_seconds: float = 1.0
    posting_interval_seconds: int = 3
    node_liveness_seconds: int = 10
    liveness_sweep_seconds: float = 1.0
    queue_dispatch_seconds: float = 2.0
    heartbeat_seconds: int = 1
    agent_http_timeout_seconds: float = 3.0

    def env(self) -> dict[str, str]:
        return {
            "METERING_TICK_SECONDS": str(self.metering_tick_seconds),
            "BILLING_POSTING_INTERVAL_SECONDS": str(self.posting_interval_seconds),
            "NODE_LIVENESS_SECONDS": str(self.node_liveness_seconds),
            "NODE_LIVENESS_SWEEP_SECONDS": str(self.liveness_sweep_seconds),
            "QUEUE_DISPATCH_SECONDS": str(self.queue_dispatch_seconds),
            "AGENT_HEARTBEAT_INTERVAL_SECONDS": str(self.heartbeat_seconds),
            "AGENT_HTTP_TIMEOUT_SECONDS": str(self.agent_http_timeout_seconds),
            "SESSION_LIMITS_SWEEP_SECONDS": "5",
            "SESSION_START_TIMEOUT_SECONDS": "150",
        }


@dataclass
class Agent:
    node: str
    fleet: Path
    port: int
    token: str
    proc: Proc
    node_id: int = 0
    delay: DelayProxy | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def workloads(self) -> list[dict]:
        """The agent's own list (``GET /v1/workloads`` with its node token)."""
        answer = httpx.get(
            f"{self.url}/v1/workloads", headers={"Authorization": f"Bearer {self.token}"}, timeout=10
        )
        answer.raise_for_status()
        return answer.json()["workloads"]


@dataclass
class Stack:
    """The processes of one run. ``prepare`` wipes and starts the embedded services and migrates."""

    data_dir: Path
    timings: Timings = field(default_factory=Timings)
    extra_env: dict = field(default_factory=dict)
    web_port: int = field(default_factory=free_port)
    web: Proc | None = None
    workers: list[Proc] = field(default_factory=list)
    beat: Proc | None = None
    agents: dict[str, Agent] = field(default_factory=dict)
    # > 0: agents and their workloads run at this niceness, standing in for the GPU hosts they are in
    # production, whose CPU is not the portal's (make load: the portal's figures on shared cores)
    agent_nice: int = 0
    # > 0: and in a CPU control group of this weight (a process of the portal weighs 1024), with the
    # JupyterLabs they start: those start in sessions of their own, where the agent's niceness does not
    # reach (see ``Proc.start``). Where no cgroup can be made, the niceness alone.
    agent_cpu_shares: int = 0
    agents_grouped: bool = False  # whether they are in that group
    database_url: str = ""
    redis_url: str = ""
    secret_key: str = field(default_factory=lambda: secrets.token_urlsafe(50))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.web_port}"

    @property
    def log_dir(self) -> Path:
        return self.data_dir / "logs"

    # -- the embedded services ----------------------------------------------------------------------

    def prepare(self) -> None:
        """A fresh data directory with PostgreSQL and Redis running, migrated; Django set up here."""
        os.environ["SUANLI_DATA_DIR"] = str(self.data_dir)
        from portal import embedded

        with contextlib.suppress(Exception):
            embedded.stop()
        kill_leftovers(self.data_dir)
        shutil.rmtree(self.data_dir, ignore_errors=True)
        self.log_dir.mkdir(parents=True)
        urls = embedded.ensure()
        self.database_url, self.redis_url = urls.database_url, urls.redis_url
        os.environ.update(self.env("driver"))
        subprocess.run(
            [sys.executable, "manage.py", "migrate", "--no-input", "-v", "0"],
            cwd=ROOT,
            env=self.env("migrate"),
            check=True,
        )
        import django

        django.setup()

    def env(self, name: str) -> dict[str, str]:
        return {
            **os.environ,
            "SUANLI_DATA_DIR": str(self.data_dir),
            "DATABASE_URL": f"{self.database_url}&application_name={quote(name)}",
            "REDIS_URL": self.redis_url,
            "DJANGO_SETTINGS_MODULE": "portal.settings",
            "PYTHONPATH": str(ROOT),
            "PYTHONUNBUFFERED": "1",
            "SITE_URL": self.url,
            # As production runs (docker-compose.yml): DEBUG off, which also stops Django recording every
            # query; the loopback is plain HTTP, so the cookies are not marked Secure.
            "DEBUG": "0",
            "SECRET_KEY": self.secret_key,
            "SESSION_COOKIE_SECURE": "0",
            "CSRF_COOKIE_SECURE": "0",
            "API_RATE_PER_USER": "1000000/min",
            "CARD_REDEEM_RATE_PER_MINUTE": "1000",
            **self.timings.env(),
            **self.extra_env,
        }

    def redis_stop(self, *, kill: bool) -> None:
        pid_file = self.data_dir / "redis" / "redis.pid"
        pid = int(pid_file.read_text().strip())
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL if kill else signal.SIGTERM)
        wait_for(lambda: not Path(f"/proc/{pid}").exists(), timeout=20, what="Redis to exit")

    def redis_start(self) -> None:
        from portal import embedded

        embedded.ensure(postgres=False, redis=True)

    # -- the product's processes --------------------------------------------------------------------

    def _proc(self, name: str, command: list[str], env: dict | None = None) -> Proc:
        return Proc(name, command, env or self.env(name), self.log_dir / f"{name}.log")

    def start_web(self) -> Proc:
        command = [
            sys.executable, "-m", "uvicorn", "portal.asgi:application", "--host", "127.0.0.1",
            "--port", str(self.web_port), "--no-access-log",
            "--ws", "portal.ws_relay:WebSocketRelay", "--ws-per-message-deflate", "false",
        ]  # fmt: skip
        self.web = self._proc("web", command).start()
        wait_for(self._web_up, timeout=90, what=f"the portal to answer\n{self.web.tail()}")
        return self.web

    def _web_up(self) -> bool:
        if not self.web.alive():
            raise RuntimeError(f"the portal exited:\n{self.web.tail()}")
        return httpx.get(f"{self.url}/login/", timeout=3).status_code == 200

    def start_worker(self, index: int) -> Proc:
        name = f"worker-{index}"
        command = [
            sys.executable, "-m", "celery", "-A", "portal", "worker", "--loglevel", "INFO",
            "--pool", "threads", "--concurrency", "4", "--without-gossip", "--without-mingle",
            "--hostname", f"chaos-{index}-{time.monotonic_ns()}@%h",
        ]  # fmt: skip
        proc = self._proc(name, command).start()
        if index < len(self.workers):
            self.workers[index] = proc
        else:
            self.workers.append(proc)
        return proc

    def start_beat(self) -> Proc:
        command = [
            sys.executable, "-m", "celery", "-A", "portal", "beat", "--loglevel", "INFO",
            "--schedule", str(self.data_dir / "celerybeat-schedule"),
        ]  # fmt: skip
        self.beat = self._proc("beat", command).start()
        return self.beat

    def enrol_agent(self, node: str, fleet: Path, *, delayed: bool = False) -> Agent:
        """Enrol the node (best-effort slices: no HAMi-core here) and start its agent."""
        from provisioner.models import Node
        from provisioner.services.nodes import node_enroll

        port = free_port()
        delay = DelayProxy(target_port=port) if delayed else None
        address = delay.url if delay else f"http://127.0.0.1:{port}"
        enrolment = node_enroll(name=node, address=address, labels={"sharing_policy": "best-effort"})
        Node.objects.filter(id=enrolment.node.id).update(address=address)
        state = self.data_dir / "agents" / node
        state.mkdir(parents=True, exist_ok=True)
        token_file = state / "token"
        token_file.write_text(enrolment.token)
        token_file.chmod(0o600)
        command = [
            sys.executable, "-m", "agents", "--listen", f"127.0.0.1:{port}", "--token-file", str(token_file),
            "--portal", self.url, "--runtime", "process", "--state-dir", str(state), "--fleet", str(fleet),
            "--heartbeat-seconds", str(self.timings.heartbeat_seconds), "--sandbox", "none",
        ]  # fmt: skip
        if self.agent_nice:
            command = ["nice", "-n", str(self.agent_nice), *command]  # nice execs: same pid, same group
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
        proc = self._proc(f"agent-{node}", command, env)
        proc.nice = self.agent_nice
        agent = Agent(node, fleet, port, enrolment.token, proc, delay=delay)
        agent.node_id = enrolment.node.id
        self.agents[node] = agent
        self.start_agent(agent)
        return agent

    def start_agent(self, agent: Agent) -> None:
        agent.proc.start()
        if self.agent_cpu_shares and (procs := self._host_group()) is not None:
            with contextlib.suppress(OSError):
                procs.write_text(str(agent.proc.popen.pid))  # its children start in the group too
                self.agents_grouped = True
        wait_for(
            lambda: httpx.get(f"{agent.url}/v1/health", timeout=2).status_code in (200, 401),
            timeout=60,
            what=f"agent {agent.node}\n{agent.proc.tail()}",
        )

    def _host_group(self) -> Path | None:
        """The ``cgroup.procs`` of the agents' CPU group (cgroup v1's cpu controller, or v2's), made
        with ``agent_cpu_shares``; None where this machine lets no group be made."""
        name = f"suanli-hosts-{zlib.crc32(str(self.data_dir).encode()):08x}"
        for root, weight_file, weight in (
            (Path("/sys/fs/cgroup/cpu"), "cpu.shares", self.agent_cpu_shares),
            (Path("/sys/fs/cgroup"), "cpu.weight", max(1, self.agent_cpu_shares * 100 // 1024)),
        ):
            if not (root / weight_file).exists() and "cpu" not in _read(root / "cgroup.subtree_control"):
                continue  # no such controller there
            group = root / name
            try:
                group.mkdir(exist_ok=True)
                (group / weight_file).write_text(str(weight))
            except OSError:
                with contextlib.suppress(OSError):
                    group.rmdir()
                continue
            return group / "cgroup.procs"
        return None

    def shutdown(self) -> None:
        from portal import embedded

        for proc in [*(a.proc for a in self.agents.values()), self.beat, *self.workers, self.web]:
            if proc is not None:
                proc.stop(timeout=10)
        with contextlib.suppress(Exception):
            embedded.stop()
        kill_leftovers(self.data_dir)
        self.host_group_remove()

    def host_group_remove(self) -> None:
        """Remove the agents' CPU group, once the processes killed in it are gone."""
        if self.agent_cpu_shares and (procs := self._host_group()) is not None:
            with contextlib.suppress(TimeoutError):
                wait_for(lambda: procs.parent.rmdir() or True, timeout=10, what="the agents' CPU group")


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def kill_leftovers(data_dir: Path) -> list[int]:
    """SIGKILL, one by one, processes started for this data directory that outlived the run (Jupyter
    workloads an agent left running, a stray server): those whose command line names the directory."""
    mark = str(data_dir).encode()
    killed = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{entry.name}/cmdline").read_bytes()
        except OSError:
            continue
        if mark in cmdline:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(int(entry.name), signal.SIGKILL)
                killed.append(int(entry.name))
    return killed


# --- the world: catalog, prices, users ------------------------------------------------------------

A100, T4, H200 = "A100-SXM4-80GB", "T4", "H200"
ENVIRONMENT = "chaos-python"
# Odd prices, so a second billed twice or a rounding slip shows in the micros.
PRICES = [(A100, 7_200_001), (T4, 1_800_007), (H200, 18_000_011)]
BURN_RATES = [(A100, 2000), (T4, 500), (H200, 4000)]


@dataclass
class User:
    username: str
    user_id: int
    account_id: int
    token: str  # personal access token for the API
    cookie: str  # a logged-in Django session, for the dashboard and the Jupyter proxy
    card: bool = False


def seed_catalog() -> None:
    from billing.services.pricing import burn_rate_set, price_set
    from provisioner.demo import seed_hardware
    from provisioner.models import Environment

    seed_hardware()
    Environment.objects.update_or_create(
        name=ENVIRONMENT, defaults={"python": sys.executable, "cpu_cores": 1.0, "memory_mib": 4096}
    )
    for model, micros in PRICES:
        price_set(gpu_model=model, profile="whole", price_micros_per_hour=micros, reason="chaos seed")
    for model, milli in BURN_RATES:
        burn_rate_set(gpu_model=model, multiplier_milli=milli, reason="chaos seed")


def seed_users(count: int, *, prefix: str, wallet_micros: int, cards: int = 0) -> list[User]:
    """``count`` users, each funded with ``wallet_micros``; the first ``cards`` also redeem a small
    compute card (so card burn and the card → wallet hand-over are exercised)."""
    from billing.services.cards import card_batch_issue, card_redeem
    from billing.services.topups import wallet_credit_promotion
    from portal.services import access_token_create, user_create

    users = []
    codes = (
        card_batch_issue(hours_micros=30_000, count=cards, valid_days=30, label="chaos")[1] if cards else []
    )
    for i in range(count):
        name = f"{prefix}{i:02d}"
        user = user_create(username=name, email=f"{name}@example.com", password=PASSWORD)
        wallet_credit_promotion(
            account=user.account, amount_micros=wallet_micros, idempotency_key=f"seed-{name}"
        )
        if i < len(codes):
            card_redeem(user=user, account=user.account, code=codes[i])
        _token, raw = access_token_create(user=user, name="chaos", scopes=["read", "sessions"])
        users.append(User(name, user.pk, user.account_id, raw, login_cookie(user), card=i < len(codes)))
    return users


def login_cookie(user) -> str:
    """A logged-in Django session for ``user``, as its cookie's value (made as Django's login makes it)."""
    from django.conf import settings
    from django.test import Client

    client = Client()
    client.force_login(user)
    return client.cookies[settings.SESSION_COOKIE_NAME].value


def db_now():
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT clock_timestamp()")
        return cursor.fetchone()[0]
