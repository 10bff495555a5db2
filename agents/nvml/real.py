"""The real NVML, through ``pynvml`` from the ``nvidia-ml-py`` package."""

from __future__ import annotations

from typing import Any

import pynvml  # loads no library until nvmlInit: importing it on a host without a driver is harmless

from agents.nvml.base import NvmlSource


class RealNvml(NvmlSource):
    name = "real"

    def open(self) -> Any:
        pynvml.nvmlInit()  # raises NVMLError_LibraryNotFound / DriverNotLoaded without a GPU driver
        return pynvml
