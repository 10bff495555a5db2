"""Runtimes: a small base class and a registry by name, after JupyterHub's Spawner.

``start`` launches the workload and returns its runtime state (JSON, persisted by the agent under
``--state-dir`` so another agent process can adopt it); ``poll`` answers None while it lives and the
reason it ended otherwise; ``ready`` says whether Jupyter answers; ``stop`` ends it and everything it
started. None of them blocks for long, except ``stop``, which waits for the workload to end.
"""

from __future__ import annotations

import http.client
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from agents.gateway import GatewayError, local_get
from agents.gpuplan import GpuPlan
from agents.spec import WorkloadSpec

_RUNTIMES: dict[str, type[Runtime]] = {}


class RuntimeStartError(Exception):
    """A workload that could not be started; the message says why."""


@dataclass(frozen=True)
class RuntimeOptions:
    state_dir: Path
    sandbox: str = "auto"  # process runtime: auto | bwrap (the same: a sandbox or a refusal) | none
    sandbox_uids: tuple[int, int] = (60000, 64999)
    sandbox_hide: tuple[str, ...] = ()  # host paths the sandbox never shows (the portal's data folder)
    egress_dir: str | None = None  # the node's egress proxy folder (agents/egress.py); None: outbound off
    device_dir: str = "/dev"  # where the GPU's device nodes are (a folder of stand-ins for a fake fleet)
    default_image: str = "quay.io/jupyter/base-notebook"
    shm_mib: int = 1024
    pids_limit: int = 4096


class Runtime:
    name: ClassVar[str]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _RUNTIMES[cls.name] = cls

    def __init__(self, options: RuntimeOptions) -> None:
        self.options = options

    def start(self, spec: WorkloadSpec, plan: GpuPlan) -> dict:
        raise NotImplementedError

    def poll(self, state: dict) -> str | None:
        raise NotImplementedError

    def stop(self, state: dict) -> None:
        raise NotImplementedError

    def pids(self, state: dict, children: dict[int, list[int]] | None = None) -> set[int]:
        """Host process ids of the workload, to map NVML's per-process figures to it. ``children``
        is one /proc scan (parent → children) shared by every workload of a heartbeat."""
        return set()

    def jupyter_token(self, state: dict) -> str | None:
        """The workload's Jupyter token when the agent lost it from memory (a restart); None when
        only the portal's next spec can tell."""
        return None

    def ready(self, state: dict, token: str | None) -> bool:
        """Whether Jupyter answers ``GET {base_url}api/status`` on its socket (or local port).
        Without the token (an adopted workload whose spec the portal has not re-sent yet) a 401/403
        still proves it answers."""
        headers = {"Authorization": f"token {token}"} if token else {}
        try:
            status = local_get(state, f"{state['base_url']}api/status", headers)
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
