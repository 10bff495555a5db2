"""Benchmark: the Jupyter proxy against a direct connection and JupyterHub's configurable-http-proxy.

One real JupyterLab; small HTTP requests (``GET …/api/status``) and WebSocket round trips
(``kernel_info_request`` on a kernel's channels) sent to it directly, through our proxy (uvicorn, the
same ``JupyterProxy`` the portal serves, with the route looked up as in production but from a fixed
table), and through configurable-http-proxy (npm, installed under .data/bench on first run), in the
same run. Prints p50/p99 in milliseconds and the ratios. Never fails on a time.

    .venv/bin/python bench/proxy.py [--requests 2000] [--ws-rounds 300]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import shutil
import socket
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import websockets

ROOT = Path(__file__).resolve().parent.parent
SESSION = "bench"
TOKEN = os.environ.get("BENCH_TOKEN") or secrets.token_hex(24)


def make_app():
    """uvicorn factory for the proxy process: the portal's proxy with a fixed route table."""
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
    import django

    django.setup()
    from portal.proxy import JupyterProxy, Route

    upstream = os.environ["BENCH_UPSTREAM"]
    routes = {("bench-cookie", SESSION): Route(upstream, os.environ["BENCH_TOKEN"], scheme="token")}
    return JupyterProxy(resolver=lambda cookie, session: routes.get((cookie, session)))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_http(url: str, headers: dict, seconds: float = 90) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, headers=headers, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"bench: {url} did not answer")


def _chp_binary(data: Path) -> str | None:
    prefix = data / "chp"
    binary = prefix / "node_modules" / ".bin" / "configurable-http-proxy"
    if not binary.exists() and shutil.which("npm"):
        print("bench: installing configurable-http-proxy from the npm registry …", flush=True)
        subprocess.run(
            [
                "npm",
                "install",
                "--silent",
                "--no-audit",
                "--no-fund",
                "--prefix",
                str(prefix),
                "configurable-http-proxy@5",
            ],
            check=False,
        )
    return str(binary) if binary.exists() else None


