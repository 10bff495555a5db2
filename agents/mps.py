"""One NVIDIA MPS control daemon per GPU that serves equal-share workloads.

Started on the first equal-share workload of a GPU (``nvidia-cuda-mps-control -d``) and asked to
quit after the last (``echo quit | nvidia-cuda-mps-control``), each with the GPU's pipe and log
directories. Counts are rebuilt from adopted workloads after an agent restart, so a daemon that
outlived the agent is neither started twice nor left behind.
"""

from __future__ import annotations

import os
import subprocess
import threading
from pathlib import Path

from agents.gpuplan import GpuPlan


class MpsError(Exception):
    pass


class MpsDaemons:
    def __init__(self, control_binary: str | None) -> None:
        self.control_binary = control_binary
        self._lock = threading.Lock()
        self._users: dict[str, set[str]] = {}

    def _env(self, plan: GpuPlan) -> dict[str, str]:
        return {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "CUDA_VISIBLE_DEVICES": plan.gpu_uuid,
            "CUDA_MPS_PIPE_DIRECTORY": plan.mps_pipe_directory,
            "CUDA_MPS_LOG_DIRECTORY": plan.mps_log_directory,
        }

    def adopt(self, session_id: str, plan: GpuPlan) -> None:
        with self._lock:
            self._users.setdefault(plan.gpu_uuid, set()).add(session_id)

    def acquire(self, session_id: str, plan: GpuPlan) -> None:
        if plan.mps_pipe_directory is None:
            return
        with self._lock:
            users = self._users.setdefault(plan.gpu_uuid, set())
            if not users:
                if self.control_binary is None:
                    raise MpsError("nvidia-cuda-mps-control is not available")
                Path(plan.mps_pipe_directory).mkdir(parents=True, exist_ok=True)
                Path(plan.mps_log_directory).mkdir(parents=True, exist_ok=True)
                result = subprocess.run(  # noqa: S603
                    [self.control_binary, "-d"], env=self._env(plan), capture_output=True, timeout=30
                )
                if result.returncode != 0:
                    raise MpsError(
                        f"MPS control daemon did not start: {result.stderr.decode(errors='replace')}"
                    )
            users.add(session_id)

    def release(self, session_id: str, plan: GpuPlan) -> None:
        if plan.mps_pipe_directory is None:
            return
        with self._lock:
            users = self._users.get(plan.gpu_uuid, set())
            users.discard(session_id)
            if not users and self.control_binary is not None:
                subprocess.run(  # noqa: S603
                    [self.control_binary],
                    input=b"quit\n",
                    env=self._env(plan),
                    capture_output=True,
                    timeout=30,
                )
                self._users.pop(plan.gpu_uuid, None)
