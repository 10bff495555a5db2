"""``make run``: the whole product on one machine, on the embedded PostgreSQL and Redis.

Starts the embedded services, migrates, seeds the demo, prints the URL and the demo logins, then hands
over to honcho, which runs every process of the Procfile and stops them all on Ctrl-C.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

from agents.sandbox import SandboxUnavailable, probe
from portal import embedded

ROOT = Path(__file__).resolve().parent.parent


def _say(line: str) -> None:
    print(f"suanli: {line}", flush=True)


def _fail(line: str) -> None:
    sys.stderr.write(f"suanli: {line}\n")
    raise SystemExit(1)


def _port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def main() -> None:
    os.chdir(ROOT)
    host = os.environ.get("HOST", "127.0.0.1")
    try:
        port = int(os.environ.get("PORT", "8000"))
    except ValueError:
        _fail(f"PORT={os.environ['PORT']!r} is not a port number.")
    os.environ["WEB_PORT"] = str(port)
    os.environ.setdefault("SITE_URL", f"http://{host}:{port}")

    data = embedded.data_dir()
    data.mkdir(parents=True, exist_ok=True)
    lock = (data / "run.lock").open("a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        _fail("another `make run` is already running from this folder; stop it with Ctrl-C first.")
    os.set_inheritable(lock.fileno(), True)  # held by honcho after exec, released when it ends
    if not _port_free(host, port):
        _fail(
            f"port {port} on {host} is already in use; stop what uses it or run `PORT={port + 1} make run`."
        )

    # Started here, once, for every process below: they find the servers by their socket paths.
    if any(embedded.wanted()):
        _say(f"starting the embedded PostgreSQL and Redis under {data} …")
        try:
            embedded.ensure_wanted()
        except embedded.EmbeddedServiceError as exc:
            _fail(str(exc))

    manage = [sys.executable, "manage.py"]
    _say("migrating the database …")
    subprocess.run([*manage, "migrate", "--no-input", "-v", "0"], check=True)
    subprocess.run([*manage, "collectstatic", "--no-input", "-v", "0"], check=True)
    _say("seeding the demo …")
    subprocess.run([*manage, "seed_demo", "--url", os.environ["SITE_URL"]], check=True)

    # The demo agents hide the portal's data folder (PostgreSQL, Redis, node tokens) from notebooks.
    os.environ.setdefault("AGENT_SANDBOX_HIDE", str(data))
    if not os.environ.get("AGENT_SANDBOX"):
        try:
            probe(shutil.which("bwrap"))
        except SandboxUnavailable as exc:
            os.environ["AGENT_SANDBOX"] = "none"
            _say(
                f"WARNING: notebooks run UNSANDBOXED on this machine: {exc}. "
                "That is safe for a single-user demo only."
            )
    # uvicorn runs this many web processes (its --workers default); each takes its share of the
    # database connections (portal/asgi.py).
    os.environ.setdefault("WEB_CONCURRENCY", str(os.cpu_count() or 1))
    honcho = shutil.which("honcho", path=str(Path(sys.executable).parent)) or "honcho"
    _say(
        f"starting web ({os.environ['WEB_CONCURRENCY']} processes), worker and beat; "
        f"open {os.environ['SITE_URL']}/ (Ctrl-C stops everything)"
    )
    os.execv(honcho, [honcho, "start", "-f", str(ROOT / "Procfile"), "-d", str(ROOT)])  # noqa: S606


if __name__ == "__main__":
    try:
        main()
    except subprocess.CalledProcessError as exc:
        _fail(f"`{' '.join(map(str, exc.cmd[1:]))}` failed (exit {exc.returncode}); see the lines above.")
    except KeyboardInterrupt:
        raise SystemExit(130)
