"""End to end: a team's shared folder (docs/STORAGE.md, "Team folders"). Two real agents (node-a and
node-b) mount one homes root, as the nodes of a pool mount one export; every session runs in a real
bubblewrap sandbox as its user's own uid, and every check is made from a real kernel.

A member writes a file in the team folder on node-a; another member, another uid, reads it and writes it
again on node-b; a read-only member's write is refused by the kernel; a non-member sees no team folder and
cannot reach it. Once the agents measured the folder over the team's quota, a member's next session sees
it read-only, is told why, and nothing in it is deleted."""

from __future__ import annotations

import json

import httpx
import pytest
from django.test import Client

from billing.models import Account
from portal.models import Membership
from portal.services import team_create
from provisioner.models import Device, Session, SessionEvent, TeamFolderUsage
from provisioner.quotas import quota_set
from provisioner.selectors import workload_user
from tests.agents.conftest import run_in_kernel, wait_for
from tests.provisioner.conftest import fund, make_user
from tests.provisioner.test_e2e_agents import agents, api_for, launch, portal, wait_state  # noqa: F401

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PROBE = r"""
import json, os
def attempt(action):
    try:
        return action()
    except OSError as e:
        return f"{type(e).__name__}:{e.errno}"
def write(path, text):
    with open(path, "a") as f:
        f.write(text)
    return "written"
def read(path):
    with open(path) as f:
        return f.read()
T = json.loads(%r)
print(json.dumps({
    "uid": os.getuid(), "groups": sorted(os.getgroups()),
    "read": {p: attempt(lambda p=p: read(p)) for p in T.get("read", [])},
    "write": {p: attempt(lambda p=p: write(p, T["text"])) for p in T.get("write", [])},
    "list": {p: attempt(lambda p=p: sorted(os.listdir(p))) for p in T.get("list", [])},
}))
"""


def _cookie(user) -> dict[str, str]:
    browser = Client()
    browser.force_login(user)
    return {"Cookie": f"sessionid={browser.cookies['sessionid'].value}"}


def _probe(portal_url: str, session: dict, user, **targets) -> dict:
    out = run_in_kernel(
        portal_url, f"/jupyter/{session['id']}/", PROBE % json.dumps(targets), headers=_cookie(user)
    )
    return json.loads(out.strip().splitlines()[-1])


def _running(api, **fields) -> dict:
    session = launch(api, **fields)
    assert wait_state(api, session["id"], ("running", "failed"))["state"] == "running"
    return session


def _stop(api, session: dict) -> None:
    assert api.post(f"/api/v1/sessions/{session['id']}/stop").status_code == 200
    wait_state(api, session["id"], ("stopped",), 30)


EROFS, EACCES = "OSError:30", "PermissionError:13"