def _percentiles(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    return statistics.median(ordered), ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


def _http_round_trips(base: str, headers: dict, cookies: dict, count: int) -> list[float]:
    url = f"{base}/jupyter/{SESSION}/api/status"
    with httpx.Client(headers=headers, cookies=cookies) as client:
        for _ in range(50):
            client.get(url)
        samples = []
        for _ in range(count):
            started = time.perf_counter()
            response = client.get(url)
            samples.append((time.perf_counter() - started) * 1000)
            if response.status_code != 200:
                raise SystemExit(f"bench: {url} answered {response.status_code}")
    return samples


async def _ws_round_trips(
    ws_base: str, kernel_id: str, headers: dict, origin: str, rounds: int
) -> list[float]:
    uri = f"{ws_base}/jupyter/{SESSION}/api/kernels/{kernel_id}/channels"
    async with websockets.connect(uri, additional_headers=headers, origin=origin, max_size=None) as ws:
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--ws-rounds", type=int, default=300)
    args = parser.parse_args()

    data = Path(os.environ.setdefault("SUANLI_DATA_DIR", str(ROOT / ".data" / "bench")))
    data.mkdir(parents=True, exist_ok=True)
    home = data / "jupyter-home"
    home.mkdir(exist_ok=True)
    jupyter_port, proxy_port, chp_port = _free_port(), _free_port(), _free_port()
    upstream = f"http://127.0.0.1:{jupyter_port}"
    env = {**os.environ, "HOME": str(home), "BENCH_UPSTREAM": upstream, "BENCH_TOKEN": TOKEN,
           "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '/usr/bin:/bin')}"}  # fmt: skip
    processes = []
    try:
        processes.append(subprocess.Popen(
            [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--allow-root", f"--port={jupyter_port}",
             "--ip=127.0.0.1", f"--ServerApp.base_url=/jupyter/{SESSION}/",
             f"--IdentityProvider.token={TOKEN}", f"--ServerApp.root_dir={home}"],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        ))  # fmt: skip
        processes.append(subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "--factory", "proxy:make_app", "--app-dir", str(ROOT / "bench"),
             "--host", "127.0.0.1", "--port", str(proxy_port), "--log-level", "warning", "--no-access-log",
             "--ws-per-message-deflate", "false"],
            env=env, cwd=ROOT,
        ))  # fmt: skip
        chp = _chp_binary(data)
        if chp:
            processes.append(subprocess.Popen(
                [chp, "--ip", "127.0.0.1", "--port", str(chp_port), "--default-target", upstream,
                 "--api-port", str(_free_port()), "--log-level", "warn"],
                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            ))  # fmt: skip
        token_header = {"Authorization": f"token {TOKEN}"}
        _wait_http(f"{upstream}/jupyter/{SESSION}/api/status", token_header)
        _wait_http(
            f"http://127.0.0.1:{proxy_port}/jupyter/{SESSION}/api/status",
            {"Cookie": "sessionid=bench-cookie"},
        )
        if chp:
            _wait_http(f"http://127.0.0.1:{chp_port}/jupyter/{SESSION}/api/status", token_header)
        kernel = httpx.post(
            f"{upstream}/jupyter/{SESSION}/api/kernels", headers=token_header, json={}
        ).json()["id"]
        time.sleep(2)

        paths = {
            "direct": (f"http://127.0.0.1:{jupyter_port}", token_header, {}),
            "ours": (f"http://127.0.0.1:{proxy_port}", {}, {"sessionid": "bench-cookie"}),
        }
        if chp:
            paths["chp"] = (f"http://127.0.0.1:{chp_port}", token_header, {})
        # Interleave the paths in blocks so that load from elsewhere on the machine hits all of them alike.
        http_samples = {name: [] for name in paths}
        ws_samples = {name: [] for name in paths}
        blocks = 5
        for _ in range(blocks):
            for name, (base, headers, cookies) in paths.items():
                http_samples[name] += _http_round_trips(base, headers, cookies, args.requests // blocks)
                ws_headers = dict(headers) if headers else {"Cookie": "sessionid=bench-cookie"}
                ws_base = "ws" + base.removeprefix("http")
                ws_samples[name] += asyncio.run(
                    _ws_round_trips(ws_base, kernel, ws_headers, base, args.ws_rounds // blocks)
                )
        results = {name: (_percentiles(http_samples[name]), _percentiles(ws_samples[name])) for name in paths}
        print(
            f"\nJupyter proxy benchmark: {args.requests} HTTP requests, "
            f"{args.ws_rounds} WebSocket round trips each"
        )
        print(f"{'path':<8} {'HTTP p50':>9} {'HTTP p99':>9} {'WS p50':>8} {'WS p99':>8}   (milliseconds)")
        for name, ((h50, h99), (w50, w99)) in results.items():
            print(f"{name:<8} {h50:9.3f} {h99:9.3f} {w50:8.3f} {w99:8.3f}")
        (d50, _), (dw50, _) = results["direct"]
        (o50, _), (ow50, _) = results["ours"]
        print(f"\nours / direct, HTTP p50: {o50 / d50:.2f}x   (target <= 1.5x)")
        print(f"ours - direct, WS p50:  {ow50 - dw50:+.3f} ms")
        if "chp" in results:
            (c50, _), (cw50, _) = results["chp"]
            print(f"chp / direct, HTTP p50: {c50 / d50:.2f}x;  chp - direct, WS p50: {cw50 - dw50:+.3f} ms")
            print(f"ours vs chp: HTTP p50 {o50 / c50:.2f}x, WS p50 {ow50 / cw50:.2f}x   (target <= 1.0x)")
        else:
            print("configurable-http-proxy: not measured (npm or the registry unavailable)")
    finally:
        for process in reversed(processes):
            process.terminate()
        for process in processes:
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()


if __name__ == "__main__":
    main()
