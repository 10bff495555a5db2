"""End to end: a home on a shared root follows its user. Two real agents (node-a and node-b, different
fleets, different state dirs) mount one homes root, as the nodes of a pool mount one NFS or CephFS
export. A file written from a kernel on node-a is read, and written again, by the next session on
node-b, run as the same uid; another user's session on node-b holds another uid.

This machine has no NFS server (no ``nfsd`` module in the container): a folder both agents share stands
in for the mount; the agents see it as they would see a network filesystem, through paths only."""

from __future__ import annotations

import json

import pytest
from django.test import Client

from provisioner.models import Device
from provisioner.selectors import workload_user
from tests.agents.conftest import run_in_kernel, wait_for
from tests.provisioner.conftest import make_user
from tests.provisioner.test_e2e_agents import agents, api_for, launch, portal, wait_state  # noqa: F401

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

WHO = "import os, json; print(json.dumps({'uid': os.getuid(), 'home': os.path.expanduser('~')}))"


def _cookie(user) -> dict[str, str]:
    browser = Client()
    browser.force_login(user)
    return {"Cookie": f"sessionid={browser.cookies['sessionid'].value}"}


def _run(portal_url: str, session: dict, user, code: str) -> str:
    return run_in_kernel(portal_url, f"/jupyter/{session['id']}/", code, headers=_cookie(user))


def test_a_file_written_on_one_node_is_read_and_written_by_the_next_session_on_another(
    portal,  # noqa: F811
    agents,  # noqa: F811
    tmp_path,
):
    homes = tmp_path / "shared-homes"
    homes.mkdir()
    for name in ("node-a", "node-b"):
        agents.options[name] = ["--homes-root", str(homes)]
    nodes = {name: agents.enroll_and_start(name) for name in ("node-a", "node-b")}
    wait_for(lambda: Device.objects.filter(node=nodes["node-a"]).count() == 6, 20, 0.2, "node-a's GPUs")
    wait_for(lambda: Device.objects.filter(node=nodes["node-b"]).count() == 9, 20, 0.2, "node-b's GPUs")
    alice, bob = make_user("alice"), make_user("bob")
    alice_api, bob_api = api_for(portal, alice), api_for(portal, bob)

    # bob comes to node-b first: a per-node uid table would give him the uid alice has on node-a
    bobs = launch(bob_api, gpu_model="H200", profile="1g.18gb")
    on_a = launch(alice_api)
    assert (bobs["node"], on_a["node"]) == ("node-b", "node-a")
    assert wait_state(bob_api, bobs["id"], ("running", "failed"))["state"] == "running"
    assert wait_state(alice_api, on_a["id"], ("running", "failed"))["state"] == "running"
    seen_a = json.loads(_run(portal.url, on_a, alice, f"open('notes.txt', 'w').write('from node-a'); {WHO}"))
    home = homes / workload_user(alice)
    assert (home / "notes.txt").read_text() == "from node-a"
    assert not (agents.state_dir("node-a") / "homes").exists()  # nothing node-local

    assert alice_api.post(f"/api/v1/sessions/{on_a['id']}/stop").status_code == 200
    wait_state(alice_api, on_a["id"], ("stopped",), 30)
    on_b = launch(alice_api, gpu_model="H200", profile="1g.18gb")
    assert on_b["node"] == "node-b"
    assert wait_state(alice_api, on_b["id"], ("running", "failed"))["state"] == "running"
    code = f"print(open('notes.txt').read()); open('notes.txt', 'a').write(', then node-b'); {WHO}"
    said, seen_b = _run(portal.url, on_b, alice, code).strip().splitlines()[-2:]
    assert said == "from node-a"
    assert (home / "notes.txt").read_text() == "from node-a, then node-b"
    assert json.loads(seen_b) == seen_a and seen_a["uid"] == home.stat().st_uid != 0
    bob_seen = json.loads(_run(portal.url, bobs, bob, WHO).strip().splitlines()[-1])
    assert bob_seen["uid"] not in (0, seen_a["uid"])
    assert {path.name for path in homes.iterdir()} == {workload_user(alice), workload_user(bob), ".suanli"}