def test_members_share_the_team_folder_across_nodes_and_uids_and_nobody_else_reaches_it(
    portal,  # noqa: F811
    agents,  # noqa: F811
    tmp_path,
):
    homes = tmp_path / "shared-homes"
    homes.mkdir()
    for name in ("node-a", "node-b"):
        agents.options[name] = ["--homes-root", str(homes), "--home-round-seconds", "1"]
    nodes = {name: agents.enroll_and_start(name) for name in ("node-a", "node-b")}
    wait_for(lambda: Device.objects.filter(node=nodes["node-a"]).count() == 6, 20, 0.2, "node-a's GPUs")
    wait_for(lambda: Device.objects.filter(node=nodes["node-b"]).count() == 9, 20, 0.2, "node-b's GPUs")
    alice, bob, carol, dave = (make_user(n) for n in ("alice", "bob", "carol", "dave"))
    lab = team_create(creator=alice, name="Vision Lab")  # alice owns it
    Membership.objects.create(team=lab, user=bob)  # read-write: the default
    Membership.objects.create(team=lab, user=carol, folder_read_only=True)
    inside = f"/home/teams/{lab.slug}"
    folder = homes / ".teams" / str(lab.account_id)
    alice_api, bob_api, carol_api, dave_api = (api_for(portal, u) for u in (alice, bob, carol, dave))

    # alice, on node-a, paying with her own account: she sees the folder in her home's teams/ link,
    # writes a file and a folder with a file in it
    on_a = _running(alice_api)
    assert on_a["node"] == "node-a"
    code = (
        f"import os; os.makedirs('teams/{lab.slug}/run-1', exist_ok=True); "
        f"open('teams/{lab.slug}/run-1/metrics.csv', 'w').write('epoch,loss\\n1,0.5\\n'); "
        f"open('{inside}/notes.txt', 'w').write('from alice'); "
        "print(os.getuid(), sorted(os.listdir('teams')))"
    )
    said = run_in_kernel(portal.url, f"/jupyter/{on_a['id']}/", code, headers=_cookie(alice))
    alice_uid, listed = said.strip().splitlines()[-1].split(" ", 1)
    assert listed == repr([lab.slug])
    assert (folder / "notes.txt").read_text() == "from alice"
    assert folder.stat().st_mode & 0o7777 == 0o2770 and folder.stat().st_uid == 0
    gid = folder.stat().st_gid
    assert (folder / "notes.txt").stat().st_gid == gid and (
        folder / "run-1"
    ).stat().st_mode & 0o2070 == 0o2070
    # JupyterLab's file browser shows it (its contents API, through the portal's proxy)
    with httpx.Client(base_url=portal.url, headers=_cookie(alice), timeout=30) as web:
        shown = web.get(f"/jupyter/{on_a['id']}/api/contents/teams/{lab.slug}")
        assert shown.status_code == 200, shown.text
        assert {item["name"] for item in shown.json()["content"]} == {"notes.txt", "run-1"}
    _stop(alice_api, on_a)

    # bob, another uid, on node-b, paying with the team's account: reads alice's files and writes them
    team_account = Account.objects.get(pk=lab.account_id)
    fund(team_account, 100_000_000)
    on_b = _running(bob_api, gpu_model="H200", profile="1g.18gb", account=team_account.pk)
    assert on_b["node"] == "node-b"
    seen = _probe(
        portal.url,
        on_b,
        bob,
        text=", bob too",
        read=[f"{inside}/notes.txt", f"{inside}/run-1/metrics.csv"],
        write=[f"{inside}/notes.txt", f"{inside}/run-1/metrics.csv", f"{inside}/run-1/bob.txt"],
    )
    assert str(seen["uid"]) != alice_uid and gid in seen["groups"]
    assert seen["read"] == {
        f"{inside}/notes.txt": "from alice",
        f"{inside}/run-1/metrics.csv": "epoch,loss\n1,0.5\n",
    }
    assert set(seen["write"].values()) == {"written"}, seen["write"]
    assert (folder / "notes.txt").read_text() == "from alice, bob too"

    # carol, read-only, on node-b: reads, and the kernel refuses every write
    on_c = _running(carol_api, gpu_model="H200", profile="1g.18gb")
    seen = _probe(
        portal.url,
        on_c,
        carol,
        text="carol",
        read=[f"{inside}/notes.txt"],
        write=[f"{inside}/notes.txt", f"{inside}/carol.txt", f"teams/{lab.slug}/run-1/carol.txt"],
    )
    assert seen["read"] == {f"{inside}/notes.txt": "from alice, bob too"}
    assert all(result in (EROFS, EACCES) for result in seen["write"].values()), seen["write"]
    assert not (folder / "carol.txt").exists() and (folder / "notes.txt").read_text() == "from alice, bob too"
    _stop(carol_api, on_c)

    # dave, no member, on node-a: no team folder in his sandbox, and none reachable at its host path
    on_d = _running(dave_api)
    seen = _probe(
        portal.url,
        on_d,
        dave,
        text="dave",
        read=[str(folder / "notes.txt"), f"{inside}/notes.txt"],
        write=[str(folder / "dave.txt"), f"{inside}/dave.txt"],
        list=["/home", str(homes), str(homes / ".teams"), str(folder)],
    )
    assert gid not in seen["groups"]
    assert all(r.startswith(("FileNotFoundError", "PermissionError")) for r in seen["read"].values()), seen
    assert all(r.startswith(("FileNotFoundError", "PermissionError")) for r in seen["write"].values()), seen
    assert seen["list"]["/home"] == [workload_user(dave)]
    assert seen["list"][str(homes)] in ([], "FileNotFoundError:2")  # the hidden root: an empty tmpfs
    assert all(seen["list"][p].startswith("FileNotFoundError") for p in (str(homes / ".teams"), str(folder)))
    _stop(dave_api, on_d)

    # the agents measured the folder; the team's quota is lowered under it
    measured = wait_for(
        lambda: TeamFolderUsage.objects.filter(account_id=lab.account_id, bytes__gt=0).first(),
        30,
        0.3,
        "the team folder measured",
    )
    assert measured.files >= 4  # notes.txt, run-1, metrics.csv, bob.txt
    quota_set(account=team_account, limits={"max_home_bytes": 1})
    before = sorted(p.relative_to(folder) for p in folder.rglob("*"))

    # over quota: bob's next session is admitted, sees the folder read-only and is told why; alice, its
    # owner, still writes (to clean it up); nothing was deleted
    over = _running(bob_api, gpu_model="H200", profile="1g.18gb")
    stored = Session.objects.get(pk=over["id"])
    assert stored.team_folders == [{"key": str(lab.account_id), "name": lab.slug, "read_only": True}]
    warned = SessionEvent.objects.filter(session=stored, kind="storage").get()
    assert lab.slug in warned.message and "read-only" in warned.message
    seen = _probe(
        portal.url, over, bob, text="more", read=[f"{inside}/notes.txt"], write=[f"{inside}/notes.txt"]
    )
    assert seen["write"][f"{inside}/notes.txt"] in (EROFS, EACCES)
    assert seen["read"][f"{inside}/notes.txt"] == "from alice, bob too"
    assert sorted(p.relative_to(folder) for p in folder.rglob("*")) == before
    assert (folder / "notes.txt").read_text() == "from alice, bob too"
    _stop(bob_api, over)
    _stop(bob_api, on_b)
