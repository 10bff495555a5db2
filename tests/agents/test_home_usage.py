"""The agent's measurement of homes: bounded, never through a symbolic link, spread over heartbeats."""

from __future__ import annotations

import os
from pathlib import Path

from agents.heartbeat import Heartbeats
from agents.home_usage import HomeMeter


def _home(root: Path, user: str, files: int, size: int = 4096) -> Path:
    home = root / user
    (home / "data" / "deep").mkdir(parents=True)
    for i in range(files):
        (home / "data" / "deep" / f"f{i}").write_bytes(b"x" * size)
    return home


def _measure_whole(meter: HomeMeter, rounds: int = 1000) -> None:
    for _ in range(rounds):
        meter.step()
        if not meter._walk and not meter._queue and meter.measured:
            return


def test_a_home_is_counted_in_allocated_blocks_and_entries(tmp_path):
    home = _home(tmp_path, "alice-1", files=3)
    sparse = home / "sparse"
    with sparse.open("wb") as out:
        out.truncate(1 << 30)  # a 1 GiB length that holds nothing
    os.link(home / "data" / "deep" / "f0", home / "hardlink")
    meter = HomeMeter(tmp_path, shared=False)
    meter.step()
    figures = meter.measured["alice-1"]
    assert figures["files"] == 2 + 3 + 1  # data, deep, f0..f2, sparse (the hard link once)
    blocks = sum(
        os.lstat(p).st_blocks * 512
        for p in [home / "data", home / "data" / "deep", sparse, *(home / "data" / "deep").iterdir()]
    )
    assert figures["bytes"] == blocks
    assert figures["bytes"] < 1 << 20
    assert figures["measured_at"].endswith("Z")


def test_symbolic_links_are_not_followed(tmp_path):
    secret = tmp_path / "elsewhere"
    _home(secret, "victim-2", files=50)
    homes = tmp_path / "homes"
    home = homes / "alice-1"
    home.mkdir(parents=True)
    (home / "link-to-folder").symlink_to(secret / "victim-2")
    (home / "link-to-file").symlink_to(secret / "victim-2" / "data" / "deep" / "f0")
    meter = HomeMeter(homes, shared=False)
    meter.step()
    assert meter.measured["alice-1"]["files"] == 2  # the two links themselves


def test_a_folder_swapped_for_a_link_after_listing_is_skipped(tmp_path):
    secret = tmp_path / "elsewhere"
    _home(secret, "victim-2", files=50)
    homes = tmp_path / "homes"
    (homes / "alice-1" / "sub").mkdir(parents=True)
    meter = HomeMeter(homes, shared=False, entries=1)
    meter.step()  # the home is listed: "sub" is pending, the budget spent
    assert meter._walk is not None and meter._walk.pending
    (homes / "alice-1" / "sub").rmdir()
    (homes / "alice-1" / "sub").symlink_to(secret / "victim-2")
    meter.step()
    assert meter.measured["alice-1"]["files"] == 1


def test_the_walk_keeps_to_its_budget_and_goes_on_at_the_next_heartbeat(tmp_path):
    _home(tmp_path, "alice-1", files=120)
    _home(tmp_path, "bob-2", files=5)
    meter = HomeMeter(tmp_path, shared=False, entries=50)
    meter.step()
    assert meter.measured == {}  # no half-measured figures are published
    steps = 1
    while "alice-1" not in meter.measured:
        meter.step()
        steps += 1
    assert steps >= 3  # 122 entries, at most ~50 a step (a folder is listed whole once opened)
    assert meter.measured["alice-1"]["files"] == 122
    while "bob-2" not in meter.measured:
        meter.step()
    assert meter.measured["bob-2"]["files"] == 7


def test_a_time_budget_of_nothing_measures_nothing(tmp_path):
    _home(tmp_path, "alice-1", files=5)
    meter = HomeMeter(tmp_path, shared=False, seconds=0)
    meter.step()
    assert meter.measured == {}


def test_a_shared_root_measures_only_the_homes_of_users_it_ran(tmp_path):
    _home(tmp_path, "alice-1", files=2)
    _home(tmp_path, "bob-2", files=2)
    (tmp_path / ".suanli").mkdir()
    meter = HomeMeter(tmp_path, shared=True)
    meter.step()
    assert meter.measured == {}
    meter.note_users(["bob-2", ".suanli"])
    meter.step()
    assert set(meter.measured) == {"bob-2"}


def test_figures_are_sent_until_the_portal_has_them(tmp_path):
    _home(tmp_path, "alice-1", files=2)
    meter = HomeMeter(tmp_path, shared=False)
    meter.step()
    sent = meter.pending()
    assert [f["user"] for f in sent] == ["alice-1"]
    assert meter.pending() == sent  # a failed heartbeat: sent again
    meter.acknowledge(sent)
    assert meter.pending() == []


class _NoWorkloads:
    def all(self):
        raise RuntimeError("boom")


def test_a_failing_measurement_costs_the_figures_not_the_heartbeat(tmp_path):
    beats = Heartbeats(
        portal="http://127.0.0.1:9",
        token="t",
        listen_url="http://x",
        runtime_name="process",
        workloads=_NoWorkloads(),
        interval_seconds=1,
        homes=HomeMeter(tmp_path, shared=False),
    )
    assert beats._measure_homes() == []


def test_a_new_round_waits_its_interval_and_unchanged_figures_are_not_sent_again(tmp_path):
    home = _home(tmp_path, "alice-1", files=2)
    meter = HomeMeter(tmp_path, shared=False, round_seconds=3600)
    meter.step()
    meter.acknowledge(meter.pending())
    (home / "new").write_text("x")
    meter.step()
    assert meter.measured["alice-1"]["files"] == 4 and meter.pending() == []  # not measured yet
    meter.round_seconds = 0
    meter.step()
    assert [f["files"] for f in meter.pending()] == [5]
    meter.acknowledge(meter.pending())
    meter.step()
    assert meter.pending() == []  # measured again, the same: nothing to send
    meter.resend_seconds = 0
    meter.step()
    assert [f["files"] for f in meter.pending()] == [5]  # the same, but long ago: sent to refresh
