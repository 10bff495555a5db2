"""Team folders on the agent (docs/STORAGE.md, "Team folders"): the spec's ``teams``, the folder's
permissions, the sandbox's binds and groups, and their measurement beside the homes."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from agents import sandbox
from agents.heartbeat import build_heartbeat
from agents.home_usage import HomeMeter
from agents.spec import SpecError, parse_spec

SPEC = {
    "session_id": "s-1",
    "user": "alice-1",
    "token": "a-token-of-length",
    "base_url": "/jupyter/s-1/",
    "environment": {"name": "py", "python": None, "image": None},
    "allocation": None,
    "limits": {"cpu_cores": 1, "memory_mib": 512},
}
LAB = {"key": "7", "name": "vision-lab", "read_only": False}


def test_a_spec_without_teams_keeps_its_shape_and_fingerprint():
    plain = parse_spec(SPEC)
    assert plain.teams == () and plain.to_json() == SPEC
    with_teams = parse_spec({**SPEC, "teams": [LAB, {"key": "8", "name": "nlp", "read_only": True}]})
    assert [t.read_only for t in with_teams.teams] == [False, True]
    assert with_teams.to_json()["teams"][0] == LAB
    assert with_teams.fingerprint() != plain.fingerprint()


@pytest.mark.parametrize(
    ("teams", "field"),
    [
        ("lab", "teams"),
        ([{"key": "../7", "name": "lab", "read_only": False}], "teams.0.key"),
        ([{"key": "7", "name": "../../etc", "read_only": False}], "teams.0.name"),
        ([{"key": "7", "name": ".suanli", "read_only": False}], "teams.0.name"),
        ([{"key": "7", "name": "lab", "read_only": "no"}], "teams.0.read_only"),
        ([{"key": "7", "name": "lab"}], "teams.0.read_only"),
        ([{"key": "7", "name": "lab", "read_only": False, "gid": 0}], "teams.0.gid"),
        ([LAB, {**LAB, "key": "8"}], "teams"),  # two folders at one place
        ([{**LAB, "key": str(i), "name": f"t{i}"} for i in range(65)], "teams"),
    ],
)
def test_a_malformed_team_folder_is_refused(teams, field):
    with pytest.raises(SpecError) as refused:
        parse_spec({**SPEC, "teams": teams})
    assert field in refused.value.fields


def test_the_team_folder_is_the_teams_group_s_and_what_members_make_in_it_stays_so(tmp_path):
    folder = sandbox.team_folder(tmp_path, "7", 70007)
    assert folder == tmp_path / ".teams" / "7"
    info = folder.stat()
    assert (info.st_uid, info.st_gid, stat.S_IMODE(info.st_mode)) == (0, 70007, 0o2770)
    assert stat.S_IMODE((tmp_path / ".teams").stat().st_mode) == 0o700
    # a member with a umask of 022 makes a file and a folder: both stay writable by the group
    made = subprocess.run(
        [sys.executable, "-c", "import os; os.umask(0o022); open('f', 'w').close(); os.mkdir('d')"],
        cwd=folder,
        check=True,
    )
    assert made.returncode == 0
    assert stat.S_IMODE((folder / "f").stat().st_mode) == 0o660 and (folder / "f").stat().st_gid == 70007
    assert stat.S_IMODE((folder / "d").stat().st_mode) == 0o2770
    # a folder someone loosened is put right at the next start
    os.chmod(folder, 0o777)
    os.chown(folder, 0, 0)
    sandbox.team_folder(tmp_path, "7", 70007)
    assert (folder.stat().st_gid, stat.S_IMODE(folder.stat().st_mode)) == (70007, 0o2770)


def test_the_teams_link_is_made_once_and_a_tenants_entry_is_left_alone(tmp_path):
    home = tmp_path / "alice-1"
    home.mkdir()
    sandbox.teams_link(home, 60001)
    assert os.readlink(home / "teams") == "/home/teams" and (home / "teams").lstat().st_uid == 60001
    other = tmp_path / "bob-2"
    other.mkdir()
    (other / "teams").symlink_to(tmp_path / "elsewhere")  # a link the tenant planted: not followed
    sandbox.teams_link(other, 60002)
    assert not (tmp_path / "elsewhere").exists() and os.readlink(other / "teams") == str(
        tmp_path / "elsewhere"
    )


def test_read_only_members_get_a_read_only_bind_and_every_member_the_folders_groups():
    command = sandbox.bwrap_command(
        bwrap="bwrap",
        user="alice-1",
        uid=60001,
        home=Path("/homes/alice-1"),
        private=Path("/state/run/s-1/private"),
        hidden=[],
        kept=[],
        writable=[],
        device_dir="/dev",
        device_nodes=[],
        command=["jupyter"],
        teams=[
            sandbox.TeamMount("/homes/.teams/7", "vision-lab", False),
            sandbox.TeamMount("/homes/.teams/8", "nlp", True),
        ],
        groups=[70008, 70007],
    )
    joined = " ".join(command)
    assert "--bind /homes/.teams/7 /home/teams/vision-lab" in joined
    assert "--ro-bind /homes/.teams/8 /home/teams/nlp" in joined
    assert "--groups=70007,70008" in command and "--clear-groups" not in command
    alone = sandbox.bwrap_command(
        bwrap="bwrap",
        user="bob-2",
        uid=60002,
        home=Path("/homes/bob-2"),
        private=Path("/p"),
        hidden=[],
        kept=[],
        writable=[],
        device_dir="/dev",
        device_nodes=[],
        command=["jupyter"],
    )
    assert "--clear-groups" in alone and "/home/teams" not in " ".join(alone)


def _measure_whole(meter: HomeMeter, rounds: int = 1000) -> None:
    for _ in range(rounds):
        meter.step()
        if not meter._walk and not meter._queue and meter.measured:
            return


def test_team_folders_are_measured_with_the_homes_and_sent_apart(tmp_path):
    (tmp_path / "alice-1").mkdir()
    folder = sandbox.team_folder(tmp_path, "7", None)
    (folder / "data").mkdir()
    (folder / "data" / "a.bin").write_bytes(b"x" * 8192)
    (tmp_path / ".teams" / "not-a-key").mkdir()
    local = HomeMeter(tmp_path, shared=False)
    _measure_whole(local)
    figures = local.measured[".teams/7"]
    assert figures["team"] == "7" and "user" not in figures and figures["files"] == 2
    assert figures["bytes"] >= 8192
    assert set(local.measured) == {"alice-1", ".teams/7"}
    body = build_heartbeat_body(local.pending())
    assert [f["user"] for f in body["homes"]] == ["alice-1"]
    assert body["team_folders"] == [figures]
    local.acknowledge(local.pending())
    assert local.pending() == []
    # a shared root: only the folders this node's sessions mounted
    shared = HomeMeter(tmp_path, shared=True)
    _measure_whole(shared, rounds=3)
    assert shared.measured == {}
    shared.note_teams(["7", "../x", ""])
    _measure_whole(shared)
    assert set(shared.measured) == {".teams/7"}


def build_heartbeat_body(homes: list[dict]) -> dict:
    class Reader:
        def metrics(self, *_):
            return {"gpus": []}, {}

        def inventory(self):
            return {"gpus": []}

    return build_heartbeat(
        listen_url="http://127.0.0.1:1",
        runtime="process",
        reader=Reader(),
        workloads=[],
        pids_by_session={},
        homes=homes,
    )
