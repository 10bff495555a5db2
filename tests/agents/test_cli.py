"""Bad options end the agent with one clear line on stderr and exit code 2."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys

import pynvml
import pytest

from tests.agents.conftest import CI_FLEET, REPO, free_port

pytestmark = pytest.mark.slow


def _run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "agents", *args], cwd=REPO, capture_output=True, text=True, timeout=30, env=env
    )


def _one_line_error(result: subprocess.CompletedProcess, *needles: str) -> None:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_bad_options(tmp_path, token_file):
    base = ["--token-file", str(token_file), "--state-dir", str(tmp_path / "s"), "--fleet", str(CI_FLEET)]
    _one_line_error(_run("--bogus"), "unrecognized arguments")
    _one_line_error(_run("--state-dir", str(tmp_path)), "--token-file")
    _one_line_error(_run(*base, "--listen", "nowhere"), "--listen")
    _one_line_error(_run(*base, "--runtime", "kubernetes"), "--runtime")
    _one_line_error(_run(*base, "--portal", "ftp://x"), "--portal")
    _one_line_error(_run("--token-file", str(tmp_path / "missing"), "--state-dir", str(tmp_path)), "missing")
    _one_line_error(_run(*base, "--heartbeat-seconds", "soon"), "heartbeat")
    _one_line_error(_run(*base, "--homes-root", str(tmp_path / "unmounted")), "--homes-root", "not a folder")
    _one_line_error(_run(*base, "--team-gids", "70000"), "--team-gids", "FIRST-LAST")
    _one_line_error(_run(*base, "--team-gids", "64000-70000"), "--team-gids", "overlaps --sandbox-uids")


def _nvml_initialises() -> bool:
    """Whether this host has a working NVML (a GPU driver): there the agent starts without --fleet."""
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    pynvml.nvmlShutdown()
    return True


@pytest.mark.skipif(_nvml_initialises(), reason="this host's NVML works: the agent starts without --fleet")
def test_without_fleet_and_without_a_gpu_driver_says_so(tmp_path, token_file):
    result = _run("--token-file", str(token_file), "--state-dir", str(tmp_path / "s"))
    _one_line_error(
        result, "agents: error: NVML is not available (", "on a host without GPUs pass --fleet FILE"
    )
    assert not (tmp_path / "s").exists()  # it stopped before touching its state dir


def test_bad_fleet_file_names_the_line(tmp_path, token_file):
    fleet = tmp_path / "bad.yaml"
    fleet.write_text("node: n1\ngpus:\n  - model: A100-SXM4-80GB\n    memory_mib: 81920\n    colour: red\n")
    result = _run("--token-file", str(token_file), "--state-dir", str(tmp_path / "s"), "--fleet", str(fleet))
    _one_line_error(result, f"{fleet}:5", "colour")


def test_options_from_the_environment(tmp_path, token_file):
    env = {**os.environ, "AGENT_TOKEN_FILE": str(token_file), "AGENT_STATE_DIR": str(tmp_path / "s"),
           "AGENT_FLEET": str(CI_FLEET), "AGENT_LISTEN": "127.0.0.1:notaport"}  # fmt: skip
    _one_line_error(_run(env=env), "--listen", "notaport")


def test_listen_port_in_use(tmp_path, token_file):
    port = free_port()
    with socket.socket() as busy:
        busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        busy.bind(("127.0.0.1", port))
        busy.listen()
        result = _run(
            "--listen", f"127.0.0.1:{port}", "--token-file", str(token_file),
            "--state-dir", str(tmp_path / "s"), "--fleet", str(CI_FLEET),
        )  # fmt: skip
    _one_line_error(result, "address already in use", str(port))


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")
def test_the_self_check_runs_the_sandbox_per_gpu_and_sees_only_that_gpu(tmp_path):
    devices = tmp_path / "dev"
    devices.mkdir()
    for name in ["nvidiactl", "nvidia-uvm", *(f"nvidia{i}" for i in range(6))]:
        (devices / name).write_text(name)
    fleet = REPO / "agents" / "fleets" / "node-a.yaml"
    result = subprocess.run(
        [sys.executable, "-m", "agents", "check", "--fleet", str(fleet), "--device-dir", str(devices)],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert sum(line.startswith("PASS  GPU ") for line in lines) == 6
    assert "/dev: nvidia-uvm, nvidia3, nvidiactl)" in result.stdout  # GPU 3 sees nvidia3 and no other
    assert "libvgpu.so absent" in result.stdout and lines[-1] == "all checks passed"
    broken = subprocess.run(
        [sys.executable, "-m", "agents", "check", "--fleet", str(tmp_path / "missing.yaml")],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert broken.returncode == 1 and broken.stdout.startswith("FAIL  NVML")
