"""Inventory and metrics of a host's GPUs, over any module object that answers the pynvml API.

Every NVML call tolerates the errors a driver may answer (NotSupported, NoPermission, Unknown…): a
figure it cannot get is reported as ``None`` (null on the wire), never a crash. A GPU that answers
``NVMLError_GpuIsLost`` is reported with health ``"lost"`` and keeps what was known of it.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

_MIB = 1024 * 1024
_MIG_PROFILE_IN_NAME = re.compile(r"(\d+g\.\d+gb(?:\+me)?)")


class _GpuLost(Exception):
    pass


class GpuReader:
    """Reads one host's GPUs. Handles and the inventory are cached: a heartbeat costs one pass of
    metric calls per GPU, not a fresh discovery."""

    def __init__(self, nvml: Any) -> None:
        self.nvml = nvml
        self._lock = threading.Lock()
        self._inventory: dict | None = None
        self._handles: list[tuple[dict, Any, list[tuple[dict, Any]]]] = []
        self._last_sample_us: dict[int, int] = {}

    # -- calls ------------------------------------------------------------------------------
    def _call(self, function: str, *args: Any, not_found: Any = None) -> Any:
        """One NVML call: None when the figure is unavailable, _GpuLost when the GPU is gone."""
        nvml = self.nvml
        try:
            return getattr(nvml, function)(*args)
        except nvml.NVMLError_GpuIsLost:
            raise _GpuLost
        except nvml.NVMLError_NotFound:
            return not_found
        except nvml.NVMLError:
            return None
        except AttributeError:  # an older pynvml without this function
            return None

    # -- inventory ---------------------------------------------------------------------------
    def inventory(self, *, refresh: bool = False) -> dict:
        """The ``inventory`` object of the protocol. Cached after the first call."""
        with self._lock:
            if self._inventory is None or refresh:
                self._inventory = self._discover()
            return self._inventory

    def _discover(self) -> dict:
        nvml = self.nvml
        driver = self._call("nvmlSystemGetDriverVersion")
        cuda = self._call("nvmlSystemGetCudaDriverVersion")
        count = self._call("nvmlDeviceGetCount") or 0
        previous = {gpu["index"]: gpu for gpu in (self._inventory or {}).get("gpus", [])}
        gpus = []
        self._handles = []
        for index in range(count):
            gpu = {
                "index": index,
                "uuid": None,
                "name": None,
                "pci_bus_id": None,
                "memory_total_mib": None,
                "mig_mode": False,
                "health": "ok",
                "mig_devices": [],
            }
            handle = None
            migs: list[tuple[dict, Any]] = []
            try:
                handle = self._call("nvmlDeviceGetHandleByIndex", index)
                if handle is None:
                    raise _GpuLost
                gpu["uuid"] = _text(self._call("nvmlDeviceGetUUID", handle))
                gpu["minor_number"] = self._call("nvmlDeviceGetMinorNumber", handle)
                gpu["name"] = _text(self._call("nvmlDeviceGetName", handle))
                pci = self._call("nvmlDeviceGetPciInfo", handle)
                gpu["pci_bus_id"] = _text(getattr(pci, "busId", None)) if pci is not None else None
                memory = self._call("nvmlDeviceGetMemoryInfo", handle)
                gpu["memory_total_mib"] = memory.total // _MIB if memory is not None else None
                mode = self._call("nvmlDeviceGetMigMode", handle)
                gpu["mig_mode"] = bool(mode) and mode[0] == nvml.NVML_DEVICE_MIG_ENABLE
                if gpu["mig_mode"]:
                    migs = self._discover_migs(handle)
                    gpu["mig_devices"] = [mig for mig, _ in migs]
            except _GpuLost:
                gpu["health"] = "lost"
                for key, value in previous.get(index, {}).items():
                    if gpu.get(key) in (None, [], False) and key != "health":
                        gpu[key] = value
            gpus.append(gpu)
            self._handles.append((gpu, handle, migs))
        self._topology_groups(gpus)
        return {
            "driver_version": _text(driver),
            "cuda_version": f"{cuda // 1000}.{cuda % 1000 // 10}" if isinstance(cuda, int) else None,
            "gpus": gpus,
        }

    def _topology_groups(self, gpus: list[dict]) -> None:
        """Set each GPU's ``topology_group``: GPUs whose common ancestor is at most a tree of PCIe
        switches (``NVML_TOPOLOGY_MULTIPLE``) are one group, named ``topo-<lowest index>``; None for
        every GPU when NVML cannot tell (an older driver, a single GPU)."""
        handles = [(gpu, handle) for gpu, handle, _migs in self._handles if handle is not None]
        group = {gpu["index"]: gpu["index"] for gpu, _handle in handles}
        known = False
        for i, (one, first) in enumerate(handles):
            for other, second in handles[i + 1 :]:
                try:
                    level = self._call("nvmlDeviceGetTopologyCommonAncestor", first, second)
                except _GpuLost:
                    level = None
                if level is None:
                    continue
                known = True
                if level <= self.nvml.NVML_TOPOLOGY_MULTIPLE:
                    joined = (group[one["index"]], group[other["index"]])
                    for index, at in group.items():
                        if at in joined:
                            group[index] = min(joined)
        for gpu in gpus:
            at = group.get(gpu["index"])
            gpu["topology_group"] = f"topo-{at}" if known and at is not None else None

    def _discover_migs(self, handle: Any) -> list[tuple[dict, Any]]:
        found = []
        for mig_index in range(self._call("nvmlDeviceGetMaxMigDeviceCount", handle) or 0):
            mig_handle = self._call("nvmlDeviceGetMigDeviceHandleByIndex", handle, mig_index)
            if mig_handle is None:  # NotFound: an empty MIG slot
                continue
            name = _text(self._call("nvmlDeviceGetName", mig_handle)) or ""
            match = _MIG_PROFILE_IN_NAME.search(name)
            memory = self._call("nvmlDeviceGetMemoryInfo", mig_handle)
            mig = {
                "uuid": _text(self._call("nvmlDeviceGetUUID", mig_handle)),
                "profile": match.group(1) if match else None,
                "memory_total_mib": memory.total // _MIB if memory is not None else None,
                "gpu_instance_id": self._call("nvmlDeviceGetGpuInstanceId", mig_handle),
                "compute_instance_id": self._call("nvmlDeviceGetComputeInstanceId", mig_handle),
            }
            found.append((mig, mig_handle))
        return found

    # -- metrics -----------------------------------------------------------------------------
    def metrics(
        self,
        pids_by_session: Mapping[str, set[int]] | None = None,
        gpu_of_session: Mapping[str, str] | None = None,
    ) -> tuple[dict, dict[str, dict]]:
        """The ``metrics`` object, and per session ``{"gpu_util_percent", "gpu_memory_used_mib",
        "gpu_memory_bytes"}``: the GPU use of the session's own processes.

        A session's figures sum NVML's per-process samples over the session's process ids (on a MIG
        device, the processes NVML lists on that device); they are
        None where NVML cannot say (e.g. per-process utilisation in MIG mode), and 0 when NVML can
        say and lists none of its processes on its GPU (``gpu_of_session``: the physical GPU's UUID).
        """
        self.inventory()
        session_of_pid = {pid: sid for sid, pids in (pids_by_session or {}).items() for pid in pids}
        per_session: dict[str, dict] = {
            sid: dict.fromkeys(("gpu_util_percent", "gpu_memory_used_mib", "gpu_memory_bytes"))
            for sid in (pids_by_session or {})
        }
        gpus = []
        with self._lock:
            handles = list(self._handles)
        for gpu, handle, migs in handles:
            figures = {
                "uuid": gpu["uuid"],
                "gpu_util_percent": None,
                "memory_util_percent": None,
                "memory_used_mib": None,
                "temperature_c": None,
                "power_w": None,
                "energy_mj": None,
            }
            if gpu["health"] == "ok":
                try:
                    self._gpu_figures(handle, figures)
                    on_this_gpu = {
                        sid: figures
                        for sid, figures in per_session.items()
                        if gpu_of_session is None or gpu_of_session.get(sid) == gpu["uuid"]
                    }
                    self._session_figures(gpu, handle, migs, session_of_pid, per_session, on_this_gpu)
                except _GpuLost:
                    gpu["health"] = "lost"  # also seen by the cached inventory
                    figures = {key: (gpu["uuid"] if key == "uuid" else None) for key in figures}
            gpus.append(figures)
            if gpu["health"] == "ok":
                gpus += self._mig_figures(migs, like=figures)
        for figures in per_session.values():
            if figures["gpu_memory_bytes"] is not None:
                figures["gpu_memory_used_mib"] = figures["gpu_memory_bytes"] // _MIB
        collected_at = datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")
        return {"collected_at": collected_at, "gpus": gpus}, per_session

    def _mig_figures(self, migs: list[tuple[dict, Any]], *, like: dict) -> list[dict]:
        """Each MIG device's own figures: its memory in use (NVML gives a MIG device neither
        utilisation nor power, so those stay None); the card's temperature, which they share."""
        found = []
        for mig, mig_handle in migs:
            memory = self._call("nvmlDeviceGetMemoryInfo", mig_handle)
            found.append(
                {
                    **dict.fromkeys(like, None),
                    "uuid": mig["uuid"],
                    "memory_used_mib": memory.used // _MIB if memory is not None else None,
                    "temperature_c": like.get("temperature_c"),
                }
            )
        return found

    def _gpu_figures(self, handle: Any, figures: dict) -> None:
        utilisation = self._call("nvmlDeviceGetUtilizationRates", handle)
        if utilisation is not None:
            figures["gpu_util_percent"] = int(utilisation.gpu)
            figures["memory_util_percent"] = int(utilisation.memory)
        memory = self._call("nvmlDeviceGetMemoryInfo", handle)
        if memory is not None:
            figures["memory_used_mib"] = memory.used // _MIB
        figures["temperature_c"] = self._call(
            "nvmlDeviceGetTemperature", handle, self.nvml.NVML_TEMPERATURE_GPU
        )
        power_mw = self._call("nvmlDeviceGetPowerUsage", handle)
        figures["power_w"] = round(power_mw / 1000, 1) if power_mw is not None else None
        figures["energy_mj"] = self._call("nvmlDeviceGetTotalEnergyConsumption", handle)

    def _session_figures(
        self,
        gpu: dict,
        handle: Any,
        migs: list,
        session_of_pid: dict[int, str],
        per_session: dict[str, dict],
        on_this_gpu: dict[str, dict],
    ) -> None:
        if not session_of_pid:
            return
        device_handles = [mig_handle for _, mig_handle in migs] if gpu["mig_mode"] else [handle]
        for device_handle in device_handles:
            processes = self._call("nvmlDeviceGetComputeRunningProcesses", device_handle)
            if processes is not None:
                for figures in on_this_gpu.values():
                    figures["gpu_memory_bytes"] = figures["gpu_memory_bytes"] or 0
                for process in processes:
                    sid = session_of_pid.get(process.pid)
                    if sid is None:
                        continue
                    used = getattr(process, "usedGpuMemory", None)
                    figures = per_session[sid]
                    figures["gpu_memory_bytes"] = (figures["gpu_memory_bytes"] or 0) + (
                        used if isinstance(used, int) else 0
                    )
        if gpu["mig_mode"]:
            return  # NVML has no per-process utilisation in MIG mode
        key = gpu["index"]
        samples = self._call(
            "nvmlDeviceGetProcessUtilization", handle, self._last_sample_us.get(key, 0), not_found=[]
        )
        if samples is None:
            return
        for figures in on_this_gpu.values():  # NotFound means no process used this GPU lately
            figures["gpu_util_percent"] = figures["gpu_util_percent"] or 0
        latest: dict[int, Any] = {}
        for sample in samples:
            if sample.pid not in latest or sample.timeStamp >= latest[sample.pid].timeStamp:
                latest[sample.pid] = sample
            self._last_sample_us[key] = max(self._last_sample_us.get(key, 0), sample.timeStamp)
        for pid, sample in latest.items():
            sid = session_of_pid.get(pid)
            if sid is not None:
                figures = per_session[sid]
                figures["gpu_util_percent"] = min(
                    100, (figures["gpu_util_percent"] or 0) + int(sample.smUtil)
                )


def _text(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    return value
