"""Removing a user's home from a homes root: this node's, on ``DELETE /v1/homes/<name>`` (docs/STORAGE.md,
"Retention"; the portal decides when, the agent only carries it out), and a pool's shared root, by the
portal's worker (``provisioner.services.home_retention``: the one import of the agent the portal makes
besides the development launcher, allowed by name in pyproject's import contracts; plain stdlib).

A home is tenant-made: it may hold symbolic links to anywhere (``/etc``, another home), FIFOs, folders
without end. Nothing here follows a link or leaves the tree: the home is first moved out of the way in
one ``rename`` into ``<root>/.suanli/removing/`` (a name no home can have: none starts with a dot), then
emptied with calls relative to folder descriptors opened ``O_NOFOLLOW | O_DIRECTORY``; an entry that is
not a folder (a file, a link, a FIFO) is unlinked as what it is. A folder nested deeper than
``DEPTH_MAX`` is moved up beside the home in the removal folder and emptied from there, so a tree of any
depth is removed with a bounded number of open descriptors. Nothing crosses onto another filesystem.
"""

from __future__ import annotations

import errno
import os
import secrets
import time
from pathlib import Path

from agents.spec import USER_RE

REMOVING_DIR = (".suanli", "removing")  # under the homes root, beside the homes
DEPTH_MAX = 32
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class HomeInUse(Exception):
    """A workload of the home's user is starting, running or stopping on this node."""


def home_name_valid(name: str) -> bool:
    """The agent's rule for user names (``agents.spec.USER_RE``): no slash, no leading dot, so never
    ``..``, ``.suanli`` or a path."""
    return bool(USER_RE.fullmatch(name))


def home_detach(root: Path, name: str) -> str:
    """Move the home ``name`` into the removal folder in one rename; its name there. FileNotFoundError
    when there is no such folder (a link or a file of that name is not a home). ValueError for a name
    that is not a home's."""
    if not home_name_valid(name):
        raise ValueError(f"not a home name: {name!r}")
    root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # the operator's: followed
    try:
        try:
            os.close(os.open(name, _DIR, dir_fd=root_fd))
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
                raise FileNotFoundError(errno.ENOENT, "no such home", name) from exc
            raise
        removing = root.joinpath(*REMOVING_DIR)
        removing.mkdir(mode=0o700, parents=True, exist_ok=True)
        detached = f"{name}.{secrets.token_hex(8)}"
        removing_fd = os.open(removing, _DIR)
        try:
            os.rename(name, detached, src_dir_fd=root_fd, dst_dir_fd=removing_fd)
        finally:
            os.close(removing_fd)
        return detached
    finally:
        os.close(root_fd)


def detached_remove(root: Path, detached: str) -> None:
    """Remove a home ``home_detach`` moved away, and everything in it."""
    removing_fd = os.open(root.joinpath(*REMOVING_DIR), _DIR)
    try:
        tree_remove(removing_fd, detached)
    finally:
        os.close(removing_fd)


def removing_sweep(root: Path, *, settled_seconds: float = 3600.0) -> int:
    """Finish removals cut short (the agent or worker killed while it emptied a detached home): remove
    every folder left in the removal folder whose last change is ``settled_seconds`` old, so one being
    emptied right now is left to its remover. How many went; a folder that cannot go (another
    filesystem mounted in it, an immutable file) is left for the next sweep."""
    removing = root.joinpath(*REMOVING_DIR)
    try:
        removing_fd = os.open(removing, _DIR)
    except FileNotFoundError:
        return 0
    removed = 0
    try:
        cutoff = time.time() - settled_seconds
        for entry in os.scandir(removing_fd):
            try:
                if entry.stat(follow_symlinks=False).st_ctime > cutoff:
                    continue
                if entry.is_dir(follow_symlinks=False):
                    tree_remove(removing_fd, entry.name)
                else:
                    os.unlink(entry.name, dir_fd=removing_fd)
                removed += 1
            except OSError:
                continue
    finally:
        os.close(removing_fd)
    return removed


def tree_remove(parent_fd: int, name: str) -> None:
    """Remove the folder ``name`` under the folder open at ``parent_fd``, and everything in it, never
    through a symbolic link. Folders deeper than ``DEPTH_MAX`` are moved up into ``parent_fd`` first (so
    ``parent_fd`` must be a folder nobody else names entries in). OSError ``EXDEV`` for a folder on
    another filesystem (a mount inside the tree), which is left where it is."""
    pending = [name]
    while pending:
        item = pending.pop()
        try:
            fd = os.open(item, _DIR, dir_fd=parent_fd)
        except FileNotFoundError:
            continue
        try:
            _empty(fd, parent_fd, os.fstat(fd).st_dev, 0, pending)
        finally:
            os.close(fd)
        os.rmdir(item, dir_fd=parent_fd)


def _empty(fd: int, top_fd: int, device: int, depth: int, pending: list[str]) -> None:
    """Remove everything in the folder open at ``fd``; too deep a folder is moved to ``top_fd`` and
    named in ``pending`` instead."""
    for entry in os.listdir(fd):
        try:
            child = os.open(entry, _DIR, dir_fd=fd)
        except OSError as exc:
            if exc.errno in (errno.ENOTDIR, errno.ELOOP):  # a file, a link (never followed), a FIFO
                os.unlink(entry, dir_fd=fd)
            elif exc.errno != errno.ENOENT:
                raise
            continue
        try:
            if os.fstat(child).st_dev != device:
                raise OSError(errno.EXDEV, "another filesystem is mounted in the tree", entry)
            if depth >= DEPTH_MAX:
                moved = f"deep.{secrets.token_hex(8)}"
                os.rename(entry, moved, src_dir_fd=fd, dst_dir_fd=top_fd)
                pending.append(moved)
                continue
            _empty(child, top_fd, device, depth + 1, pending)
        finally:
            os.close(child)
        os.rmdir(entry, dir_fd=fd)
