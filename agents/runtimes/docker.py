"""The ``docker`` runtime: one container per session, through the Docker SDK.

``container_spec`` is a pure function (tested in full without an engine); ``DockerRuntime`` hands it
to the engine. The GPU is requested by UUID, so the container sees exactly the plan's device.

The container has no network of its own (``network_mode: none``): it cannot reach the host's services,
the agent, the portal or another container. JupyterLab listens on a Unix socket in the session's
private folder, bind-mounted from the agent's state, which the agent's gateway dials as it does for the
process runtime. Outbound HTTP(S), when the node allows it, goes through the same egress proxy: its
socket folder is mounted read-only and a relay inside the container serves 127.0.0.1:3128.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import docker
import docker.errors
import docker.types

from agents import egress
from agents.activity import cgroup_cpu_seconds
from agents.gpuplan import GpuPlan, enforcement
from agents.runtimes.base import (
    JUPYTER_LAB_MAIN,
    LABEXTENSIONS_DIR,
    LABEXTENSIONS_IN_WORKLOAD,
    Runtime,
    RuntimeHandle,
    RuntimeStartError,
    jupyter_config,
    labextensions_option,
)
from agents.spec import WorkloadSpec

CONTAINER_RUN = "/run/jupyter"  # the session's private folder inside the container
SOCK_NAME = "jupyter.sock"
CONTAINER_HOME = "/home/jovyan"
CONTAINER_USER = "1000:100"  # jovyan:users in the Jupyter images
CONTAINER_IDS = (1000, 100)
LABEL_PREFIX = "io.suanli"


def container_name(session_id: str) -> str:
    return f"suanli-{session_id}"


def _mounts(spec: WorkloadSpec, plan: GpuPlan, *, private_dir: str, egress_dir: str | None) -> list:
    """The home volume, the private folder, the lab extensions (read-only), the egress socket's folder
    (read-only) and what the GPU plan mounts."""
    return [
        docker.types.Mount(target=CONTAINER_HOME, source=f"suanli-home-{spec.user}", type="volume"),
        docker.types.Mount(target=CONTAINER_RUN, source=private_dir, type="bind"),
        docker.types.Mount(
            target=LABEXTENSIONS_IN_WORKLOAD, source=str(LABEXTENSIONS_DIR), type="bind", read_only=True
        ),
        *(
            [docker.types.Mount(target=egress.SANDBOX_DIR, source=egress_dir, type="bind", read_only=True)]
            if egress_dir
            else []
        ),
        *(
            docker.types.Mount(target=m.target, source=m.source, type="bind", read_only=m.read_only)
            for m in plan.mounts
        ),
    ]


def container_spec(
    spec: WorkloadSpec,
    plan: GpuPlan,
    *,
    private_dir: str,
    egress_dir: str | None,
    default_image: str,
    shm_mib: int,
    pids_limit: int,
) -> dict[str, Any]:
    """Keyword arguments for ``client.containers.run`` (pure: no engine, no file system)."""
    config = json.dumps(jupyter_config(spec.token))
    command = [
        "bash",
        "-c",
        # The token goes through a 0600 file, not argv (visible to `docker top` and `ps`).
        'umask 077 && printf %s "$SUANLI_JUPYTER_CONFIG" > /tmp/jupyter_server_config.json'
        f" && unset SUANLI_JUPYTER_CONFIG && exec python3 -c {shlex.quote(JUPYTER_LAB_MAIN)} --no-browser"
        " --config=/tmp/jupyter_server_config.json"
        f" --ServerApp.sock={CONTAINER_RUN}/{SOCK_NAME} --ServerApp.sock_mode=0600"
        " --ServerApp.allow_remote_access=True"
        f" --ServerApp.base_url={spec.base_url} --ServerApp.root_dir={CONTAINER_HOME}"
        f" {labextensions_option(LABEXTENSIONS_IN_WORKLOAD)}",
    ]
    environment = {**plan.env, "SUANLI_JUPYTER_CONFIG": config}
    if egress_dir:
        command = egress.relay_command("python3", command)
        environment |= egress.proxy_env()
    device_requests = []
    if plan.device_uuid is not None:
        device_requests.append(
            docker.types.DeviceRequest(
                device_ids=list(plan.device_uuids or (plan.device_uuid,)), capabilities=[["gpu"]]
            )
        )
    return {
        "image": spec.environment.image or default_image,
        "name": container_name(spec.session_id),
        "command": command,
        "detach": True,
        "environment": environment,
        "labels": {
            f"{LABEL_PREFIX}.session": spec.session_id,
            f"{LABEL_PREFIX}.user": spec.user,
            f"{LABEL_PREFIX}.profile": plan.profile or "cpu",
        },
        "network_mode": "none",
        "mounts": _mounts(spec, plan, private_dir=private_dir, egress_dir=egress_dir),
        "device_requests": device_requests,
        "mem_limit": f"{spec.limits.memory_mib}m",
        "memswap_limit": f"{spec.limits.memory_mib}m",
        "nano_cpus": int(spec.limits.cpu_cores * 1_000_000_000),
        "shm_size": f"{shm_mib}m",
        "pids_limit": pids_limit,
        "ipc_mode": "host" if plan.mps_pipe_directory else None,  # MPS clients share the daemon's IPC
        "working_dir": CONTAINER_HOME,
        "restart_policy": {"Name": "no"},
        # The same promises as the process runtime's sandbox, by the engine's means: a non-root user,
        # no capabilities, no privilege gain, a read-only root with only the home and /tmp writable.
        "user": CONTAINER_USER,
        "cap_drop": ["ALL"],
        "security_opt": ["no-new-privileges:true"],
        "read_only": True,
        "tmpfs": {"/tmp": "rw,nosuid,nodev,size=1g"},
    }


@dataclass(frozen=True, kw_only=True)
class DockerHandle(RuntimeHandle):
    """The docker runtime's own: the session's container."""

    container_id: str
    container_name: str


class DockerRuntime(Runtime):
    name = "docker"
    handle_class = DockerHandle

    def __init__(self, options) -> None:
        super().__init__(options)
        self._client = None

    def client(self):
        if self._client is None:
            try:
                self._client = docker.from_env()
                self._client.ping()
            except docker.errors.DockerException as exc:
                self._client = None
                raise RuntimeStartError(
                    f"the Docker engine cannot be reached: {exc}", code="runtime_unavailable"
                )
        return self._client

    def start(self, spec: WorkloadSpec, plan: GpuPlan) -> DockerHandle:
        if spec.environment.home_prefix is not None:  # a user's saved image (a commit) is not built yet
            raise RuntimeStartError(
                "environment.home_prefix: users' own environments run on the process runtime only",
                code="environment_unavailable",
            )
        if spec.environment.interface != "jupyterlab":
            raise RuntimeStartError(
                "the docker runtime serves JupyterLab only (VS Code runs on the process runtime)",
                code="environment_unavailable",
            )
        client = self.client()
        private = Path(self.options.state_dir) / "run" / spec.session_id / "private"
        if private.parent.exists():
            shutil.rmtree(private.parent)
        private.mkdir(parents=True, mode=0o700)
        if os.geteuid() == 0:  # the container's user creates its socket there
            os.chown(private, *CONTAINER_IDS)
        kwargs = container_spec(
            spec,
            plan,
            private_dir=str(private),
            egress_dir=self.options.egress_dir,
            default_image=self.options.default_image,
            shm_mib=self.options.shm_mib,
            pids_limit=self.options.pids_limit,
        )
        kwargs = {k: v for k, v in kwargs.items() if v is not None}
        try:
            stale = client.containers.get(kwargs["name"])
            stale.remove(force=True)
        except docker.errors.NotFound:
            pass
        try:
            container = client.containers.run(**kwargs)
        except docker.errors.ImageNotFound as exc:
            raise RuntimeStartError(f"no image {kwargs['image']}: {exc}", code="environment_unavailable")
        except docker.errors.DockerException as exc:
            raise RuntimeStartError(f"docker could not start the container: {exc}")
        return DockerHandle(
            base_url=spec.base_url,
            upstream_url=f"unix:{private / SOCK_NAME}",
            socket_path=str(private / SOCK_NAME),
            run_dir=str(private.parent),
            enforcement=enforcement(
                plan, device_isolated=True, preload_pinned=plan.preload_vgpu, isolated_by="device-request"
            ),
            container_id=container.id,
            container_name=kwargs["name"],
        )

    def _container(self, handle: DockerHandle):
        try:
            return self.client().containers.get(handle.container_id)
        except docker.errors.NotFound:
            return None

    def poll(self, handle: DockerHandle) -> str | None:
        container = self._container(handle)
        if container is None:
            return "the container is gone"
        container.reload()
        if container.status in ("created", "running", "restarting"):
            return None
        code = container.attrs.get("State", {}).get("ExitCode")
        return f"container {container.status} (exit code {code})"

    def pids(self, handle: DockerHandle, children: dict[int, list[int]] | None = None) -> set[int]:
        container = self._container(handle)
        if container is None or container.status != "running":
            return set()
        try:
            top = container.top(ps_args="-eo pid")
        except Exception:  # noqa: BLE001 - metrics must not fail on a racing container
            return set()
        return {int(row[0]) for row in top.get("Processes") or [] if row and row[0].isdigit()}

    def cpu_seconds(self, handle: DockerHandle, children: dict[int, list[int]] | None = None) -> float | None:
        """The container's cgroup ``cpu.stat``: every process it ran, reaped or not."""
        container = self._container(handle)
        pid = container.attrs.get("State", {}).get("Pid") if container is not None else None
        return cgroup_cpu_seconds(pid) if pid else None

    def stop(self, handle: DockerHandle) -> None:
        container = self._container(handle)
        if container is None:
            return
        try:
            container.stop(timeout=10)
        finally:
            container.remove(force=True)
