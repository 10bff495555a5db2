"""A fake ``pynvml`` module built from a fleet file: the one fake at the hardware boundary.

It answers the pynvml functions the agent uses, with pynvml's argument and result shapes, and
raises pynvml's own ``NVMLError_*`` classes, so the agent's inventory and metrics code runs
unchanged over it. Processes "use" a fake GPU when their environment's ``CUDA_VISIBLE_DEVICES``
names the GPU (or one of its MIG devices) and they descend from the process the fake runs in: that is
how a workload started by the agent shows up in the per-process figures, as it would on a real host,
while the workloads of another agent on the same machine (fleet files share UUIDs) do not.

A fake GPU runs nothing, so what such a process "uses" is not measured: each one reports the fleet's
``process_sm_util_percent`` and ``process_memory_mib`` for its GPU (10 % and 256 MiB unless the file
says otherwise), every time, which is what a session's GPU activity then reads. Tests that need other
figures for given pids set them with ``set_processes``. As on real hardware, a GPU in MIG mode gives
per-process memory but no per-process utilisation.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from types import SimpleNamespace

import pynvml

from agents.nvml.base import NvmlSource
from agents.nvml.fleet import FakeGpu, FakeMig, Fleet, load_fleet

_MIB = 1024 * 1024
_SCAN_TTL_SECONDS = 1.0


def _error(code: int) -> pynvml.NVMLError:
    return pynvml.NVMLError(code)  # pynvml returns the matching NVMLError_* subclass


@dataclass
class _Handle:
    gpu: FakeGpu
    mig: FakeMig | None = None


class FakeNvml:
    """Module-like object: ``fake.nvmlDeviceGetCount()`` etc., as ``pynvml`` would answer."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self._lock = threading.Lock()
        self._initialised = 0
        self._calls = {gpu.index: 0 for gpu in fleet.gpus}
        self._started_monotonic = time.monotonic()
        self._injected: dict[str, list[tuple[int, int, int]]] = {}
        self._scan_at = 0.0
        self._scan: dict[str, list[int]] = {}
        self._handles = [_Handle(gpu) for gpu in fleet.gpus]
        self._mig_handles = [[_Handle(gpu, mig) for mig in gpu.mig] for gpu in fleet.gpus]
        # The real module's constants and error classes, so callers need no special case.
        for name in dir(pynvml):
            if name.startswith(("NVML_", "NVMLError")):
                setattr(self, name, getattr(pynvml, name))

    # -- test and bench hooks (the hardware's state, not the agent's) --------------------------
    def set_processes(self, device_uuid: str, processes: list[tuple[int, int, int]]) -> None:
        """Make (pid, sm_util_percent, used_mib) processes run on a device, beside scanned ones."""
        with self._lock:
            self._injected[device_uuid] = list(processes)

    # -- life cycle ---------------------------------------------------------------------------
    def nvmlInit(self) -> None:  # noqa: N802 - pynvml's names
        with self._lock:
            self._initialised += 1

    def nvmlShutdown(self) -> None:  # noqa: N802
        with self._lock:
            if self._initialised == 0:
                raise _error(pynvml.NVML_ERROR_UNINITIALIZED)
            self._initialised -= 1

    def _check_init(self) -> None:
        if self._initialised == 0:
            raise _error(pynvml.NVML_ERROR_UNINITIALIZED)

    def nvmlSystemGetDriverVersion(self) -> str:  # noqa: N802
        self._check_init()
        if self.fleet.driver_version is None:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return self.fleet.driver_version

    def nvmlSystemGetCudaDriverVersion(self) -> int:  # noqa: N802
        self._check_init()
        if self.fleet.cuda_version is None:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        major, _, minor = self.fleet.cuda_version.partition(".")
        return int(major) * 1000 + int(minor or 0) * 10

    def nvmlDeviceGetCount(self) -> int:  # noqa: N802
        self._check_init()
        return len(self.fleet.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> _Handle:  # noqa: N802
        self._check_init()
        if not 0 <= index < len(self._handles):
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self._handles[index]

    # -- per-device queries -------------------------------------------------------------------
    def _enter(self, handle: _Handle, call: str) -> FakeGpu:
        self._check_init()
        if not isinstance(handle, _Handle):
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        gpu = handle.gpu
        with self._lock:
            self._calls[gpu.index] += 1
            calls = self._calls[gpu.index]
        if gpu.lost_from_start or (gpu.lost_after_calls is not None and calls > gpu.lost_after_calls):
            raise _error(pynvml.NVML_ERROR_GPU_IS_LOST)
        if call in gpu.not_supported:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return gpu

    def nvmlDeviceGetUUID(self, handle: _Handle) -> str:  # noqa: N802
        gpu = self._enter(handle, "nvmlDeviceGetUUID")
        return handle.mig.uuid if handle.mig else gpu.uuid

    def nvmlDeviceGetMinorNumber(self, handle: _Handle) -> int:  # noqa: N802
        gpu = self._enter(handle, "nvmlDeviceGetMinorNumber")
        if handle.mig:
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return gpu.index  # /dev/nvidia<index>, as on a host whose driver numbered its GPUs in order

    def nvmlDeviceGetGpuInstanceId(self, handle: _Handle) -> int:  # noqa: N802
        gpu = self._enter(handle, "nvmlDeviceGetGpuInstanceId")
        if not handle.mig:
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return 1 + [h.mig for h in self._mig_handles[gpu.index]].index(handle.mig)

    def nvmlDeviceGetComputeInstanceId(self, handle: _Handle) -> int:  # noqa: N802
        self._enter(handle, "nvmlDeviceGetComputeInstanceId")
        if not handle.mig:
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return 0

    def nvmlDeviceGetName(self, handle: _Handle) -> str:  # noqa: N802
        gpu = self._enter(handle, "nvmlDeviceGetName")
        return f"{gpu.name} MIG {handle.mig.profile}" if handle.mig else gpu.name

    def nvmlDeviceGetPciInfo(self, handle: _Handle) -> SimpleNamespace:  # noqa: N802
        gpu = self._enter(handle, "nvmlDeviceGetPciInfo")
        return SimpleNamespace(busId=gpu.pci_bus_id, bus_id=gpu.pci_bus_id)

    def nvmlDeviceGetTopologyCommonAncestor(self, first: _Handle, second: _Handle) -> int:  # noqa: N802
        """GPUs of one ``topology_group`` meet under one PCIe switch (SINGLE), others at the CPU
        (NODE); NOT_SUPPORTED where the fleet gives no group, as on hosts whose driver cannot tell."""
        one = self._enter(first, "nvmlDeviceGetTopologyCommonAncestor")
        other = self._enter(second, "nvmlDeviceGetTopologyCommonAncestor")
        if one.topology_group is None or other.topology_group is None:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if one.topology_group == other.topology_group:
            return pynvml.NVML_TOPOLOGY_SINGLE
        return pynvml.NVML_TOPOLOGY_NODE

    def nvmlDeviceGetMemoryInfo(self, handle: _Handle) -> SimpleNamespace:  # noqa: N802
        gpu = self._enter(handle, "nvmlDeviceGetMemoryInfo")
        if handle.mig:
            total = handle.mig.memory_total_mib
            used = sum(mib for _pid, mib in self._processes(handle))
        else:
            total = gpu.memory_total_mib
            used = min(total, gpu.memory_used_mib + sum(mib for _pid, mib in self._processes(handle)))
        return SimpleNamespace(total=total * _MIB, used=used * _MIB, free=(total - used) * _MIB)

    def nvmlDeviceGetMigMode(self, handle: _Handle) -> list[int]:  # noqa: N802
        gpu = self._enter(handle, "nvmlDeviceGetMigMode")
        if handle.mig or not any(tag in gpu.name for tag in ("A100", "A30", "H100", "H200", "H20", "B200")):
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        mode = pynvml.NVML_DEVICE_MIG_ENABLE if gpu.mig else pynvml.NVML_DEVICE_MIG_DISABLE
        return [mode, mode]

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: _Handle) -> int:  # noqa: N802
        gpu = self._enter(handle, "nvmlDeviceGetMaxMigDeviceCount")
        return 7 if gpu.mig else 0

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: _Handle, index: int) -> _Handle:  # noqa: N802
        gpu = self._enter(handle, "nvmlDeviceGetMigDeviceHandleByIndex")
        if not gpu.mig:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if not 0 <= index < len(gpu.mig):
            raise _error(pynvml.NVML_ERROR_NOT_FOUND)
        return self._mig_handles[gpu.index][index]

    def nvmlDeviceIsMigDeviceHandle(self, handle: _Handle) -> bool:  # noqa: N802
        self._enter(handle, "nvmlDeviceIsMigDeviceHandle")
        return handle.mig is not None

    def nvmlDeviceGetUtilizationRates(self, handle: _Handle) -> SimpleNamespace:  # noqa: N802
        gpu = self._enter(handle, "nvmlDeviceGetUtilizationRates")
        if handle.mig or gpu.mig:  # as on real hardware: no device utilisation in MIG mode
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return SimpleNamespace(gpu=gpu.gpu_util_percent, memory=gpu.memory_util_percent)

    def nvmlDeviceGetTemperature(self, handle: _Handle, sensor: int) -> int:  # noqa: N802
        gpu = self._enter(handle, "nvmlDeviceGetTemperature")
        if handle.mig or sensor != pynvml.NVML_TEMPERATURE_GPU:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return gpu.temperature_c

    def nvmlDeviceGetPowerUsage(self, handle: _Handle) -> int:  # noqa: N802
        gpu = self._enter(handle, "nvmlDeviceGetPowerUsage")
        if handle.mig:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return int(gpu.power_w * 1000)

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: _Handle) -> int:  # noqa: N802
        gpu = self._enter(handle, "nvmlDeviceGetTotalEnergyConsumption")
        if handle.mig:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return int(gpu.power_w * (time.monotonic() - self._started_monotonic + 3600) * 1000)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: _Handle) -> list[SimpleNamespace]:  # noqa: N802
        self._enter(handle, "nvmlDeviceGetComputeRunningProcesses")
        return [
            SimpleNamespace(pid=pid, usedGpuMemory=mib * _MIB, gpuInstanceId=0, computeInstanceId=0)
            for pid, mib in self._processes(handle)
        ]

    def nvmlDeviceGetProcessUtilization(self, handle: _Handle, last_seen_timestamp: int) -> list:  # noqa: N802
        gpu = self._enter(handle, "nvmlDeviceGetProcessUtilization")
        if handle.mig or gpu.mig:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        now_us = int(time.time() * 1_000_000)
        samples = [
            SimpleNamespace(pid=pid, timeStamp=now_us, smUtil=sm, memUtil=sm // 2, encUtil=0, decUtil=0)
            for pid, sm, _mib in self._process_samples(handle)
        ]
        if not samples:
            raise _error(pynvml.NVML_ERROR_NOT_FOUND)
        return samples

    # -- which processes use a device ---------------------------------------------------------
    def _device_uuids(self, handle: _Handle) -> list[str]:
        if handle.mig:
            return [handle.mig.uuid]
        return [handle.gpu.uuid] + [m.uuid for m in handle.gpu.mig]

    def _process_samples(self, handle: _Handle) -> list[tuple[int, int, int]]:
        gpu = handle.gpu
        found: dict[int, tuple[int, int, int]] = {}
        scanned = self._scan_environ() if self.fleet.simulate_processes else {}
        for device_uuid in self._device_uuids(handle):
            for pid in scanned.get(device_uuid, ()):
                found[pid] = (pid, gpu.process_sm_util_percent, gpu.process_memory_mib)
            for sample in self._injected.get(device_uuid, ()):
                found[sample[0]] = sample
        return list(found.values())

    def _processes(self, handle: _Handle) -> list[tuple[int, int]]:
        return [(pid, mib) for pid, _sm, mib in self._process_samples(handle)]

    def _scan_environ(self) -> dict[str, list[int]]:
        now = time.monotonic()
        with self._lock:
            if now - self._scan_at < _SCAN_TTL_SECONDS:
                return self._scan
        scan: dict[str, list[int]] = {}
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/environ", "rb") as environ:
                    raw = environ.read()
            except OSError:
                continue
            marker = raw.find(b"CUDA_VISIBLE_DEVICES=")
            if marker < 0 or (marker > 0 and raw[marker - 1] != 0):
                continue
            if not _descends_from(int(entry.name), os.getpid()):
                continue  # another agent's (fleets share UUIDs between agents on one machine)
            value = raw[marker + len("CUDA_VISIBLE_DEVICES=") :].split(b"\0", 1)[0].decode(errors="replace")
            for device_uuid in value.split(","):
                if device_uuid:
                    scan.setdefault(device_uuid.strip(), []).append(int(entry.name))
        with self._lock:
            self._scan, self._scan_at = scan, now
        return scan


def _descends_from(pid: int, ancestor: int) -> bool:
    """Whether ``pid`` is ``ancestor`` or one of its descendants (its parents, read from /proc)."""
    for _ in range(64):
        if pid == ancestor:
            return True
        if pid <= 1:
            return False
        try:
            with open(f"/proc/{pid}/stat", "rb") as stat:
                data = stat.read()
        except OSError:
            return False
        pid = int(data[data.rfind(b")") + 2 :].split()[1])  # "pid (comm) state ppid …"
    return False


class FakeNvmlSource(NvmlSource):
    name = "fake"

    def __init__(self, *, fleet_path: str) -> None:
        self.fleet_path = fleet_path

    def open(self) -> FakeNvml:
        fake = FakeNvml(load_fleet(self.fleet_path))
        fake.nvmlInit()
        return fake
