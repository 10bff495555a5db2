"""End to end: a home on a shared root follows its user across hosts. Two real agents (node-a and
node-b, different fleets, different state dirs), each in a network namespace of its own that the test
creates and removes, mount one homes root, as the nodes of a pool mount one NFS or CephFS export. The
portal stays outside and reaches each agent only at its namespace's address; each agent reaches the
portal only at its own link's far end. A file written from a kernel on node-a is read, and written
again, by the next session on node-b, run as the same uid; another user's session on node-b holds
another uid.

This machine has no NFS server (no ``nfsd`` module in the container): a folder both agents share stands
in for the export; the agents see it as they would see a network filesystem, through paths only."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys

import httpx
import pytest
from django.test import Client

from conftest import subprocess_env
from provisioner.models import Device, Node
from provisioner.selectors import workload_user
from provisioner.services.nodes import node_enroll
from tests.agents.conftest import (
    REPO,
    process_stop,
    process_tree,
    processes_mentioning,
    run_in_kernel,
    wait_for,
)
from tests.netns import node_namespace
from tests.provisioner.conftest import make_catalog, make_user
from tests.provisioner.test_e2e_agents import api_for, launch, wait_state

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

WHO = "import os, json; print(json.dumps({'uid': os.getuid(), 'home': os.path.expanduser('~')}))"
PORTAL_PORT, AGENT_PORT = 8600, 8801
FLEETS = REPO / "agents" / "fleets"


class _Url:
    def __init__(self, url: str):
        self.url = url


@pytest.fixture
def two_hosts(transactional_db, tmp_path, celery_worker_process):
    """node-a and node-b, each an agent in a namespace of its own, sharing one homes root; the portal
    outside, one web process on each link (the same database), as a portal reached by two networks."""
    homes = tmp_path / "shared-homes"
    homes.mkdir()
    processes: list[subprocess.Popen] = []
    with contextlib.ExitStack() as stack:
        links = {name: stack.enter_context(node_namespace()) for name in ("node-a", "node-b")}
        hosts = ",".join(ns.host_address for ns in links.values())
        env = subprocess_env(
            AGENT_HEARTBEAT_INTERVAL_SECONDS="1",
            ALLOWED_HOSTS=f"{hosts},localhost,127.0.0.1,testserver",
            SITE_URL=f"http://{links['node-a'].host_address}:{PORTAL_PORT}",
        )
        try:
            for name, ns in links.items():
                log = tmp_path / f"uvicorn-{name}.log"
                with open(log, "wb") as out:
                    web = subprocess.Popen(
                        [sys.executable, "-m", "uvicorn", "portal.asgi:application", "--host", ns.host_address,
                         "--port", str(PORTAL_PORT), "--no-access-log", "--ws", "portal.ws_relay:WebSocketRelay"],
                        cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                    )  # fmt: skip
                processes.append(web)

                def web_up(web=web, log=log, ns=ns):
                    if web.poll() is not None:
                        raise AssertionError(f"uvicorn exited:\n{log.read_text()[-3000:]}")
                    with contextlib.suppress(httpx.HTTPError):
                        url = f"http://{ns.host_address}:{PORTAL_PORT}/livez"
                        return httpx.get(url, timeout=2).status_code == 200
                    return False

                wait_for(web_up, 30, 0.2, f"the portal on {name}'s link")
            make_catalog()
            nodes = {}
            for name, ns in links.items():
                enrolment = node_enroll(name=name, address=f"http://{ns.node_address}:{AGENT_PORT}")
                token_file = tmp_path / f"{name}.token"
                token_file.write_text(enrolment.token + "\n")
                token_file.chmod(0o600)
                with open(tmp_path / f"agent-{name}.log", "wb") as out:
                    agent = subprocess.Popen(
                        ns.command(
                            sys.executable, "-m", "agents", "--listen", f"{ns.node_address}:{AGENT_PORT}",
                            "--token-file", str(token_file), "--portal", f"http://{ns.host_address}:{PORTAL_PORT}",
                            "--runtime", "process", "--state-dir", str(tmp_path / "agents" / name),
                            "--fleet", str(FLEETS / f"{name}.yaml"), "--heartbeat-seconds", "1",
                            "--homes-root", str(homes),
                        ),
                        cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                    )  # fmt: skip
                processes.append(agent)
                nodes[name] = enrolment.node
            wait_for(
                lambda: Device.objects.filter(node=nodes["node-a"]).count() == 6, 30, 0.2, "node-a's GPUs"
            )
            wait_for(
                lambda: Device.objects.filter(node=nodes["node-b"]).count() == 9, 30, 0.2, "node-b's GPUs"
            )
            yield {
                "portal": _Url(f"http://{links['node-a'].host_address}:{PORTAL_PORT}"),
                "links": links,
                "homes": homes,
                "state": {name: tmp_path / "agents" / name for name in links},
            }
        finally:
            for process in reversed(processes):
                process_stop(process)
            for name in ("node-a", "node-b"):  # workloads outlive their agent by design: end ours
                for pid in processes_mentioning(str(tmp_path / "agents" / name)):
                    for child in process_tree(pid):
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(child, signal.SIGKILL)


def _cookie(user) -> dict[str, str]:
    browser = Client()
    browser.force_login(user)
    return {"Cookie": f"sessionid={browser.cookies['sessionid'].value}"}


def _run(portal_url: str, session: dict, user, code: str) -> str:
    return run_in_kernel(portal_url, f"/jupyter/{session['id']}/", code, headers=_cookie(user))


def test_a_file_written_on_one_host_is_read_and_written_by_the_next_session_on_another(two_hosts):
    portal, homes = two_hosts["portal"], two_hosts["homes"]
    links = two_hosts["links"]
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
    assert not (two_hosts["state"]["node-a"] / "homes").exists()  # nothing node-local

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
    # each host is another machine: the portal dialled each agent at its namespace's address only
    for name, ns in links.items():
        assert Node.objects.get(name=name).address == f"http://{ns.node_address}:{AGENT_PORT}"
