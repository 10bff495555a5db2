"""Runtime seam: ``runtime_class("process")`` or ``runtime_class("docker")``."""

from agents.runtimes import docker, process  # noqa: F401 - register the runtimes
from agents.runtimes.base import (
    Runtime,
    RuntimeHandle,
    RuntimeOptions,
    RuntimeStartError,
    runtime_class,
    runtime_names,
)

__all__ = [
    "Runtime",
    "RuntimeHandle",
    "RuntimeStartError",
    "RuntimeOptions",
    "runtime_class",
    "runtime_names",
]
