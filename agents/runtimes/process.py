"""The ``process`` runtime: JupyterLab as a local process in a bubblewrap sandbox (agents/sandbox.py).

Layout under the state dir: ``homes/<user>/`` (the user's persistent home, ``/home/<user>`` in the
sandbox; under ``--homes-root`` instead when the node mounts a shared one), ``run/<session>/`` (the
launcher's log and exit file, the agent's) and ``run/<session>/private/`` (the workload's: Jupyter's
config with its token, its runtime files and the Unix socket it listens on, ``/run/suanli`` in the
sandbox). JupyterLab also loads the portal's lab extensions (agents/labextensions: the stop warnings
and "I'm still here"), read-only in the sandbox.
Without a sandbox (``--sandbox none``, a single-user development machine) the same folders are used at
their host paths.

Limits: containers get cgroups; a plain process gets what the host allows without privileges:
the CPU count by affinity (``ceil(cpu_cores)`` CPUs) and memory by ``RLIMIT_DATA`` per process
(``RLIMIT_AS`` would break Jupyter, which maps far more address space than it uses). Both are
recorded in its handle, as is the sandbox in use.

HAMi's ``libvgpu.so`` is preloaded with ``LD_PRELOAD`` here: a read-only root cannot take a new file
at ``/etc/ld.so.preload`` (bubblewrap cannot create the mount point), and every process of the
workload inherits the variable. The docker runtime mounts the preload file instead.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agents import egress, environments, sandbox
from agents.gpuplan import VGPU_LIB_TARGET, GpuPlan, enforcement
from agents.runtimes import launcher
from agents.runtimes.base import (
    CODE_SERVER_ENTRY,
    JUPYTER_LAB_MAIN,
    LABEXTENSIONS_DIR,
    LABEXTENSIONS_IN_WORKLOAD,
    Runtime,
    RuntimeHandle,
    RuntimeStartError,
    code_server_installed,
    code_server_node,
    jupyter_config,
    labextensions_option,
)
from agents.spec import WorkloadSpec

STOP_WAIT_SECONDS = 12.0
SOCK_NAME = "jupyter.sock"
CONFIG_NAME = "jupyter_server_config.json"  # in the private folder: the Jupyter token, mode 0600
CODE_SERVER_CONFIG_NAME = "code-server.yaml"  # in the private folder: code-server's, written by itself
EXIT_NAME = "exit.json"  # in the run folder: the launcher's record of how the workload ended
LOG_NAME = "workload.log"
SANDBOX_SOCK_DIR = "/run/jupyter"
SYSTEM_PATH = "/usr/local/bin:/usr/bin:/bin"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def short_socket_path(folder: Path) -> str:
    """``folder/jupyter.sock``, or the same socket through a short link to the folder when that path
    is too long for a Unix socket (the unsandboxed development mode on a deep state dir)."""
    path = str(folder / SOCK_NAME)
    if len(os.fsencode(path)) <= 100:
        return path
    link = Path(tempfile.gettempdir()) / f"suanli-sock-{zlib.crc32(str(folder).encode()):08x}"
    with contextlib.suppress(FileNotFoundError):
        link.unlink()
    link.symlink_to(folder)
    return str(link / SOCK_NAME)


def process_start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks (None when gone or a zombie): guards against a
    recycled pid after an agent restart."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])


def jupyter_command(
    python: str,
    *,
    sock: str,
    base_url: str,
    root_dir: str,
    config_file: str,
    as_root: bool,
    labextensions: str,
) -> list[str]:
    # The token travels in a 0600 config file, not argv: /proc/<pid>/cmdline is world-readable.
    # JupyterLab listens on a Unix socket only the agent (its gateway) connects to; the Host the
    # portal's proxy sends is the agent's address, hence allow_remote_access.
    return [
        python,
        "-c",
        JUPYTER_LAB_MAIN,
        "--no-browser",
        f"--config={config_file}",
        f"--ServerApp.sock={sock}",
        "--ServerApp.sock_mode=0600",
        "--ServerApp.allow_remote_access=True",
        f"--ServerApp.base_url={base_url}",
        f"--ServerApp.root_dir={root_dir}",
        labextensions_option(labextensions),
        *(["--ServerApp.allow_root=True"] if as_root else []),
    ]


def code_server_command(
    node: str, code_server: str, *, sock: str, config_file: str, folder: str
) -> list[str]:
    """VS Code in the browser on the workload's Unix socket. No password of its own: only the agent's
    gateway dials the socket, and the portal's proxy has authenticated the user (and refused a foreign
    Origin) before. It serves at the socket's root with relative links, so the gateway strips the
    session's base URL. Nothing calls home: no telemetry, no update check (which asks GitHub)."""
    return [
        node,
        os.path.join(code_server, CODE_SERVER_ENTRY),
        f"--socket={sock}",
        "--socket-mode=600",
        "--auth=none",
        f"--config={config_file}",
        "--disable-telemetry",
        "--disable-update-check",
        "--disable-workspace-trust",
        "--disable-getting-started-override",
        "--ignore-last-opened",
        folder,
    ]


