"""Tenant code is hostile: proven from inside real kernels, on a GPU host that is another machine.

The topology: the portal (uvicorn, a real Celery worker) listens on the test's end of a veth pair; the
node's agent runs in a network namespace the test creates (``tests/netns.py``), enrolled at its
namespace's address, and starts sandboxed JupyterLab workloads there. Every request of the test goes
through the portal's proxy to the agent's gateway; only the two addresses of that link carry traffic.

The escape probes run in a kernel of one tenant while another tenant's session runs on the same node,
and check each refusal from the inside: uid, capabilities, files, sockets, processes and GPU devices.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from django.test import Client

from agents.runtimes.base import CODE_SERVER_DIR, CODE_SERVER_ENTRY, code_server_installed, code_server_node
from conftest import ROOT, subprocess_env
from portal.services import access_token_create, team_create
from provisioner.models import Allocation, Device, Environment, Node
from provisioner.selectors import workload_user
from provisioner.services.nodes import node_enroll
from tests.agents.conftest import process_stop, process_tree, processes_mentioning, run_in_kernel, wait_for
from tests.netns import linked_namespace, node_namespace
from tests.provisioner.conftest import A100, ENV, make_catalog, make_user

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed"),
]
FLEET = ROOT / "agents" / "fleets" / "node-a.yaml"
PORTAL_PORT, AGENT_PORT = 8600, 8801
VSCODE_ENV = "VS Code"
NO_CODE_SERVER = f"code-server is not installed at {CODE_SERVER_DIR} (run agents/editors/install.sh)"


@pytest.fixture
def remote_node(transactional_db, tmp_path, celery_worker_process):
    """The portal outside, node-a's agent in a namespace of its own; yields what the probes need."""
    with node_namespace() as ns, linked_namespace(ns) as internet:
        portal_url = f"http://{ns.host_address}:{PORTAL_PORT}"
        agent_url = f"http://{ns.node_address}:{AGENT_PORT}"
        env = subprocess_env(
            AGENT_HEARTBEAT_INTERVAL_SECONDS="1",
            ALLOWED_HOSTS=f"{ns.host_address},localhost,127.0.0.1,testserver",
            SITE_URL=portal_url,
        )
        web_log = tmp_path / "uvicorn.log"
        with open(web_log, "wb") as out:
            web = subprocess.Popen(
                [sys.executable, "-m", "uvicorn", "portal.asgi:application", "--host", ns.host_address,
                 "--port", str(PORTAL_PORT), "--no-access-log", "--ws", "portal.ws_relay:WebSocketRelay"],
                cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
        site = tmp_path / "site"  # a web server on "the internet": a namespace linked to the node only
        site.mkdir()
        (site / "hello.txt").write_text("hello from outside")
        outside = subprocess.Popen(
            internet.command(sys.executable, "-m", "http.server", "--bind", internet.node_address,
                             "--directory", str(site), "8080"),
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        processes = [outside, web]
        state = tmp_path / "node-a"
        homes = tmp_path / "shared-homes"  # outside the state dir, as a pool's shared mount is
        homes.mkdir()
        devices = tmp_path / "dev"  # stand-ins for the fake fleet's device nodes: a real host has /dev
        devices.mkdir()
        for name in ["nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", *(f"nvidia{i}" for i in range(6))]:
            (devices / name).write_text(name)
        try:

            def web_up():
                if web.poll() is not None:
                    raise AssertionError(f"uvicorn exited:\n{web_log.read_text()[-3000:]}")
                with contextlib.suppress(httpx.HTTPError):
                    return httpx.get(f"{portal_url}/livez", timeout=2).status_code == 200
                return False

            wait_for(web_up, 30, 0.2, "the portal on the link")
            make_catalog()
            enrolment = node_enroll(name="node-a", address=agent_url)
            token_file = tmp_path / "node-a.token"
            token_file.write_text(enrolment.token + "\n")
            token_file.chmod(0o600)
            agent_log = tmp_path / "agent.log"
            with open(agent_log, "wb") as out:
                agent = subprocess.Popen(
                    ns.command(
                        sys.executable, "-m", "agents", "--listen", f"{ns.node_address}:{AGENT_PORT}",
                        "--token-file", str(token_file), "--portal", portal_url, "--runtime", "process",
                        "--state-dir", str(state), "--fleet", str(FLEET), "--heartbeat-seconds", "1",
                        "--sandbox", "bwrap", "--sandbox-hide", str(ROOT / ".data"),
                        "--device-dir", str(devices), "--homes-root", str(homes),
                    ),
                    cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                )  # fmt: skip
            processes.append(agent)
            node = enrolment.node
            wait_for(
                lambda: agent.poll() is None and Device.objects.filter(node=node).count() == 6,
                30,
                0.2,
                f"node-a's GPUs over the link\n{agent_log}",
            )
            yield {
                "ns": ns,
                "internet": internet,
                "portal": portal_url,
                "agent": agent_url,
                "node": node,
                "state": state,
                "homes": homes,
                "token_file": token_file,
                "agent_log": agent_log,
                "web_log": web_log,
            }
        finally:
            for process in reversed(processes):
                process_stop(process)
            for pid in processes_mentioning(str(state)):  # workloads outlive their agent by design
                for child in process_tree(pid):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(child, signal.SIGKILL)


def _api(portal: str, user) -> httpx.Client:
    _token, raw = access_token_create(user=user, name="escape", scopes=["read", "sessions"])
    return httpx.Client(base_url=portal, headers={"Authorization": f"Bearer {raw}"}, timeout=30)


def _cookie(user) -> dict[str, str]:
    browser = Client()
    browser.force_login(user)
    return {"Cookie": f"sessionid={browser.cookies['sessionid'].value}"}


def _running(api: httpx.Client, **fields) -> dict:
    body = {"gpu_model": A100, "profile": "whole", "environment": ENV, "max_hours": 1, **fields}
    created = api.post("/api/v1/sessions", json=body)
    assert created.status_code == 201, created.text
    sid = created.json()["id"]

    def running():
        session = api.get(f"/api/v1/sessions/{sid}").json()
        assert session["state"] not in ("failed", "stopped"), session
        return session if session["state"] == "running" else None

    return wait_for(running, 90, 0.3, f"session {sid} running")


def test_a_session_on_another_host_is_reached_through_the_portal_and_stopped(remote_node):
    user = make_user()
    api = _api(remote_node["portal"], user)
    session = _running(api)
    node = Node.objects.get(pk=remote_node["node"].pk)
    assert node.address == remote_node["agent"]  # dialled as enrolled, over the link

    headers = _cookie(user)
    base = f"/jupyter/{session['id']}/"
    with httpx.Client(base_url=remote_node["portal"], headers=headers, timeout=30) as web:
        lab = web.get(f"{base}lab")
        assert lab.status_code == 200 and "jupyter-config-data" in lab.text
    out = run_in_kernel(remote_node["portal"], base, "print(sum(range(10)))", headers=headers)
    assert out.strip().endswith("45")

    assert api.post(f"/api/v1/sessions/{session['id']}/stop").status_code == 200
    wait_for(
        lambda: api.get(f"/api/v1/sessions/{session['id']}").json()["state"] == "stopped", 30, 0.3, "stopped"
    )
    with httpx.Client(base_url=remote_node["portal"], headers=headers, timeout=30) as web:
        assert web.get(f"{base}api/status").status_code in (302, 404)
    assert "127.0.0.1" not in remote_node["agent_log"].read_text()


PROBE = r"""
import json, os, socket
T = json.loads(%r)
def read(p):
    try:
        with open(p, "rb") as f:
            f.read(1)
        return "read"
    except Exception as e:
        return type(e).__name__
def listing(p):
    try:
        return sorted(os.listdir(p))
    except Exception as e:
        return type(e).__name__
def tcp(h, p):
    s = socket.socket(); s.settimeout(2)
    try:
        s.connect((h, p)); return "connected"
    except Exception as e:
        return type(e).__name__
    finally:
        s.close()
def unix(p):
    s = socket.socket(socket.AF_UNIX); s.settimeout(2)
    try:
        s.connect(p); return "connected"
    except Exception as e:
        return type(e).__name__
    finally:
        s.close()
def write(p):
    try:
        with open(p, "w") as f:
            f.write("x")
        return "written"
    except Exception as e:
        return type(e).__name__
import urllib.request, urllib.error
def fetch(url):
    try:
        return urllib.request.urlopen(url, timeout=10).read().decode()
    except urllib.error.HTTPError as e:
        return f"HTTP {e.code}: {e.read().decode().strip()}"
    except Exception as e:
        return type(e).__name__
def tunnel(host, port):  # CONNECT through the proxy, as pip's HTTPS does, then plain HTTP inside
    s = socket.create_connection(("127.0.0.1", 3128), timeout=10)
    s.sendall(f"CONNECT {host}:{port} HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode())
    answer = s.recv(4096).decode()
    if " 200 " not in answer.split("\r\n")[0]:
        return answer.split("\r\n")[0]
    s.sendall(f"GET /hello.txt HTTP/1.0\r\nHost: {host}\r\n\r\n".encode())
    data = b""
    while chunk := s.recv(4096):
        data += chunk
    return data.decode().rsplit("\r\n\r\n", 1)[-1]
status = dict(l.split(":", 1) for l in open("/proc/self/status").read().splitlines() if ":" in l)
cmdlines = []
for pid in (p for p in os.listdir("/proc") if p.isdigit()):
    try:
        cmdlines.append(open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace"))
    except OSError:
        pass
print(json.dumps({
    "uid": os.getuid(), "euid": os.geteuid(), "gid": os.getgid(), "groups": os.getgroups(),
    "cap_eff": status["CapEff"].strip(), "cap_bnd": status["CapBnd"].strip(),
    "no_new_privs": status["NoNewPrivs"].strip(),
    "read": {p: read(p) for p in T["read"]},
    "list": {p: listing(p) for p in T["list"]},
    "tcp": {f"{h}:{p}": tcp(h, p) for h, p in T["tcp"]},
    "unix": {p: unix(p) for p in T["unix"]},
    "write": {p: write(p) for p in T["write"]},
    "processes": cmdlines,
    "dev": sorted(n for n in os.listdir("/dev") if n.startswith("nvidia")),
    "fetch": {u: fetch(u) for u in T["fetch"]},
    "tunnel": tunnel(*T["tunnel"]),
    "proxy": os.environ.get("HTTPS_PROXY"),
}))
"""


def _teams(alice, bob) -> dict:
    """bob's team has a shared folder; alice, in a team of her own, holds her team's group, not bob's.
    Made before the launches, which decide the folders a session mounts."""
    return {
        "bobs": team_create(creator=bob, name="Bob Lab"),
        "alices": team_create(creator=alice, name="Alice Lab"),
    }


def _plant(homes: Path, bob_home: str, teams: dict) -> None:
    """bob's secrets, once his session made his home and his team's folder."""
    (homes / bob_home / "secret.txt").write_text("bob's work")
    (homes / ".teams" / str(teams["bobs"].account_id) / "plan.txt").write_text("bob's team's plan")


def _escape_targets(remote_node, victim: dict, bob_home: str, alice_home: str, teams: dict) -> dict:
    """What the probes try: the node's secrets, another tenant's home and session, another team's
    folder, the host's services."""
    ns, state, homes = remote_node["ns"], remote_node["state"], remote_node["homes"]
    bobs_team, bobs_folder = teams["bobs"], homes / ".teams" / str(teams["bobs"].account_id)
    mine = f"/home/teams/{teams['alices'].slug}/mine.txt"
    data = ROOT / ".data"
    site = remote_node["internet"].node_address
    return {
        "read": [
            str(remote_node["token_file"]),
            str(state / "workloads" / f"{victim['id']}.json"),
            str(state / "run" / victim["id"] / "private" / "jupyter_server_config.json"),
            str(homes / bob_home / "secret.txt"),  # another home, at its host path on the shared root
            str(homes / ".suanli" / "sandbox-uids.json"),
            str(homes / ".suanli" / "team-gids.json"),
            str(bobs_folder / "plan.txt"),  # another team's folder, at its host path
            f"/home/teams/{bobs_team.slug}/plan.txt",  # and where bob's sessions see it
            "/etc/shadow",
        ],
        "list": [
            str(state),
            str(homes),
            str(homes / bob_home),
            str(data),
            "/root",
            "/home",
            str(homes / ".teams"),
            str(bobs_folder),
            f"/home/teams/{bobs_team.slug}",
            "/home/teams",
        ],  # fmt: skip
        "tcp": [
            [ns.node_address, AGENT_PORT],  # the agent API, at the node's address
            ["127.0.0.1", AGENT_PORT],
            [ns.host_address, PORTAL_PORT],  # the portal, across the link
            ["127.0.0.1", PORTAL_PORT],
            ["127.0.0.1", 5432],  # PostgreSQL and Redis on their usual ports
            ["127.0.0.1", 6379],
            [site, 8080],  # the internet without the proxy
        ],
        "unix": [
            str(data / "pg" / ".s.PGSQL.5432"),
            str(data / "redis" / "redis.sock"),
            str(state / "run" / victim["id"] / "private" / "jupyter.sock"),
        ],
        "write": [
            "/etc/suanli-probe",
            "/usr/suanli-probe",
            str(ROOT / "suanli-probe"),
            f"/home/{alice_home}/mine.txt",
            "/tmp/mine.txt",
            str(bobs_folder / "mine.txt"),
            f"/home/teams/{bobs_team.slug}/mine.txt",
            mine,  # her own team's folder
        ],
        "fetch": [
            f"http://{site}:8080/hello.txt",  # the internet, through the node's egress proxy
            f"http://{ns.node_address}:{AGENT_PORT}/v1/health",  # the agent, asked through the proxy
            f"http://{ns.host_address}:{PORTAL_PORT}/healthz",  # the portal, asked through the proxy
        ],
        "tunnel": [site, 8080],
    }


def _assert_contained(
    remote_node, seen: dict, *, victim: dict, alice_home: str, attacker: dict, teams: dict
) -> None:
    """Every refusal the probes should meet, and the little a tenant may do (its home, /tmp, its team's
    folder, the proxy)."""
    ns, homes = remote_node["ns"], remote_node["homes"]
    alices_team, bobs_folder = teams["alices"], homes / ".teams" / str(teams["bobs"].account_id)
    mine = f"/home/teams/{alices_team.slug}/mine.txt"
    site = remote_node["internet"].node_address
    device = Allocation.objects.select_related("device").get(session_id=attacker["id"]).device
    assert seen["uid"] != 0 and seen["euid"] != 0 and seen["gid"] != 0 and 0 not in seen["groups"]
    assert int(seen["cap_eff"], 16) == 0 and int(seen["cap_bnd"], 16) == 0 and seen["no_new_privs"] == "1"
    assert all(result != "read" for result in seen["read"].values()), seen["read"]
    interpreter = os.path.realpath(sys.executable)  # kept readable: pyenv's lives under /root
    shown_in_root = [interpreter.split("/")[2]] if interpreter.startswith("/root/") else []
    team_folders = {"/home": sorted([alice_home, "teams"]), "/home/teams": [alices_team.slug]}
    for path, listed in seen["list"].items():
        allowed = ([], "FileNotFoundError", [alice_home], *([shown_in_root] if path == "/root" else []))
        assert listed in allowed or listed == team_folders.get(path), (path, listed)
    assert seen["list"]["/home"] == sorted([alice_home, "teams"])  # its own home, nobody else's
    assert seen["list"]["/home/teams"] == [alices_team.slug]  # its own team's folder, no other team's
    bobs_gid, alices_gid = (
        bobs_folder.stat().st_gid,
        (homes / ".teams" / str(alices_team.account_id)).stat().st_gid,
    )
    assert alices_gid in seen["groups"] and bobs_gid not in seen["groups"]
    assert all(result != "connected" for result in seen["tcp"].values()), seen["tcp"]
    assert all(result != "connected" for result in seen["unix"].values()), seen["unix"]
    written = {path: result for path, result in seen["write"].items() if result == "written"}
    assert written == {
        f"/home/{alice_home}/mine.txt": "written",
        "/tmp/mine.txt": "written",
        mine: "written",
    }, seen["write"]
    assert sorted(p.name for p in bobs_folder.iterdir()) == ["plan.txt"]
    assert not (ROOT / "suanli-probe").exists()
    assert (homes / alice_home / "mine.txt").read_text() == "x"
    assert not any(victim["id"] in line for line in seen["processes"]), "sees the other session's processes"
    assert len(seen["processes"]) < 20, seen["processes"]
    assert seen["dev"] == sorted(["nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", f"nvidia{device.index}"])

    # Outbound HTTP(S) works through the node's egress proxy, and only to the outside.
    assert seen["proxy"] == "http://127.0.0.1:3128"
    fetched = seen["fetch"]
    assert fetched[f"http://{site}:8080/hello.txt"] == "hello from outside"
    assert seen["tunnel"] == "hello from outside"
    assert fetched[f"http://{ns.node_address}:{AGENT_PORT}/v1/health"].startswith(
        "HTTP 403: outbound refused"
    )
    assert "an address of this node itself" in fetched[f"http://{ns.node_address}:{AGENT_PORT}/v1/health"]
    assert fetched[f"http://{ns.host_address}:{PORTAL_PORT}/healthz"].startswith("HTTP 403: outbound refused")


def _victim_untouched(remote_node, victim: dict, bob, bob_home: str) -> None:
    bob_out = run_in_kernel(
        remote_node["portal"],
        f"/jupyter/{victim['id']}/",
        f"print(open('/home/{bob_home}/secret.txt').read())",
        headers=_cookie(bob),
    )
    assert bob_out.strip().endswith("bob's work")


def test_tenant_code_cannot_escape_its_sandbox(remote_node):
    homes = remote_node["homes"]
    alice, bob = make_user("alice"), make_user("bob")
    alice_home, bob_home = workload_user(alice), workload_user(bob)
    teams = _teams(alice, bob)
    victim = _running(_api(remote_node["portal"], bob))
    attacker = _running(_api(remote_node["portal"], alice))
    _plant(homes, bob_home, teams)
    targets = _escape_targets(remote_node, victim, bob_home, alice_home, teams)
    out = run_in_kernel(
        remote_node["portal"],
        f"/jupyter/{attacker['id']}/",
        PROBE % json.dumps(targets),
        headers=_cookie(alice),
    )
    seen = json.loads(out.strip().splitlines()[-1])
    _assert_contained(remote_node, seen, victim=victim, alice_home=alice_home, attacker=attacker, teams=teams)
    _victim_untouched(remote_node, victim, bob, bob_home)  # the victim's kernel still runs, untouched


@pytest.mark.skipif(not code_server_installed(CODE_SERVER_DIR), reason=NO_CODE_SERVER)
@pytest.mark.skipif(shutil.which("nsenter") is None, reason="nsenter (util-linux) is not installed")
def test_tenant_code_cannot_escape_a_vscode_sandbox(remote_node):
    """The same probes from inside a VS Code (code-server) workload. Its terminal is a pty over the
    workbench's own WebSocket protocol, which a test cannot drive simply; so the probe runs as a process
    of that live sandbox instead: ``nsenter`` joins the namespaces of the workload's code-server (its
    mount, PID, network, IPC and UTS namespaces, its root and working folder), and ``setpriv`` drops to
    its uid with no capabilities and no-new-privileges, exactly as bubblewrap's last step did for
    code-server, with code-server's environment. It is what a terminal in that VS Code would run."""
    homes, state = remote_node["homes"], remote_node["state"]
    node = remote_node["node"]
    Environment.objects.create(
        name=VSCODE_ENV, python=sys.executable, interface=Environment.Interface.VSCODE, memory_mib=4096
    )
    wait_for(
        lambda: "vscode" in Node.objects.get(pk=node.pk).interfaces, 15, 0.2, "node-a reporting code-server"
    )
    alice, bob = make_user("alice"), make_user("bob")
    alice_home, bob_home = workload_user(alice), workload_user(bob)
    teams = _teams(alice, bob)
    victim = _running(_api(remote_node["portal"], bob))
    attacker = _running(_api(remote_node["portal"], alice), environment=VSCODE_ENV)
    _plant(homes, bob_home, teams)

    # VS Code answers through the portal's proxy, for its user only
    base = f"/jupyter/{attacker['id']}/"
    with httpx.Client(base_url=remote_node["portal"], timeout=30) as web:
        page = web.get(f"{base}?folder=/home/{alice_home}", headers=_cookie(alice))
        assert page.status_code == 200 and "vscode-workbench-web-configuration" in page.text
        assert web.get(base, headers=_cookie(bob)).status_code == 404

    record = json.loads((state / "workloads" / f"{attacker['id']}.json").read_text())
    tree = process_tree(record["runtime_state"]["pid"])
    node_binary = code_server_node(CODE_SERVER_DIR)
    (server,) = (pid for pid in tree if _argv(pid)[:2] == [node_binary, _entry()])
    uid = os.stat(f"/proc/{server}").st_uid
    assert uid == record["runtime_state"]["uid"] != 0
    environ = Path(f"/proc/{server}/environ").read_bytes().decode().split("\0")
    status = dict(line.split(":", 1) for line in Path(f"/proc/{server}/status").read_text().splitlines())
    groups = ",".join(status["Groups"].split()) or None  # its teams' groups, as bubblewrap left them
    targets = _escape_targets(remote_node, victim, bob_home, alice_home, teams)
    probe = [
        "nsenter", f"--target={server}", "--mount", "--pid", "--net", "--ipc", "--uts", "--root", "--wd",
        "env", "-i", *(e for e in environ if e),
        "setpriv", f"--reuid={uid}", f"--regid={uid}", f"--groups={groups}" if groups else "--clear-groups",
        "--inh-caps=-all",
        "--bounding-set=-all", "--no-new-privs", "--",
        sys.executable, "-",
    ]  # fmt: skip
    # the probe on stdin, as a kernel gets its code: not in any command line the probes list
    done = subprocess.run(
        probe, input=PROBE % json.dumps(targets), capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert any("entry.js" in line for line in seen["processes"])  # inside code-server's PID namespace
    _assert_contained(remote_node, seen, victim=victim, alice_home=alice_home, attacker=attacker, teams=teams)
    _victim_untouched(remote_node, victim, bob, bob_home)


def _argv(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            return cmdline.read().decode(errors="replace").split("\0")
    except OSError:
        return []


def _entry() -> str:
    return str(CODE_SERVER_DIR / CODE_SERVER_ENTRY)
