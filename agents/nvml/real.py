"""The real NVML, through ``pynvml`` from the ``nvidia-ml-py`` package."""

from __future__ import annotations

from typing import Any

from agents.nvml.base import NvmlSource


class RealNvml(NvmlSource):
    name = "real"

    def open(self) -> Any:
        import pynvml

        pynvml.nvmlInit()  # raises NVMLError_LibraryNotFound / DriverNotLoaded without a GPU driver
        return pynvml