@dataclass(frozen=True, kw_only=True)
class ProcessHandle(RuntimeHandle):
    """The process runtime's own: its launcher (the pid and its start time, against a recycled pid
    after an agent restart), the files the launcher writes, and what was set up, for operators."""

    pid: int
    pid_start_ticks: int | None
    exit_file: str
    log_file: str
    home: str | None = None
    home_in_sandbox: str | None = None
    sandbox: str | None = None
    outbound: str | None = None
    uid: int | None = None
    limits: Mapping[str, Any] | None = None


class ProcessRuntime(Runtime):
    name = "process"
    handle_class = ProcessHandle

    def __init__(self, options) -> None:
        super().__init__(options)
        self._children: dict[int, subprocess.Popen] = {}  # launchers this agent process started
        self._probed: str | None = None
        self.uids = sandbox.UidPool(options.uid_table, options.sandbox_uids)
        self.team_gids = sandbox.UidPool(options.team_gid_table, options.team_gids, option="--team-gids")

    def sandbox_in_use(self) -> str:
        """``bwrap``, or ``none`` only when the operator passed ``--sandbox none`` (development)."""
        if self.options.sandbox == "none":
            return "none"
        if self._probed is None:
            try:
                sandbox.probe(shutil.which("bwrap"))
            except sandbox.SandboxUnavailable as exc:
                raise RuntimeStartError(str(exc), code="sandbox_unavailable")
            self._probed = "bwrap"
        return self._probed

    def start(self, spec: WorkloadSpec, plan: GpuPlan) -> ProcessHandle:
        mode = self.sandbox_in_use()
        python = spec.environment.python
        if python and not environments.usable(python):  # refused before anything is made for it
            raise RuntimeStartError(
                f"environment {spec.environment.name}: {python} is not an executable on this node",
                code=environments.UNAVAILABLE,
            )
        interface = spec.environment.interface
        editor = self._code_server() if interface == "vscode" else None  # refused before anything is made
        uid = self.uids.for_user(spec.user) if mode == "bwrap" and os.geteuid() == 0 else None
        home, private = self._folders(spec, uid)
        teams, groups = self._team_folders(spec, uid) if mode == "bwrap" else ([], [])
        inside = sandbox.PRIVATE_DIR if mode == "bwrap" else str(private)
        home_seen = sandbox.home_in_sandbox(spec.user) if mode == "bwrap" else str(home)
        runs = self._layout(spec, python, home=home, home_seen=home_seen, private=private)
        python = runs.server_python
        # sun_path holds 108 bytes: inside the sandbox the socket has a short fixed path; without one a
        # path too long is bound through a short link to its folder.
        sock = f"{inside}/{SOCK_NAME}" if mode == "bwrap" else short_socket_path(private)
        as_root = uid is None
        command = self._server_command(
            spec, editor, python, sock=sock, inside=inside, home_seen=home_seen, as_root=as_root, mode=mode
        )
        env = {
            "PATH": f"{Path(python).parent}:{SYSTEM_PATH}",
            "HOME": home_seen,
            "USER": spec.user,
            "LANG": "C.UTF-8",
            "PYTHONUNBUFFERED": "1",
            "JUPYTER_RUNTIME_DIR": f"{inside}/runtime",
            **({"JUPYTER_PATH": f"{inside}/{environments.JUPYTER_DIR}"} if runs.kernel_spec else {}),
            **plan.env,
        }
        sources = {m.target: m.source for m in plan.mounts}
        preload_file = None
        if plan.preload_vgpu and mode == "bwrap":
            preload_file = self._preload_file(sources[VGPU_LIB_TARGET])
        elif plan.preload_vgpu:  # no sandbox: the variable alone, which the workload can unset
            env["LD_PRELOAD"] = sources[VGPU_LIB_TARGET]
        egress_dir = self.options.egress_dir if mode == "bwrap" else None
        if egress_dir:
            command = egress.relay_command(python, command)
            env |= egress.proxy_env()
        if mode == "bwrap":
            command = self._sandboxed(
                command,
                spec,
                plan,
                runs.kept,
                uid=uid,
                home=home,
                private=private,
                preload_file=preload_file,
                teams=teams,
                groups=groups,
            )
        limits = self._limits(spec)
        run_dir = private.parent
        child = self._launch(command, env, run_dir=run_dir, limits=limits)
        return ProcessHandle(
            base_url=spec.base_url,
            upstream_url=f"unix:{private / SOCK_NAME}",
            socket_path=str(private / SOCK_NAME),
            run_dir=str(run_dir),
            enforcement=enforcement(plan, device_isolated=mode == "bwrap", preload_pinned=bool(preload_file)),
            interface=interface,
            pid=child.pid,
            pid_start_ticks=process_start_ticks(child.pid),
            exit_file=str(run_dir / EXIT_NAME),
            log_file=str(run_dir / LOG_NAME),
            home=str(home),
            home_in_sandbox=home_seen,
            sandbox=mode,
            outbound="egress-proxy" if egress_dir else "off",
            uid=uid if uid is not None else os.geteuid(),
            limits=limits,
        )

    @staticmethod
    def _server_command(
        spec: WorkloadSpec,
        editor: tuple[str, str] | None,
        python: str,
        *,
        sock: str,
        inside: str,
        home_seen: str,
        as_root: bool,
        mode: str,
    ) -> list[str]:
        """code-server for a vscode workload (``editor``: its node and folder), else JupyterLab."""
        if editor is not None:
            config = f"{inside}/{CODE_SERVER_CONFIG_NAME}"
            return code_server_command(*editor, sock=sock, config_file=config, folder=home_seen)
        return jupyter_command(
            python,
            sock=sock,
            base_url=spec.base_url,
            root_dir=home_seen,
            config_file=f"{inside}/{CONFIG_NAME}",
            as_root=as_root and os.geteuid() == 0,
            labextensions=LABEXTENSIONS_IN_WORKLOAD if mode == "bwrap" else str(LABEXTENSIONS_DIR),
        )

    @staticmethod
    def _layout(
        spec: WorkloadSpec, python: str | None, *, home: Path, home_seen: str, private: Path
    ) -> environments.Layout:
        """How the environment runs (agents/environments.py), its kernel spec written into the private
        folder; RuntimeStartError ``environment_unavailable``, the private folder removed, when it
        cannot run here."""
        try:
            runs = environments.layout(
                name=spec.environment.name,
                python=python,
                home_prefix=spec.environment.home_prefix,
                home=home,
                home_seen=home_seen,
                path=SYSTEM_PATH,
            )
        except environments.EnvironmentUnavailable as exc:
            shutil.rmtree(private.parent, ignore_errors=True)
            raise RuntimeStartError(f"environment {spec.environment.name}: {exc}", code=exc.code) from None
        if runs.kernel_spec is not None:
            environments.kernel_spec_write(private, runs.kernel_spec)
        return runs

    def _folders(self, spec: WorkloadSpec, uid: int | None) -> tuple[Path, Path]:
        """The user's home (kept) and a fresh private folder for the session (Jupyter's config with
        the token, its socket and runtime files), owned by the sandbox's uid when there is one."""
        home = self.options.homes / spec.user
        run_dir = self.options.state_dir / "run" / spec.session_id
        private = run_dir / "private"
        self.options.homes.mkdir(parents=True, exist_ok=True, mode=0o700)
        home.mkdir(exist_ok=True, mode=0o700)
        if run_dir.exists():
            shutil.rmtree(run_dir)
        run_dir.mkdir(parents=True, mode=0o700)
        (private / "runtime").mkdir(parents=True, mode=0o700)
        fd = os.open(private / CONFIG_NAME, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as config:
            json.dump(jupyter_config(spec.token), config)
        if uid is not None:
            sandbox.own(home, uid)
            sandbox.own(private, uid)
        return home, private

    def _team_folders(self, spec: WorkloadSpec, uid: int | None) -> tuple[list[sandbox.TeamMount], list[int]]:
        """The spec's team folders, made or put right (``sandbox.team_folder``), with the supplementary
        groups the tenant needs: each folder's group, read-only ones too (a 2770 folder is unreadable
        without it; the read-only bind refuses the writes). A ``teams`` link in the home shows them."""
        if not spec.teams:
            return [], []
        mounts, groups = [], []
        for team in spec.teams:
            gid = self.team_gids.for_user(team.key) if uid is not None else None
            folder = sandbox.team_folder(self.options.homes, team.key, gid)
            mounts.append(sandbox.TeamMount(str(folder), team.name, team.read_only))
            if gid is not None:
                groups.append(gid)
        sandbox.teams_link(self.options.homes / spec.user, uid)
        return mounts, groups

    def _sandboxed(
        self,
        command: list[str],
        spec: WorkloadSpec,
        plan: GpuPlan,
        environment_folders: tuple[str, ...],
        *,
        uid: int | None,
        home: Path,
        private: Path,
        preload_file: str | None,
        teams: list[sandbox.TeamMount],
        groups: list[int],
    ) -> list[str]:
        # a vscode workload also needs code-server's folder, the node_modules npm hoisted its
        # dependencies into, and its node's folder, read-only (wherever they are: under /tmp too)
        editor = []
        if spec.environment.interface == "vscode":
            node, code_server = self._code_server()
            editor = [str(Path(code_server).parent), str(Path(os.path.realpath(node)).parent)]
        return sandbox.bwrap_command(
            bwrap=shutil.which("bwrap") or "bwrap",
            user=spec.user,
            uid=uid,
            home=home,
            private=private,
            # other users' homes: under the state dir, or every home of a shared root but this one
            hidden=[str(self.options.state_dir), str(self.options.homes), *self.options.sandbox_hide],
            # the environments' prefixes, and the interpreters they link to (agents/environments.py);
            # code-server's folder and its node's for a vscode workload
            kept=[*environment_folders, *editor, *(m.source for m in plan.mounts if m.read_only)],
            writable=[m.source for m in plan.mounts if not m.read_only],
            device_dir=self.options.device_dir,
            device_nodes=plan.device_nodes,
            command=command,
            preload_file=preload_file,
            egress_dir=self.options.egress_dir,
            read_only={str(LABEXTENSIONS_DIR): LABEXTENSIONS_IN_WORKLOAD},
            teams=teams,
            groups=groups,
        )

    def _code_server(self) -> tuple[str, str]:
        """node and the code-server folder for a vscode workload; RuntimeStartError when this node has
        none (agents/editors/install.sh was not run)."""
        folder = self.options.code_server
        if not code_server_installed(folder):
            raise RuntimeStartError(
                f"this node has no code-server for VS Code environments ({folder or 'none configured'}; "
                "agents/editors/install.sh installs it)",
                code="environment_unavailable",
            )
        return code_server_node(folder), str(folder)

    def _launch(
        self, command: list[str], env: dict[str, str], *, run_dir: Path, limits: dict
    ) -> subprocess.Popen:
        """The launcher (agents/runtimes/launcher.py) running ``command`` in a session of its own."""
        launch = [sys.executable, "-I", launcher.__file__, "--exit-file", str(run_dir / EXIT_NAME)]
        if limits["cpus"]:
            launch += ["--cpus", ",".join(map(str, limits["cpus"]))]
        launch += ["--rlimit-data-bytes", str(limits["rlimit_data_bytes"]), "--", *command]
        with open(run_dir / LOG_NAME, "ab") as log:
            child = subprocess.Popen(  # noqa: S603
                launch,
                env=env,
                cwd="/",
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own session: an agent restart leaves it running
            )
        self._children[child.pid] = child
        return child

    def _preload_file(self, library: str) -> str:
        """``<state>/vgpu/sandbox-ld.so.preload``, naming the library at its host path (which the
        sandbox shows read-only)."""
        path = self.options.state_dir / "vgpu" / "sandbox-ld.so.preload"
        path.parent.mkdir(parents=True, exist_ok=True)
        wanted = f"{os.path.abspath(library)}\n"
        if not path.exists() or path.read_text() != wanted:
            tmp = path.with_suffix(".tmp")
            tmp.write_text(wanted)
            tmp.chmod(0o644)
            os.replace(tmp, path)
        return str(path)

    def jupyter_token(self, handle: ProcessHandle) -> str | None:
        try:
            config = json.loads((Path(handle.run_dir or "") / "private" / CONFIG_NAME).read_text())
            return config["IdentityProvider"]["token"]
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def _limits(self, spec: WorkloadSpec) -> dict:
        available = sorted(os.sched_getaffinity(0))
        wanted = max(1, math.ceil(spec.limits.cpu_cores))
        cpus: list[int] = []
        if wanted < len(available):  # spread sessions over the host's CPUs, stably by session id
            first = zlib.crc32(spec.session_id.encode()) % len(available)
            cpus = [available[(first + i) % len(available)] for i in range(wanted)]
        return {
            "cpus": cpus,
            "cpu_note": f"pinned to {wanted} of {len(available)} CPUs" if cpus else "all CPUs (no cgroup)",
            "rlimit_data_bytes": spec.limits.memory_mib * 1024 * 1024,
            "memory_note": "RLIMIT_DATA per process (no cgroup)",
        }

    def _alive(self, handle: ProcessHandle) -> bool:
        child = self._children.get(handle.pid)
        if child is not None and child.poll() is not None:  # reap our own child
            self._children.pop(handle.pid, None)
            return False
        ticks = process_start_ticks(handle.pid)
        return ticks is not None and ticks == handle.pid_start_ticks

    def poll(self, handle: ProcessHandle) -> str | None:
        if self._alive(handle):
            return None
        try:
            record = json.loads(Path(handle.exit_file).read_text())
        except (OSError, ValueError):
            return "the workload's supervisor vanished (host reboot or killed with SIGKILL)"
        if record.get("stopped"):
            return "stopped"
        return f"jupyter exited with code {record.get('exit_code')}"

    def pids(self, handle: ProcessHandle, children: dict[int, list[int]] | None = None) -> set[int]:
        if not self._alive(handle):
            return set()
        return {handle.pid, *launcher.descendants(handle.pid, children)}

    def stop(self, handle: ProcessHandle) -> None:
        if not self._alive(handle):
            return
        pid = handle.pid
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_WAIT_SECONDS
        while time.monotonic() < deadline:
            if not self._alive(handle):
                return
            time.sleep(0.05)
        for leftover in [*launcher.descendants(pid), pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(leftover, signal.SIGKILL)
        while self._alive(handle) and time.monotonic() < deadline + 5:
            time.sleep(0.05)
