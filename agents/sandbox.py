"""The process runtime's sandbox: bubblewrap around every workload, after Flatpak's and JupyterHub's.

What a tenant's code gets (``bwrap_command``):

- **its own uid**, one per user on this node from ``--sandbox-uids`` (``UidPool``; never shared
  between two users), with no capabilities, an empty bounding set and no-new-privileges. The agent
  runs as root on a GPU host, as a kubelet does: bubblewrap sets the sandbox up as root and
  ``setpriv`` drops to the tenant's uid as the last step. An agent that is not root runs its
  workloads as its own uid inside a user namespace instead (a development machine);
- **its own PID, mount, IPC, UTS and network namespaces**: it sees only its own processes, and its
  network is a loopback of its own, so the host's loopback (the agent API, the portal, PostgreSQL,
  Redis) and every other address are unreachable. JupyterLab listens on a Unix socket in the
  session's private folder, which only the agent's gateway dials;
- **a read-only host root** with the secrets hidden under empty tmpfs mounts: the agent's state
  (workload records, other homes, MPS folders), every ``--sandbox-hide`` path (the portal's data
  folder on a development host), ``/home``, ``/root``, ``/run``, ``/tmp`` and ``/var/tmp``. Its home
  (``/home/<user>``) and a private ``/tmp`` are the only writable places, with the folders of its user's
  teams at ``/home/teams/<team>`` (read-write, or read-only by a read-only bind: docs/STORAGE.md, "Team
  folders"); the portal's JupyterLab extensions (agents/labextensions) are bound read-only at
  ``/run/suanli-labextensions``;
- **a ``/dev`` of its own** holding only the allocated GPU's nodes (``/dev/nvidiaN``, ``nvidiactl``,
  ``nvidia-uvm`` and, for a MIG device, its ``nvidia-caps`` nodes), so the kernel enforces which GPU
  it may open whatever ``CUDA_VISIBLE_DEVICES`` says.

- **outbound HTTP(S) only through the node's egress proxy** (agents/egress.py), which refuses the
  host's loopback and own addresses, the portal and ``--egress-deny`` networks; ``--outbound off``
  leaves the sandbox with no way out at all.

Not covered yet (docs/SECURITY.md): a seccomp filter (a tenant may still create user namespaces of
its own where the kernel allows it) and cgroup limits (the process runtime has none).
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import shutil
import stat
import struct
import subprocess
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from agents import egress

PRIVATE_DIR = "/run/suanli"  # the session's private folder inside the sandbox: config, socket, runtime
HOME_ROOT = "/home"
TEAMS_ROOT = "/home/teams"  # team folders in the sandbox; no home is named ``teams`` (each ends in -<id>)
TEAMS_LINK = "teams"  # in the home: a link to TEAMS_ROOT, so JupyterLab's file browser shows them
ALWAYS_HIDDEN = ("/home", "/root", "/run", "/tmp", "/var/tmp")
PRIVATE_TMP = ("/tmp", "/var/tmp")  # empty and writable: the workload's own
DEFAULT_UIDS = (60000, 64999)


class SandboxUnavailable(Exception):
    """bubblewrap is missing or cannot create namespaces here; the message says what to do."""


def parse_uid_range(text: str, *, option: str = "--sandbox-uids") -> tuple[int, int]:
    first, sep, last = text.partition("-")
    if not sep or not first.strip().isdigit() or not last.strip().isdigit():
        raise ValueError(f"{option} must be FIRST-LAST, got {text!r}")
    low, high = int(first), int(last)
    if not 1000 <= low <= high < 2**31:
        raise ValueError(f"{option} must lie within 1000..2^31 and be ordered, got {text!r}")
    return low, high


def probe(bwrap: str | None) -> None:
    """Raise SandboxUnavailable unless bubblewrap can build this runtime's sandbox on this host."""
    if bwrap is None:
        raise SandboxUnavailable(
            "the process runtime runs every workload in a bubblewrap sandbox, and bwrap is not on PATH: "
            "install Debian's bubblewrap (and util-linux's setpriv), or pass --sandbox none on a "
            "single-user development machine only"
        )
    if os.geteuid() == 0 and shutil.which("setpriv") is None:
        raise SandboxUnavailable(
            "setpriv (util-linux) is not on PATH: the sandbox cannot drop to a tenant uid"
        )
    command = [bwrap, *_namespaces(), "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "true"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=30, check=False)
    if result.returncode != 0:
        raise SandboxUnavailable(
            "bubblewrap cannot create the sandbox's namespaces on this host "
            f"({result.stderr.strip() or f'exit {result.returncode}'}); a container needs "
            "--privileged or CAP_SYS_ADMIN, a host needs user namespaces enabled"
        )


def _namespaces() -> list[str]:
    if os.geteuid() == 0:  # no user namespace: the tenant's uid is a real one, dropped to by setpriv
        return ["--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
    return ["--unshare-all", "--cap-drop", "ALL"]


class UidPool:
    """One uid per user from the configured range, kept in a JSON table so a user's home keeps its owner
    across sessions and agent restarts: ``<state>/sandbox-uids.json`` on one node, or the shared homes
    root's table that every node of a pool reads and writes (each under an exclusive ``flock`` of the
    table's lock file, which NFS and CephFS honour across hosts), so a user is the same uid everywhere."""

    def __init__(
        self, path: Path, uid_range: tuple[int, int] = DEFAULT_UIDS, *, option: str = "--sandbox-uids"
    ) -> None:
        self.path = path
        self.range = uid_range
        self.option = option  # named in the error when the range is spent
        self._lock = threading.Lock()

    def for_user(self, user: str) -> int:
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        with self._lock, open(self.path.with_suffix(".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                table = json.loads(self.path.read_text())
            except (OSError, ValueError):
                table = {}
            uid = table.get(user)
            low, high = self.range
            if isinstance(uid, int) and low <= uid <= high:
                return uid
            taken = {v for v in table.values() if isinstance(v, int)}
            uid = next((u for u in range(low, high + 1) if u not in taken), None)
            if uid is None:
                raise SandboxUnavailable(f"every id of {self.option} {low}-{high} is taken")
            table[user] = uid
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(table, sort_keys=True))
            os.replace(tmp, self.path)
            return uid


def own(path: Path, uid: int) -> None:
    """Give a home or a private folder to its tenant (the whole tree when its top has another owner:
    a home made before sandbox uids, or by another agent version)."""
    if path.lstat().st_uid == uid:
        return
    os.lchown(path, uid, uid)
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            os.lchown(os.path.join(root, name), uid, uid)


TEAMS_DIR = ".teams"  # under the homes root: no home's name starts with a dot
# A default POSIX ACL (the ``system.posix_acl_default`` xattr, version 2: tag, permissions, id per entry)
# of owner rwx, group rwx, others nothing: what is made in a team folder is the group's to change whatever
# the maker's umask, and nobody else's.
_ACL_UNDEFINED_ID = 0xFFFFFFFF
TEAM_DEFAULT_ACL = struct.pack("<I", 2) + b"".join(
    struct.pack("<HHI", tag, perms, _ACL_UNDEFINED_ID) for tag, perms in ((0x01, 7), (0x04, 7), (0x20, 0))
)
log = logging.getLogger("agents.sandbox")


def team_folder(homes: Path, key: str, gid: int | None) -> Path:
    """The team folder ``<homes>/.teams/<key>``, made on first use, and its permissions (set again at
    every start, so a folder made by another node or agent version is put right): owned by root and
    the team's group ``gid``, mode 2770 (setgid: everything made in it belongs to the group, so every
    member's uid may write it and no other), with a default ACL giving the group read-write. ``gid``
    None (an agent that is not root) leaves the folder its own, mode 0700."""
    teams = homes / TEAMS_DIR
    teams.mkdir(mode=0o700, parents=True, exist_ok=True)
    folder = teams / key
    folder.mkdir(mode=0o700, exist_ok=True)
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if gid is not None:
            if (info.st_uid, info.st_gid) != (0, gid):
                os.fchown(fd, 0, gid)
            if stat.S_IMODE(info.st_mode) != 0o2770:
                os.fchmod(fd, 0o2770)
            try:
                if os.getxattr(fd, "system.posix_acl_default") != TEAM_DEFAULT_ACL:
                    raise OSError(errno.ENODATA, "another default ACL")
            except OSError:
                try:
                    os.setxattr(fd, "system.posix_acl_default", TEAM_DEFAULT_ACL)
                except OSError as exc:  # a filesystem without POSIX ACLs: members' umask decides
                    log.warning("no default ACL on team folder %s (%s)", folder, exc)
    finally:
        os.close(fd)
    return folder


def teams_link(home: Path, uid: int | None) -> None:
    """A link ``teams`` -> ``/home/teams`` in the home, made when the home has no entry of that name (one
    the tenant made, or removed, is theirs to keep): JupyterLab's file browser, rooted at the home, shows
    the team folders through it. Made relative to the home's descriptor: nothing is followed."""
    fd = os.open(home, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        try:
            os.symlink(TEAMS_ROOT, TEAMS_LINK, dir_fd=fd)
        except FileExistsError:
            return
        if uid is not None:
            os.chown(TEAMS_LINK, uid, uid, dir_fd=fd, follow_symlinks=False)
    finally:
        os.close(fd)


def home_in_sandbox(user: str) -> str:
    return f"{HOME_ROOT}/{user}"


def team_in_sandbox(name: str) -> str:
    return f"{TEAMS_ROOT}/{name}"


@dataclass(frozen=True)
class TeamMount:
    """A team folder for ``bwrap_command``: its host path, its name in the sandbox, and how bound."""

    source: str
    name: str
    read_only: bool


def bwrap_command(
    *,
    bwrap: str,
    user: str,
    uid: int | None,
    home: Path,
    private: Path,
    hidden: Iterable[str],
    kept: Iterable[str],
    writable: Iterable[str],
    device_dir: str,
    device_nodes: Iterable[str],
    command: list[str],
    preload_file: str | None = None,
    egress_dir: str | None = None,
    read_only: Mapping[str, str] | None = None,
    teams: Iterable[TeamMount] = (),
    groups: Iterable[int] = (),
) -> list[str]:
    """The bubblewrap command line around ``command`` (see the module docstring).

    ``hidden`` are host paths covered by an empty tmpfs; ``kept`` are paths under one of them that the
    workload still needs read-only (its Python environment, libvgpu.so); ``writable`` are paths it needs
    read-write (the GPU's MPS pipe folder); ``read_only`` maps host folders to where the workload sees
    them, read-only, under ``/run`` (the JupyterLab extensions every workload loads). ``preload_file``
    (naming HAMi's libvgpu.so) becomes the sandbox's own read-only ``/etc/ld.so.preload``, which the
    dynamic loader reads for every process whatever its environment says: unsetting ``LD_PRELOAD`` does
    not remove the library. ``teams`` are bound at ``/home/teams/<name>`` (``--ro-bind`` for a read-only
    member: the kernel refuses its writes) and ``groups`` become the tenant's supplementary groups (the
    team folders' gids) in place of none."""
    args = [bwrap, *_namespaces(), "--die-with-parent", "--new-session", "--ro-bind", "/", "/"]
    covered: list[str] = []
    for path in sorted({os.path.abspath(p) for p in (*ALWAYS_HIDDEN, *hidden)}, key=len):
        if os.path.isdir(path) and not any(_under(path, c) for c in covered):
            covered.append(path)
            args += ["--perms", "1777" if path in PRIVATE_TMP else "0755", "--tmpfs", path]
    made: set[str] = set()

    def reach(path: str) -> None:  # bubblewrap makes missing parents 0700: make them passable first
        for folder in covered:
            if _under(path, folder) and path != folder:
                parts = Path(path).relative_to(folder).parts[:-1]
                for depth in range(1, len(parts) + 1):
                    parent = os.path.join(folder, *parts[:depth])
                    if parent not in made:
                        made.add(parent)
                        args.extend(["--perms", "0755", "--dir", parent])

    for path in sorted({os.path.abspath(p) for p in kept}):
        if os.path.exists(path) and any(_under(path, c) for c in covered):
            reach(path)
            args += ["--ro-bind", path, path]
    for path in sorted({os.path.abspath(p) for p in writable}):
        if os.path.exists(path):
            reach(path)
            args += ["--bind", path, path]
    if preload_file:
        args += _etc_with_preload(preload_file)
    args += ["--dev", "/dev", "--proc", "/proc"]
    for node in device_nodes:
        source = os.path.join(device_dir, node)
        if os.path.exists(source):
            args += ["--dev-bind", source, f"/dev/{node}"]
    inside_home = home_in_sandbox(user)
    args += ["--bind", str(home), inside_home, "--bind", str(private), PRIVATE_DIR]
    args += _team_binds(teams)
    if egress_dir:
        args += ["--ro-bind", egress_dir, egress.SANDBOX_DIR]
    for source, target in (read_only or {}).items():
        args += ["--ro-bind", source, target]
    args += ["--setenv", "HOME", inside_home, "--chdir", inside_home, "--"]
    if uid is not None:
        args += _drop_to(uid, groups)
    return args + command


def _team_binds(teams: Iterable[TeamMount]) -> list[str]:
    """Each team folder at ``/home/teams/<name>``: ``--ro-bind`` for a read-only member."""
    teams = list(teams)
    args = ["--perms", "0755", "--dir", TEAMS_ROOT] if teams else []
    for team in teams:
        args += ["--ro-bind" if team.read_only else "--bind", team.source, team_in_sandbox(team.name)]
    return args


def _drop_to(uid: int, groups: Iterable[int]) -> list[str]:
    """bubblewrap's last step as root: ``setpriv`` to the tenant's uid, its team folders' gids as its
    only supplementary groups, no capabilities, no new privileges."""
    gids = sorted(set(groups))
    return [
        "setpriv",
        f"--reuid={uid}",
        f"--regid={uid}",
        f"--groups={','.join(map(str, gids))}" if gids else "--clear-groups",
        "--inh-caps=-all",
        "--bounding-set=-all",
        "--no-new-privs",
        "--",
    ]


def _etc_with_preload(preload_file: str) -> list[str]:
    """A read-only ``/etc`` of the host's entries plus ``ld.so.preload`` from ``preload_file``. The
    host's ``/etc`` cannot take a new file under a read-only root, so the sandbox gets a tmpfs ``/etc``
    with every host entry bound back (symbolic links as links)."""
    args = ["--perms", "0755", "--tmpfs", "/etc"]
    for entry in sorted(os.listdir("/etc")):
        path = f"/etc/{entry}"
        if entry == "ld.so.preload":
            continue
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        else:
            args += ["--ro-bind", path, path]
    return [*args, "--ro-bind", preload_file, "/etc/ld.so.preload", "--remount-ro", "/etc"]


def _under(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")
