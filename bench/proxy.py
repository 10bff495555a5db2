"""Benchmark: the production path to a notebook against a direct connection and JupyterHub's
configurable-http-proxy.

One real JupyterLab, started by a real agent (process runtime, sandboxed with bubblewrap where it can
be) on a Unix socket in the session's private folder. Small HTTP requests (``GET …/api/status``) and
WebSocket round trips (``kernel_info_request`` on a kernel's channels) go, in the same run:

- ``direct``: straight to the socket, with the Jupyter token;
- ``gateway``: to the agent's gateway alone (node token; the agent adds the Jupyter token);
- ``ours``: the production path, portal proxy (uvicorn, the same ``JupyterProxy`` the portal serves,
  routed from a fixed table) → agent gateway → socket;
- ``asgi-ws``: the same portal proxy served with uvicorn's own WebSocket protocol, so kernel messages go
  through its ASGI path (parsed and framed again) instead of ``portal/ws_relay.py``'s byte relay: the
  baseline for the relay, in the same run;
- ``chp``: configurable-http-proxy (npm, installed under .data/bench on first run) → the same socket.

Prints p50/p99 in milliseconds and the ratios, and the CPU time the proxies on each path spent per
request and per round trip (from /proc: on a shared machine latencies follow the load, CPU time much
less). Never fails on a time.

    .venv/bin/python bench/proxy.py [--requests 2000] [--ws-rounds 300]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.parse
import uuid
from dataclasses import dataclass
from pathlib import Path

import httpx
from websockets.asyncio.client import connect, unix_connect

ROOT = Path(__file__).resolve().parent.parent
SESSION = "bench"
JUPYTER_TOKEN = secrets.token_hex(24)
NODE_TOKEN = secrets.token_hex(24)
COOKIE = "bench-cookie"


def make_app():
    """uvicorn factory for the proxy process: the portal's proxy with a fixed route table, forwarding
    to the agent's gateway with the node token, as the portal does."""
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
    import django

    django.setup()
    from portal.proxy import JupyterProxy, Route

    route = Route(os.environ["BENCH_AGENT"], os.environ["BENCH_NODE_TOKEN"], scheme="Bearer")
    routes = {(COOKIE, SESSION): route}
    return JupyterProxy(resolver=lambda cookie, session: routes.get((cookie, session)))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait(check, what: str, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except (httpx.HTTPError, OSError, KeyError, ValueError):
            pass
        time.sleep(0.2)
    raise SystemExit(f"bench: {what} did not come up")


def _chp_binary(data: Path) -> str | None:
    """configurable-http-proxy 5.x: the first to proxy to a Unix socket (``unix+http://``)."""
    prefix = data / "chp"
    binary = prefix / "node_modules" / ".bin" / "configurable-http-proxy"
    if not binary.exists() and shutil.which("npm"):
        print("bench: installing configurable-http-proxy from the npm registry …", flush=True)
        subprocess.run(
            ["npm", "install", "--silent", "--no-audit", "--no-fund", "--prefix", str(prefix),
             "configurable-http-proxy@5"],
            check=False,
        )  # fmt: skip
    return str(binary) if binary.exists() else None


def _cpu_seconds(pids: list[int]) -> float:
    """User and system time of these processes (all their threads) so far."""
    total = 0.0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def _percentiles(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    return statistics.median(ordered), ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


@dataclass(frozen=True)
class Way:
    """One way to the JupyterLab: where to connect (a TCP base URL, or a Unix socket) and how to
    authenticate."""

    base: str
    headers: dict
    cookies: dict
    uds: str | None = None

    def client(self) -> httpx.Client:
        transport = httpx.HTTPTransport(uds=self.uds) if self.uds else None
        return httpx.Client(
            base_url=self.base, headers=self.headers, cookies=self.cookies, transport=transport
        )

    def ws_connect(self, uri_path: str):
        uri = "ws" + self.base.removeprefix("http") + uri_path
        headers = dict(self.headers)
        if self.cookies:
            headers["Cookie"] = "; ".join(f"{k}={v}" for k, v in self.cookies.items())
        if self.uds:
            return unix_connect(self.uds, uri, additional_headers=headers, origin=self.base, max_size=None)
        return connect(uri, additional_headers=headers, origin=self.base, max_size=None)


def _http_round_trips(path: Way, count: int) -> list[float]:
    url = f"/jupyter/{SESSION}/api/status"
    with path.client() as client:
        for _ in range(50):
            client.get(url)
        samples = []
        for _ in range(count):
            started = time.perf_counter()
            response = client.get(url)
            samples.append((time.perf_counter() - started) * 1000)
            if response.status_code != 200:
                raise SystemExit(f"bench: {path.base}{url} answered {response.status_code}")
    return samples


async def _ws_round_trips(path: Way, kernel_id: str, rounds: int) -> list[float]:
    async with path.ws_connect(f"/jupyter/{SESSION}/api/kernels/{kernel_id}/channels") as ws:
        session = uuid.uuid4().hex
        samples = []
        for index in range(rounds + 10):
            msg_id = uuid.uuid4().hex
            message = {
                "header": {"msg_id": msg_id, "username": "bench", "session": session,
                           "msg_type": "kernel_info_request", "version": "5.3"},
                "parent_header": {}, "metadata": {}, "content": {}, "channel": "shell",
            }  # fmt: skip
            started = time.perf_counter()
            await ws.send(json.dumps(message))
            while True:
                reply = json.loads(await ws.recv())
                if (
                    reply["msg_type"] == "kernel_info_reply"
                    and reply["parent_header"].get("msg_id") == msg_id
                ):
                    break
            if index >= 10:
                samples.append((time.perf_counter() - started) * 1000)
    return samples


def _start_agent(data: Path, env: dict, port: int) -> tuple[subprocess.Popen, str]:
    """A real agent on the fake CI fleet; sandboxed with bubblewrap where this machine can."""
    token_file = data / "node-token"
    token_file.write_text(NODE_TOKEN + "\n")
    state = data / "agent-state"
    shutil.rmtree(state, ignore_errors=True)
    sandbox = "bwrap" if shutil.which("bwrap") and os.geteuid() == 0 else "none"
    command = [
        sys.executable, "-m", "agents", "--listen", f"127.0.0.1:{port}", "--token-file", str(token_file),
        "--state-dir", str(state), "--fleet", str(ROOT / "agents" / "fleets" / "ci-small.yaml"),
        "--runtime", "process", "--sandbox", sandbox, "--sandbox-hide", str(ROOT / ".data"),
    ]  # fmt: skip
    log = open(data / "agent.log", "wb")  # noqa: SIM115 - lives as long as the agent
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT), sandbox


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--ws-rounds", type=int, default=300)
    args = parser.parse_args()

    data = Path(os.environ.setdefault("SUANLI_DATA_DIR", str(ROOT / ".data" / "bench")))
    data.mkdir(parents=True, exist_ok=True)
    agent_port, proxy_port, chp_port = _free_port(), _free_port(), _free_port()
    agent_url = f"http://127.0.0.1:{agent_port}"
    env = {**os.environ, "BENCH_AGENT": agent_url, "BENCH_NODE_TOKEN": NODE_TOKEN,
           "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '/usr/bin:/bin')}"}  # fmt: skip
    processes = []
    node = {"Authorization": f"Bearer {NODE_TOKEN}"}
    try:
        agent, sandbox = _start_agent(data, env, agent_port)
        processes.append(agent)
        _wait(lambda: httpx.get(f"{agent_url}/v1/health", headers=node).status_code == 200, "the agent")
        spec = {
            "session_id": SESSION, "user": "bench", "token": JUPYTER_TOKEN,
            "base_url": f"/jupyter/{SESSION}/",
            "environment": {"name": "python-3.11", "python": None, "image": None}, "allocation": None,
            "limits": {"cpu_cores": 2.0, "memory_mib": 4096},
        }  # fmt: skip
        created = httpx.put(f"{agent_url}/v1/workloads/{SESSION}", headers=node, json=spec, timeout=30)
        if created.status_code not in (200, 201):
            raise SystemExit(f"bench: the agent refused the workload: {created.text}")

        def running() -> bool:
            status = httpx.get(f"{agent_url}/v1/workloads/{SESSION}", headers=node).json()
            if status.get("state") in ("failed", "stopped"):
                raise SystemExit(f"bench: the workload {status.get('state')}: {status}")
            return status.get("state") == "running"

        _wait(running, "the sandboxed JupyterLab")
        upstream = httpx.get(f"{agent_url}/v1/workloads/{SESSION}", headers=node).json()["upstream"]
        sock = upstream.removeprefix("unix:")
        if not sock.startswith("/"):
            raise SystemExit(f"bench: expected a Unix socket upstream, got {upstream!r}")

        def serve_proxy(port: int, ws: str) -> subprocess.Popen:
            return subprocess.Popen(
                [sys.executable, "-m", "uvicorn", "--factory", "proxy:make_app",
                 "--app-dir", str(ROOT / "bench"), "--host", "127.0.0.1", "--port", str(port),
                 "--log-level", "warning", "--no-access-log", "--ws", ws, "--ws-per-message-deflate", "false",
                 *os.environ.get("BENCH_UVICORN", "").split()],
                env=env, cwd=ROOT,
            )  # fmt: skip

        proxy = serve_proxy(proxy_port, "portal.ws_relay:WebSocketRelay")  # as the portal is served
        asgi_port = _free_port()
        asgi_proxy = serve_proxy(asgi_port, "auto")  # the same proxy, WebSockets through its ASGI path
        processes += [proxy, asgi_proxy]
        chp = _chp_binary(data)
        if chp:
            target = "unix+http://" + urllib.parse.quote(sock, safe="")
            processes.append(subprocess.Popen(
                [chp, "--ip", "127.0.0.1", "--port", str(chp_port), "--default-target", target,
                 "--api-port", str(_free_port()), "--log-level", "warn"],
                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            ))  # fmt: skip
        jupyter = {"Authorization": f"token {JUPYTER_TOKEN}"}
        paths = {
            "direct": Way("http://localhost", jupyter, {}, uds=sock),
            "gateway": Way(agent_url, node, {}),
            "ours": Way(f"http://127.0.0.1:{proxy_port}", {}, {"sessionid": COOKIE}),
            "asgi-ws": Way(f"http://127.0.0.1:{asgi_port}", {}, {"sessionid": COOKIE}),
        }
        if chp:
            paths["chp"] = Way(f"http://127.0.0.1:{chp_port}", jupyter, {})
        status = f"/jupyter/{SESSION}/api/status"
        for name, path in paths.items():
            _wait(lambda path=path: path.client().get(status).status_code == 200, name)
        with paths["direct"].client() as client:
            kernel = client.post(f"/jupyter/{SESSION}/api/kernels", json={}).json()["id"]
        time.sleep(2)

        # The proxies each path goes through, whose CPU time it is charged.
        on_path = {
            "direct": [],
            "gateway": [agent.pid],
            "ours": [agent.pid, proxy.pid],
            "asgi-ws": [agent.pid, asgi_proxy.pid],
        }
        if chp:
            on_path["chp"] = [processes[-1].pid]
        # Interleave the paths in blocks so that load from elsewhere on the machine hits all of them alike.
        http_samples = {name: [] for name in paths}
        ws_samples = {name: [] for name in paths}
        http_cpu = dict.fromkeys(paths, 0.0)
        ws_cpu = dict.fromkeys(paths, 0.0)
        blocks = 5
        for _ in range(blocks):
            for name, path in paths.items():
                started = _cpu_seconds(on_path[name])
                http_samples[name] += _http_round_trips(path, args.requests // blocks)
                between = _cpu_seconds(on_path[name])
                ws_samples[name] += asyncio.run(_ws_round_trips(path, kernel, args.ws_rounds // blocks))
                http_cpu[name] += between - started
                ws_cpu[name] += _cpu_seconds(on_path[name]) - between
        results = {name: (_percentiles(http_samples[name]), _percentiles(ws_samples[name])) for name in paths}
        print(
            f"\nJupyter proxy benchmark: {args.requests} HTTP requests, {args.ws_rounds} WebSocket round "
            f"trips each; JupyterLab on a Unix socket, agent sandbox: {sandbox}"
        )
        print(
            f"{'path':<8} {'HTTP p50':>9} {'HTTP p99':>9} {'WS p50':>8} {'WS p99':>8}   (milliseconds)"
            f"   {'proxy CPU/request':>17} {'/WS round':>9}   (microseconds)"
        )
        warm_up = 50 * blocks, 10 * blocks  # the rounds each block runs before it samples
        for name, ((h50, h99), (w50, w99)) in results.items():
            per_request = http_cpu[name] / (len(http_samples[name]) + warm_up[0]) * 1e6
            per_round = ws_cpu[name] / (len(ws_samples[name]) + warm_up[1]) * 1e6
            print(
                f"{name:<8} {h50:9.3f} {h99:9.3f} {w50:8.3f} {w99:8.3f}"
                f"                  {per_request:17.0f} {per_round:9.0f}"
            )
        (d50, _), (dw50, _) = results["direct"]
        (o50, _), (ow50, _) = results["ours"]
        (g50, _), _ = results["gateway"]
        load = " ".join(f"{x:.2f}" for x in os.getloadavg())
        print(f"load average at the end: {load} on {os.cpu_count()} CPUs")
        print(f"\nours (portal -> agent -> socket) / direct, HTTP p50: {o50 / d50:.2f}x   (target <= 1.5x)")
        print(f"gateway alone / direct, HTTP p50: {g50 / d50:.2f}x")
        print(f"ours - direct, WS p50: {ow50 - dw50:+.3f} ms")
        _, (aw50, _) = results["asgi-ws"]
        print(
            f"ours (WebSocket relayed as bytes) / asgi-ws (frames through ASGI), WS p50: {ow50 / aw50:.2f}x"
        )
        if "chp" in results:
            (c50, _), (cw50, _) = results["chp"]
            print(f"chp / direct, HTTP p50: {c50 / d50:.2f}x;  chp - direct, WS p50: {cw50 - dw50:+.3f} ms")
            print(f"ours vs chp: HTTP p50 {o50 / c50:.2f}x, WS p50 {ow50 / cw50:.2f}x   (target <= 1.0x)")
            cpu = {n: ws_cpu[n] / (len(ws_samples[n]) + warm_up[1]) * 1e6 for n in ("ours", "chp")}
            print(
                f"ours vs chp: proxy CPU per WebSocket round trip {cpu['ours']:.0f} vs {cpu['chp']:.0f} us "
                "(two hops against one; the steadier figure on a shared machine)"
            )
        else:
            print("configurable-http-proxy: not measured (npm or the registry unavailable)")
    finally:
        for process in reversed(processes):
            process.send_signal(signal.SIGTERM)
        for process in processes:
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
        _end_workloads(data / "agent-state")


def _end_workloads(state: Path) -> None:
    """Workloads outlive their agent by design (it re-adopts them on restart); end the bench's."""
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                if str(state).encode() in f.read():
                    os.kill(int(name), signal.SIGKILL)
        except OSError:
            continue


if __name__ == "__main__":
    main()
