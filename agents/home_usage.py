"""How much each home under the homes root holds, for the portal's storage quotas (docs/STORAGE.md).

One home at a time, round robin, a bounded slice of its walk per heartbeat (``HOME_WALK_SECONDS`` and
``HOME_WALK_ENTRIES``): a walk that does not finish in one slice goes on in the next, and a home's
figures are published only when its walk is whole. Bytes are allocated blocks (``st_blocks * 512``,
what a kernel quota counts: a sparse file counts what it holds, not its length); files are every entry
but the home itself (folders and symbolic links included, as an inode quota counts them). A file with
several hard links counts once.

Symbolic links are never followed: each folder is opened with ``O_NOFOLLOW`` and its device and inode
checked against what its parent listed, so a tenant that swaps a folder for a link mid-walk (to another
home, to ``/etc``) gets that folder skipped, not someone else's files counted. Nothing crosses onto
another filesystem.

A round over the homes starts at most every ``HOME_ROUND_SECONDS`` (``--home-round-seconds``); a home
whose figures did not change is sent again only after ``HOME_RESEND_SECONDS``, so the portal writes what
changed, and ``measured_at`` is then the first time these figures were measured.

Which homes: on a node's own root (``local``) every home in it, since only this node's sessions made
them; on a shared root, the homes of the users this agent has run sessions for since it started (every
node of the pool measures the same home; the portal keeps the newest figure). Team folders
(``<root>/.teams/<key>``) are measured the same way, in the same rounds: on a local root every one, on a
shared root those of the teams whose folders this agent's sessions mounted; their figures carry ``team``
(the key) where a home's carry ``user``.
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from agents.sandbox import TEAMS_DIR  # team folders, beside the homes

HOME_WALK_SECONDS = 0.2  # per heartbeat
HOME_WALK_ENTRIES = 20_000  # per heartbeat
HOME_ROUND_SECONDS = 60.0  # a round over the homes starts at most this often
HOME_RESEND_SECONDS = 600.0  # unchanged figures go to the portal again after this long
_OPEN_FOLDER = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


def _now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


@dataclass
class _Walk:
    """One home's walk so far: folders left to list (path, device, inode) and the running totals.
    ``user`` is the folder's name under the root: a user's, or ``.teams/<key>``."""

    user: str
    pending: list[tuple[str, int, int]]
    device: int
    bytes: int = 0
    files: int = 0
    linked: set[tuple[int, int]] = field(default_factory=set)  # inodes with several links, seen once
    listing: tuple[str, int, os._ScandirIterator] | None = None  # a folder listed part way, kept open


class HomeMeter:
    """Measures homes under ``root`` a slice at a time; ``step`` once per heartbeat, ``pending`` the
    figures not yet acknowledged by the portal, ``acknowledge`` once it has them."""

    def __init__(
        self,
        root: Path,
        *,
        shared: bool,
        seconds: float = HOME_WALK_SECONDS,
        entries: int = HOME_WALK_ENTRIES,
        round_seconds: float = HOME_ROUND_SECONDS,
        resend_seconds: float = HOME_RESEND_SECONDS,
    ) -> None:
        self.root = root
        self.shared = shared
        self.seconds = seconds
        self.entries = entries
        self.round_seconds = round_seconds
        self.resend_seconds = resend_seconds
        self._round_began: float | None = None
        self._sent_at: dict[str, float] = {}  # user -> when their current figures were published
        self.measured: dict[str, dict] = {}  # user -> {"user", "bytes", "files", "measured_at"}
        self._unsent: set[str] = set()
        self._seen: set[str] = set()  # users with sessions here (a shared root's homes to measure)
        self._seen_teams: set[str] = set()  # and the teams whose folders they mounted
        self._queue: list[str] = []  # homes still to measure this round
        self._walk: _Walk | None = None

    def note_users(self, users: Iterable[str]) -> None:
        """The users of this node's workloads: on a shared root, only their homes are measured."""
        self._seen.update(u for u in users if u and not u.startswith("."))

    def note_teams(self, keys: Iterable[str]) -> None:
        """The keys of the team folders this node's workloads mount: on a shared root, only those are
        measured."""
        self._seen_teams.update(k for k in keys if k.isdigit())

    def _homes(self) -> list[str]:
        """The folders of this round, by their names under the root: homes, then team folders."""
        if self.shared:
            return sorted(self._seen) + [f"{TEAMS_DIR}/{key}" for key in sorted(self._seen_teams)]
        homes = self._folders(self.root, lambda name: not name.startswith("."))
        teams = self._folders(self.root / TEAMS_DIR, str.isdigit)
        return homes + [f"{TEAMS_DIR}/{key}" for key in teams]

    @staticmethod
    def _folders(root: Path, named) -> list[str]:
        try:
            with os.scandir(root) as listing:
                return sorted(e.name for e in listing if named(e.name) and e.is_dir(follow_symlinks=False))
        except OSError:
            return []

    def _begin(self, user: str) -> _Walk | None:
        try:
            home = os.lstat(self.root / user)
        except OSError:
            return None
        if not stat.S_ISDIR(home.st_mode):
            return None
        return _Walk(user, [(str(self.root / user), home.st_dev, home.st_ino)], home.st_dev)

    def step(self) -> None:
        """Go on measuring for at most ``seconds`` and ``entries``; publish each home walked whole."""
        deadline = time.monotonic() + self.seconds
        budget = self.entries
        while budget > 0 and time.monotonic() < deadline:
            if self._walk is None:
                if not self._queue:
                    began = time.monotonic()
                    if self._round_began is not None and began - self._round_began < self.round_seconds:
                        return
                    self._queue = self._homes()
                    if not self._queue:
                        return
                    self._round_began = began
                self._walk = self._begin(self._queue.pop(0))
                if self._walk is None:
                    continue
            budget = self._advance(self._walk, budget, deadline)
            if self._walk.listing is None and not self._walk.pending:
                walk, self._walk = self._walk, None
                self._publish(walk)
                if not self._queue:
                    return  # a round is over: the next starts at the next heartbeat

    def _publish(self, walk: _Walk) -> None:
        """A home walked whole: its figures, to be sent when they changed or were last sent long ago."""
        before, now = self.measured.get(walk.user), time.monotonic()
        unchanged = before is not None and (before["bytes"], before["files"]) == (walk.bytes, walk.files)
        if unchanged and now - self._sent_at.get(walk.user, now) < self.resend_seconds:
            return
        team = walk.user.removeprefix(f"{TEAMS_DIR}/") if walk.user.startswith(".") else None
        self.measured[walk.user] = {
            **({"team": team} if team is not None else {"user": walk.user}),
            "bytes": walk.bytes,
            "files": walk.files,
            "measured_at": _now_iso(),
        }
        self._sent_at[walk.user] = now
        self._unsent.add(walk.user)

    def _advance(self, walk: _Walk, budget: int, deadline: float) -> int:
        """List folders of ``walk`` until it is done or the budget is spent; the budget left. A folder
        whose listing the budget cuts short stays open and goes on at the next step."""
        while (walk.listing is not None or walk.pending) and budget > 0 and time.monotonic() < deadline:
            if walk.listing is None and not self._open_next(walk):
                continue
            path, fd, listing = walk.listing
            try:
                for entry in listing:
                    budget -= 1
                    self._count(walk, path, entry)
                    if budget <= 0 or time.monotonic() >= deadline:
                        return budget
            except OSError:
                pass
            listing.close()
            os.close(fd)
            walk.listing = None
        return budget

    @staticmethod
    def _open_next(walk: _Walk) -> bool:
        path, device, inode = walk.pending.pop()
        try:
            fd = os.open(path, _OPEN_FOLDER)
        except OSError:
            return False  # gone, or swapped for a link: skipped
        try:
            opened = os.fstat(fd)
            if (opened.st_dev, opened.st_ino) != (device, inode):
                os.close(fd)
                return False  # not the folder its parent listed
            walk.listing = (path, fd, os.scandir(fd))  # its entries' stat goes through ``fd``: kept open
        except OSError:
            os.close(fd)
            return False
        return True

    @staticmethod
    def _count(walk: _Walk, path: str, entry: os.DirEntry) -> None:
        try:
            info = entry.stat(follow_symlinks=False)
        except OSError:
            return
        if info.st_nlink > 1 and not stat.S_ISDIR(info.st_mode):
            key = (info.st_dev, info.st_ino)
            if key in walk.linked:
                return
            walk.linked.add(key)
        walk.files += 1
        walk.bytes += info.st_blocks * 512
        if stat.S_ISDIR(info.st_mode) and info.st_dev == walk.device:
            walk.pending.append((os.path.join(path, entry.name), info.st_dev, info.st_ino))

    def pending(self) -> list[dict]:
        """Figures measured since the portal last acknowledged some (a lost heartbeat sends them again):
        homes' (``user``) and team folders' (``team``)."""
        return [self.measured[u] for u in sorted(self._unsent)]

    def acknowledge(self, sent: Iterable[dict]) -> None:
        for figures in sent:
            name = figures["user"] if "user" in figures else f"{TEAMS_DIR}/{figures['team']}"
            if self.measured.get(name) is figures:
                self._unsent.discard(name)
