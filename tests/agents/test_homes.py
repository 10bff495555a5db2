"""``DELETE /v1/homes/<name>``: a real agent removes a user's home from its homes root, never through a
planted link, never while a workload of that user is on the node, and refuses names that are not homes'."""

from __future__ import annotations

import http.client
import json
import os
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from agents.homes import DEPTH_MAX, REMOVING_DIR, home_detach, removing_sweep, tree_remove
from tests.agents.conftest import workload_spec

pytestmark = pytest.mark.slow


@pytest.fixture
def agent(start_agent, tmp_path):
    return start_agent(tmp_path / "state", "--sandbox", "none", "--vgpu-lib", str(tmp_path / "no-libvgpu.so"))


def _home(root: Path, name: str) -> Path:
    home = root / name
    (home / "data" / "deep").mkdir(parents=True)
    (home / "data" / "deep" / "weights.bin").write_bytes(b"w" * 4096)
    (home / "notes.txt").write_text("mine")
    os.mkfifo(home / "pipe")
    return home


def _raw_delete(agent, path: str) -> tuple[int, dict]:
    """A DELETE of ``path`` exactly as written (an HTTP client would resolve ``..`` before sending)."""
    url = urlsplit(agent.url)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    try:
        connection.request("DELETE", path, headers={"Authorization": agent.client.headers["Authorization"]})
        answer = connection.getresponse()
        return answer.status, json.loads(answer.read() or b"{}")
    finally:
        connection.close()


def test_delete_removes_the_home_and_nothing_a_link_points_at(agent, tmp_path):
    homes = agent.state_dir / "homes"
    home = _home(homes, "alice-1")
    other = _home(homes, "bob-2")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("not the tenant's")
    (home / "to-outside").symlink_to(outside)
    (home / "data" / "to-bob").symlink_to(other)
    (home / "data" / "to-file").symlink_to(outside / "keep.txt")

    answer = agent.client.delete("/v1/homes/alice-1")

    assert answer.status_code == 200, answer.text
    assert answer.json() == {"deleted": True}
    assert not home.exists()
    assert (outside / "keep.txt").read_text() == "not the tenant's"
    assert (other / "notes.txt").read_text() == "mine" and (other / "data" / "deep" / "weights.bin").exists()
    assert list((homes / ".suanli" / "removing").iterdir()) == []  # nothing left half removed
    again = agent.client.delete("/v1/homes/alice-1")
    assert again.status_code == 404 and again.json()["error"]["code"] == "not_found"


def test_delete_is_refused_while_a_workload_of_that_user_is_on_the_node(agent):
    spec = workload_spec("s-home-busy", None, user="carol-3")
    assert agent.put_workload(spec).status_code == 201
    home = agent.state_dir / "homes" / "carol-3"
    (home / "work.py").parent.mkdir(parents=True, exist_ok=True)
    (home / "work.py").write_text("print('busy')")

    answer = agent.client.delete("/v1/homes/carol-3")

    assert answer.status_code == 409, answer.text
    assert answer.json()["error"]["code"] == "home_in_use"
    assert (home / "work.py").read_text() == "print('busy')"
    assert agent.client.delete("/v1/workloads/s-home-busy").json() == {"deleted": True}
    assert agent.client.delete("/v1/homes/carol-3").status_code == 200
    assert not home.exists()


def test_unknown_home_is_404(agent):
    answer = agent.client.delete("/v1/homes/nobody-9")
    assert answer.status_code == 404
    assert answer.json()["error"]["code"] == "not_found"


def test_delete_needs_the_node_token(agent):
    home = _home(agent.state_dir / "homes", "dave-4")
    for headers in ({}, {"Authorization": "Bearer wrong-token"}):
        answer = httpx.delete(f"{agent.url}/v1/homes/dave-4", headers=headers)
        assert answer.status_code == 401
        assert answer.json()["error"]["code"] == "unauthorised"
    assert (home / "notes.txt").read_text() == "mine"


def test_names_that_are_not_homes_are_refused_and_change_nothing(agent):
    homes = agent.state_dir / "homes"
    home = _home(homes, "erin-5")
    (homes / ".suanli").mkdir()
    (homes / ".suanli" / "sandbox-uids.json").write_text("{}")
    for name in ("..", ".", ".suanli", ".hidden", "%2e%2e", "erin-5%2fdata", "-x", "a" * 65):
        status, body = _raw_delete(agent, f"/v1/homes/{name}")
        assert status == 400, (name, body)
        assert body["error"]["code"] == "invalid_name" and "name" in body["error"]["fields"]
    for path in ("/v1/homes/../erin-5", "/v1/homes/erin-5/data", "/v1/homes/"):  # not one name
        assert _raw_delete(agent, path)[0] == 404
    assert agent.client.get("/v1/homes/erin-5").status_code == 405
    assert (home / "notes.txt").read_text() == "mine"
    assert (homes / ".suanli" / "sandbox-uids.json").read_text() == "{}"


def test_tree_remove_takes_a_tree_deeper_than_its_descriptors(tmp_path):
    folder = tmp_path / "home"
    deepest = folder.joinpath(*["d"] * (DEPTH_MAX * 3))
    deepest.mkdir(parents=True)
    (deepest / "leaf.txt").write_text("deep")
    (deepest / "up").symlink_to(tmp_path)
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        tree_remove(fd, "home")
    finally:
        os.close(fd)
    assert os.listdir(tmp_path) == []


def test_a_removal_cut_short_is_finished_by_the_sweep_and_one_under_way_is_left(tmp_path):
    """A worker or agent killed while it emptied a detached home leaves the rest in removing/: the
    sweep takes what has not changed for the settled time, never what a link in it points at."""
    root = tmp_path / "homes"
    outside = tmp_path / "precious.txt"
    outside.write_text("not a tenant's")
    for name in ("alice", "bob"):
        (root / name / "data").mkdir(parents=True)
        (root / name / "data" / "x.bin").write_bytes(b"x" * 4096)
        (root / name / "data" / "escape").symlink_to(outside)
    stale = home_detach(root, "alice")
    home_detach(root, "bob")
    removing = root.joinpath(*REMOVING_DIR)
    (removing / stale / "data" / "x.bin").unlink()  # the killed remover got this far
    assert removing_sweep(root, settled_seconds=3600) == 0  # both changed just now: left alone
    assert removing_sweep(root, settled_seconds=0) == 2
    assert os.listdir(removing) == [] and outside.read_text() == "not a tenant's"
    assert removing_sweep(tmp_path / "no-homes-here") == 0
