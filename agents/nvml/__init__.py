"""NVML seam: ``nvml_source("real")`` or ``nvml_source("fake", fleet_path=…)``, then ``GpuReader``."""

from agents.nvml import fake, real  # noqa: F401 - register the sources
from agents.nvml.base import NvmlSource, nvml_source
from agents.nvml.reader import GpuReader

__all__ = ["GpuReader", "NvmlSource", "nvml_source"]
