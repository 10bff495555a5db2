"""Stopping the embedded servers: by their pid files, only processes of this data directory, and
PostgreSQL waited for. Stand-in processes play the servers (a real initdb takes a while)."""

import signal
import subprocess
import sys
import time
from pathlib import Path

from portal import embedded

# Exits on SIGINT after removing its pid file, as the postmaster does after a fast shutdown.
POSTMASTER = """
import os, signal, sys, time
def down(*_):
    os.remove(os.path.join(sys.argv[1], "postmaster.pid"))
    sys.exit(0)
signal.signal(signal.SIGINT, down)
print("up", flush=True)
time.sleep(60)
"""


def _server(code: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, text=True)


def _pid_file(path: Path, pid: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{pid}\n")


def test_stop_ends_both_servers_and_waits_for_postgresql(tmp_path, monkeypatch):
    data = tmp_path / "data"
    monkeypatch.setenv("SUANLI_DATA_DIR", str(data))
    redis = _server("import time; time.sleep(60)", str(data / "redis" / "redis.sock"))
    postmaster = _server(POSTMASTER, str(data / "pg"))
    try:
        assert postmaster.stdout.readline().strip() == "up"  # its SIGINT handler is in place
        _pid_file(data / "redis" / "redis.pid", redis.pid)
        _pid_file(data / "pg" / "postmaster.pid", postmaster.pid)
        started = time.monotonic()
        embedded.stop(wait_seconds=20)
        assert not (data / "pg" / "postmaster.pid").exists()  # waited until PostgreSQL was down
        assert postmaster.wait(5) == 0
        assert redis.wait(5) == -signal.SIGTERM
        assert time.monotonic() - started < 20
    finally:
        for process in (redis, postmaster):
            process.kill()
            process.wait()


def test_stop_leaves_alone_a_process_a_stale_pid_file_names(tmp_path, monkeypatch):
    data = tmp_path / "data"
    monkeypatch.setenv("SUANLI_DATA_DIR", str(data))
    unrelated = _server("import time; time.sleep(60)")  # its command line does not name the data dir
    try:
        _pid_file(data / "redis" / "redis.pid", unrelated.pid)
        _pid_file(data / "pg" / "postmaster.pid", unrelated.pid)
        embedded.stop(wait_seconds=20)
        assert unrelated.poll() is None
    finally:
        unrelated.kill()
        unrelated.wait()
