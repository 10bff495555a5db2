"""End to end: a user's own environment follows its user. Two real agents share one homes root (as in
test_e2e_homes); a venv made from a kernel on node-a, with a package installed in it, is saved on the
portal, and the next session, on node-b, runs its kernel from that venv and imports the package."""

from __future__ import annotations

import json
import shutil

import pytest

from provisioner.models import Device, Session
from provisioner.selectors import workload_user
from provisioner.services.environments import environment_save
from tests.agents.conftest import wait_for
from tests.agents.test_environments import _tiny_wheel
from tests.provisioner.conftest import ENV, make_user
from tests.provisioner.test_e2e_agents import agents, api_for, launch, portal, wait_state  # noqa: F401
from tests.provisioner.test_e2e_homes import _run

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_a_venv_saved_in_the_home_on_one_node_runs_the_next_sessions_kernel_on_another(
    portal,  # noqa: F811
    agents,  # noqa: F811
    tmp_path,
):
    homes = tmp_path / "shared-homes"
    homes.mkdir()
    for name in ("node-a", "node-b"):
        agents.options[name] = ["--homes-root", str(homes)]
    nodes = {name: agents.enroll_and_start(name) for name in ("node-a", "node-b")}
    wait_for(lambda: Device.objects.filter(node=nodes["node-b"]).count() == 9, 20, 0.2, "node-b's GPUs")
    alice = make_user("alice")
    api = api_for(portal, alice)
    on_a = launch(api)
    assert on_a["node"] == "node-a"
    assert wait_state(api, on_a["id"], ("running", "failed"))["state"] == "running"
    wheel = _tiny_wheel(tmp_path)
    shutil.copy(wheel, homes / workload_user(alice) / wheel.name)  # the user's upload
    made = _run(
        portal.url,
        on_a,
        alice,
        "import os, subprocess, sys\n"
        "venv = os.path.expanduser('~/.venvs/mine')\n"
        "subprocess.run([sys.executable, '-m', 'venv', '--system-site-packages', '--without-pip', venv], check=True)\n"
        f"done = subprocess.run([venv + '/bin/python', '-m', 'pip', 'install', '-q', '--no-index', '--no-deps', "
        f"os.path.expanduser('~/{wheel.name}')], capture_output=True, text=True)\n"
        "print(done.returncode, done.stderr[-400:].replace(chr(10), ' '))",
    )
    assert made.strip().startswith("0"), made
    assert api.post(f"/api/v1/sessions/{on_a['id']}/stop").status_code == 200
    wait_state(api, on_a["id"], ("stopped",), 30)

    environment_save(user=alice, name="mine", home_path=".venvs/mine", base=ENV)
    on_b = launch(api, gpu_model="H200", profile="1g.18gb", environment="mine:mine")
    assert on_b["node"] == "node-b"
    assert wait_state(api, on_b["id"], ("running", "failed"))["state"] == "running"
    seen = json.loads(
        _run(
            portal.url,
            on_b,
            alice,
            "import json, sys, tinymarker; print(json.dumps({'prefix': sys.prefix, 'value': tinymarker.VALUE}))",
        )
        .strip()
        .splitlines()[-1]
    )
    home_inside = f"/home/{workload_user(alice)}"
    assert seen == {"prefix": f"{home_inside}/.venvs/mine", "value": "installed in session 1"}


def test_a_saved_environment_missing_from_the_home_fails_its_session_saying_why(
    portal,  # noqa: F811
    agents,  # noqa: F811
):
    agents.enroll_and_start("node-a")
    wait_for(lambda: Device.objects.filter(node__name="node-a").exists(), 20, 0.2, "node-a's GPUs")
    alice = make_user("alice")
    api = api_for(portal, alice)
    environment_save(user=alice, name="ghost", home_path=".venvs/ghost", base=ENV)
    session = launch(api, environment="mine:ghost")
    failed = wait_state(api, session["id"], ("running", "failed"))
    assert failed["state"] == "failed"
    assert Session.objects.get(id=session["id"]).reason_key == "environment_unavailable"
    assert "The environment ghost is not available on node-a" in failed["reason"]
    assert "~/.venvs/ghost is not in the home folder" in failed["reason"]
