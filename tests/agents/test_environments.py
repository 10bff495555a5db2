"""Environments on the process runtime (agents/environments.py): the kernel runs from the environment's
prefix, inside the sandbox, for an operator's prefix and for a user's own venv kept in their home."""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from agents.environments import EnvironmentUnavailable, home_prefix_error, home_prefix_resolve, present
from agents.heartbeat import build_heartbeat
from agents.nvml import GpuReader, nvml_source
from agents.spec import SpecError, parse_spec
from tests.agents.conftest import CI_FLEET, run_in_kernel, wait_for, workload_spec

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")
WHERE = (
    "import json, os, sys; cmd = open(f'/proc/{os.getppid()}/cmdline').read().split(chr(0));"
    "print(json.dumps({'prefix': sys.prefix, 'executable': sys.executable, 'server': cmd[0]}))"
)


def _venv(path: Path, *, system_site: bool = True) -> Path:
    """A virtualenv made from the running interpreter's base, without pip: a second prefix."""
    flags = ["--system-site-packages"] if system_site else []
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", *flags, str(path)], check=True, timeout=120
    )
    return path


def _site(prefix: Path) -> Path:
    return prefix / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"


def _last_json(output: str) -> dict:
    return json.loads(output.strip().splitlines()[-1])


# --- the home prefix: checked by the spec, then on the node -----------------------------------------


@pytest.mark.parametrize("bad", ["", "/abs/venv", "~/venv", "../other/venv", ".venvs/../../x", "a//b", "./v"])
def test_a_home_prefix_must_be_a_plain_relative_path(bad):
    assert home_prefix_error(bad) is not None
    with pytest.raises(SpecError) as refused:
        parse_spec(workload_spec("s-1", None, environment={"name": "mine", "python": None, "image": None,
                                                          "home_prefix": bad}))  # fmt: skip
    assert "environment.home_prefix" in refused.value.fields


def test_a_spec_without_home_prefix_keeps_its_fingerprint():
    plain = parse_spec(workload_spec("s-1", None))
    assert "home_prefix" not in plain.to_json()["environment"]
    mine = parse_spec(
        workload_spec(
            "s-1", None, environment={"name": "m", "python": None, "image": None, "home_prefix": ".v/m"}
        )
    )
    assert mine.environment.home_prefix == ".v/m" and mine.fingerprint() != plain.fingerprint()


def test_a_home_prefix_that_leads_out_of_the_home_by_a_link_is_refused(tmp_path):
    home, outside = tmp_path / "homes" / "alice", _venv(tmp_path / "elsewhere" / "venv")
    (home / ".venvs").mkdir(parents=True)
    (home / ".venvs" / "escape").symlink_to(outside)
    (home / ".venvs" / "up").symlink_to(tmp_path / "homes" / "bob")
    with pytest.raises(EnvironmentUnavailable, match="outside the home"):
        home_prefix_resolve(home, ".venvs/escape")
    with pytest.raises(EnvironmentUnavailable, match="outside the home"):
        home_prefix_resolve(home, ".venvs/up")
    (home / "notes").mkdir()
    with pytest.raises(EnvironmentUnavailable, match="neither a virtualenv nor a conda prefix|no bin/python"):
        home_prefix_resolve(home, "notes")
    with pytest.raises(EnvironmentUnavailable, match="not in the home folder"):
        home_prefix_resolve(home, ".venvs/missing")
    _venv(home / ".venvs" / "mine")
    (home / "link").symlink_to(home / ".venvs")  # a link that stays inside is followed
    assert str(home_prefix_resolve(home, "link/mine")) == ".venvs/mine"


def test_the_heartbeat_reports_the_interpreters_this_node_has(tmp_path):
    missing = str(tmp_path / "nowhere" / "bin" / "python")
    other = _venv(tmp_path / "other")
    served = present([str(other / "bin" / "python"), missing, "relative/python"])
    assert served == [str(other / "bin" / "python")]
    reader = GpuReader(nvml_source("fake", fleet_path=str(CI_FLEET)).open())
    body = build_heartbeat(
        listen_url="http://127.0.0.1:1",
        runtime="process",
        reader=reader,
        workloads=[],
        pids_by_session={},
        environments=served,
    )
    assert body["capabilities"]["environments"] == sorted([sys.executable, *served])  # its own, always


# --- real workloads ----------------------------------------------------------------------------------


@pytest.mark.slow
@needs_bwrap
def test_the_kernel_runs_from_the_environments_prefix_and_refuses_one_the_node_lacks(start_agent, tmp_path):
    # A prefix without JupyterLab: the server runs from the agent's, the kernel from the prefix.
    plain = _venv(tmp_path / "envs" / "plain")
    (_site(plain) / "suanli_marker.py").write_text("NAME = 'plain'\n")
    # A prefix with JupyterLab (the agent's packages through a .pth): server and kernel run from it.
    lab = _venv(tmp_path / "envs" / "lab", system_site=False)
    agent_site = next(p for p in sys.path if p.endswith("site-packages") and p.startswith(sys.prefix))
    (_site(lab) / "agent_packages.pth").write_text(agent_site + "\n")
    agent = start_agent(tmp_path / "state", "--sandbox", "bwrap")

    missing = workload_spec(
        "env-missing", None, environment={"name": "py3.12", "python": "/opt/py3.12/bin/python", "image": None}
    )
    refused = agent.put_workload(missing)
    assert refused.status_code == 422 and refused.json()["error"]["code"] == "environment_unavailable"

    for name, prefix in (("plain", plain), ("lab", lab)):
        python = str(prefix / "bin" / "python")
        spec = workload_spec(f"env-{name}", None, environment={"name": name, "python": python, "image": None})
        assert agent.put_workload(spec).status_code == 201
        agent.wait_state(spec["session_id"], ("running",), timeout=90)
        seen = _last_json(run_in_kernel(agent.url, spec["base_url"], WHERE))
        assert seen["prefix"] == str(prefix) and seen["executable"] == python
        assert seen["server"] == (python if name == "lab" else sys.executable)
        if name == "plain":
            marker = run_in_kernel(
                agent.url, spec["base_url"], "import suanli_marker; print(suanli_marker.NAME)"
            )
            assert marker.strip() == "plain"
        assert agent.client.delete(f"/v1/workloads/{spec['session_id']}").status_code in (200, 202, 204)


def _tiny_wheel(tmp_path: Path) -> Path:
    """A wheel of a two-file project (the module and its metadata), written here: no network, and no
    ``wheel`` package for pip to build one with. pip installs it as any other wheel."""
    files = {
        "tinymarker.py": b"VALUE = 'installed in session 1'\n",
        "tinymarker-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: tinymarker\nVersion: 1.0\n",
        "tinymarker-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
        b"Tag: py3-none-any\n",
    }
    record = [
        f"{name},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},"
        f"{len(data)}"
        for name, data in files.items()
    ]
    files["tinymarker-1.0.dist-info/RECORD"] = (
        "\n".join([*record, "tinymarker-1.0.dist-info/RECORD,,"]) + "\n"
    ).encode()
    wheel = tmp_path / "tinymarker-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for name, data in files.items():
            archive.writestr(name, data)
    return wheel


@pytest.mark.slow
@needs_bwrap
def test_a_users_venv_in_their_home_keeps_its_packages_for_the_next_session(start_agent, tmp_path):
    wheel = _tiny_wheel(tmp_path)
    state = tmp_path / "state"
    agent = start_agent(state, "--sandbox", "bwrap")
    first = workload_spec("venv-1", None)
    assert agent.put_workload(first).status_code == 201
    agent.wait_state("venv-1", ("running",), timeout=90)
    shutil.copy(wheel, state / "homes" / "alice" / wheel.name)  # the user's upload
    made = run_in_kernel(
        agent.url,
        first["base_url"],
        "import os, subprocess, sys\n"
        "venv = os.path.expanduser('~/.venvs/mine')\n"
        "subprocess.run([sys.executable, '-m', 'venv', '--system-site-packages', '--without-pip', venv], check=True)\n"
        f"done = subprocess.run([venv + '/bin/python', '-m', 'pip', 'install', '-q', '--no-index', '--no-deps', "
        f"os.path.expanduser('~/{wheel.name}')], capture_output=True, text=True)\n"
        "print(done.returncode, done.stderr[-400:].replace(chr(10), ' '))",
        timeout=180,
    )
    assert made.strip().startswith("0"), made
    assert agent.client.delete("/v1/workloads/venv-1").status_code in (200, 202, 204)
    wait_for(lambda: agent.get("/v1/workloads/venv-1").status_code == 404, 30, 0.2, "first session gone")

    mine = {"name": "mine", "python": None, "image": None, "home_prefix": ".venvs/mine"}
    second = workload_spec("venv-2", None, environment=mine)
    assert agent.put_workload(second).status_code == 201
    agent.wait_state("venv-2", ("running",), timeout=90)
    seen = _last_json(
        run_in_kernel(
            agent.url,
            second["base_url"],
            "import json, sys, tinymarker; print(json.dumps({'prefix': sys.prefix, "
            "'executable': sys.executable, 'value': tinymarker.VALUE}))",
        )
    )
    assert seen == {
        "prefix": "/home/alice/.venvs/mine",
        "executable": "/home/alice/.venvs/mine/bin/python",
        "value": "installed in session 1",
    }

    # A prefix that leads out of the home by a link is refused when the session starts.
    (state / "homes" / "alice" / ".venvs" / "escape").symlink_to(_venv(tmp_path / "outside"))
    escape = workload_spec("venv-3", None, environment={**mine, "home_prefix": ".venvs/escape"})
    refused = agent.put_workload(escape)
    assert refused.status_code == 422 and refused.json()["error"]["code"] == "environment_unavailable"
    assert "outside the home" in refused.json()["error"]["message"]
