"""The agent's ``GET /metrics``: its GPUs under the DCGM exporter's metric names and labels, so the
dashboards operators already run for ``dcgm-exporter`` work unchanged, plus one series per session.

GPU series (one per physical GPU, as dcgm-exporter emits them): ``DCGM_FI_DEV_GPU_UTIL``,
``DCGM_FI_DEV_MEM_COPY_UTIL`` (%), ``DCGM_FI_DEV_FB_USED``, ``DCGM_FI_DEV_FB_FREE`` (MiB),
``DCGM_FI_DEV_GPU_TEMP`` (C), ``DCGM_FI_DEV_POWER_USAGE`` (W) and
``DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION`` (mJ since boot), labelled ``gpu``, ``UUID``, ``device``,
``modelName`` and ``Hostname``. A GPU that one session holds whole also carries that session's labels
(``session``, ``profile``, ``user``), as dcgm-exporter adds a pod's. The energy figure is typed a
gauge: prometheus-client would rename a counter to ``…_total``, and dcgm-exporter's name has none;
``rate()`` reads it all the same.

Session series (whole GPUs, slices and MIG devices alike), with the GPU's labels plus ``session``,
``profile``, ``user`` and ``sharing_policy``: ``suanli_session_running`` (1 while the workload runs),
``suanli_session_gpu_util_percent`` and ``suanli_session_fb_used_mib`` (what NVML says the session's
own processes use; absent where NVML cannot say, e.g. utilisation in MIG mode) and
``suanli_session_fb_limit_mib`` (the slice's memory cap, or the MIG device's memory). Slices get
their own names so that ``sum(DCGM_FI_DEV_FB_USED)`` never counts a GPU twice.
"""

from __future__ import annotations

import socket
from collections.abc import Iterable, Iterator, Mapping

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric

from agents.workloads import Workloads

GPU_LABELS = ["gpu", "UUID", "device", "modelName", "Hostname"]
HOLDER_LABELS = ["session", "profile", "user"]
SESSION_LABELS = [*GPU_LABELS, *HOLDER_LABELS, "sharing_policy"]

# (metric name, key in the protocol's per-GPU metrics, help) — help texts are dcgm-exporter's
_GPU_GAUGES = [
    ("DCGM_FI_DEV_GPU_UTIL", "gpu_util_percent", "GPU utilization (in %)."),
    ("DCGM_FI_DEV_MEM_COPY_UTIL", "memory_util_percent", "Memory utilization (in %)."),
    ("DCGM_FI_DEV_FB_USED", "memory_used_mib", "Framebuffer memory used (in MiB)."),
    ("DCGM_FI_DEV_FB_FREE", "memory_free_mib", "Framebuffer memory free (in MiB)."),
    ("DCGM_FI_DEV_GPU_TEMP", "temperature_c", "GPU temperature (in C)."),
    ("DCGM_FI_DEV_POWER_USAGE", "power_w", "Power draw (in W)."),
    ("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "energy_mj", "Total energy consumption since boot (in mJ)."),
]


def _gpu_labels(gpu: Mapping, hostname: str) -> list[str]:
    index = gpu.get("index")
    return [
        "" if index is None else str(index),
        gpu.get("uuid") or "",
        "" if index is None else f"nvidia{index}",
        gpu.get("name") or "",
        hostname,
    ]


def _fb_limit_mib(plan: Mapping, inventory_gpu: Mapping) -> int | None:
    if plan.get("memory_limit_mib") is not None:
        return plan["memory_limit_mib"]
    if plan.get("device_uuid") and plan.get("device_uuid") != plan.get("gpu_uuid"):
        for mig in inventory_gpu.get("mig_devices", []):
            if mig.get("uuid") == plan["device_uuid"]:
                return mig.get("memory_total_mib")
        return None
    return inventory_gpu.get("memory_total_mib")


class _Scrape:
    """One scrape's figures, turned into metric families."""

    def __init__(
        self, *, inventory: Mapping, metrics: Mapping, workloads: Iterable[Mapping], hostname: str
    ) -> None:
        self.gpus = {g.get("uuid"): g for g in inventory.get("gpus", [])}
        self.figures = {g.get("uuid"): g for g in metrics.get("gpus", [])}
        self.workloads = [w for w in workloads if w.get("state") == "running"]
        self.hostname = hostname

    def collect(self) -> Iterator[Metric]:
        holders = {}
        for w in self.workloads:
            plan = w.get("gpu_plan") or {}
            if plan.get("gpu_uuid") and plan.get("profile") == "whole":
                holders[plan["gpu_uuid"]] = w
        families = {
            name: GaugeMetricFamily(name, text, labels=[*GPU_LABELS, *HOLDER_LABELS])
            for name, _key, text in _GPU_GAUGES
        }
        for uuid, gpu in self.gpus.items():
            figures = dict(self.figures.get(uuid) or {})
            total, used = gpu.get("memory_total_mib"), figures.get("memory_used_mib")
            figures["memory_free_mib"] = total - used if total is not None and used is not None else None
            holder = holders.get(uuid)
            labels = [
                *_gpu_labels(gpu, self.hostname),
                *((holder["session_id"], "whole", holder.get("user") or "") if holder else ("", "", "")),
            ]
            for name, key, _text in _GPU_GAUGES:
                if figures.get(key) is not None:
                    families[name].add_metric(labels, float(figures[key]))
        yield from families.values()
        yield from self._sessions()

    def _sessions(self) -> Iterator[Metric]:
        running = GaugeMetricFamily(
            "suanli_session_running", "1 for each session whose workload runs here.", labels=SESSION_LABELS
        )
        util = GaugeMetricFamily(
            "suanli_session_gpu_util_percent",
            "GPU utilization of the session's own processes (in %).",
            labels=SESSION_LABELS,
        )
        used = GaugeMetricFamily(
            "suanli_session_fb_used_mib",
            "Framebuffer memory the session's own processes use (in MiB).",
            labels=SESSION_LABELS,
        )
        limit = GaugeMetricFamily(
            "suanli_session_fb_limit_mib",
            "Framebuffer memory the session may use: its slice's cap or its GPU or MIG device (in MiB).",
            labels=SESSION_LABELS,
        )
        for w in self.workloads:
            plan = w.get("gpu_plan") or {}
            gpu = self.gpus.get(plan.get("gpu_uuid")) or {}
            labels = [
                *_gpu_labels(gpu, self.hostname),
                w["session_id"],
                plan.get("profile") or "cpu",
                w.get("user") or "",
                plan.get("sharing_policy") or "",
            ]
            running.add_metric(labels, 1.0)
            if w.get("gpu_util_percent") is not None:
                util.add_metric(labels, float(w["gpu_util_percent"]))
            if w.get("gpu_memory_used_mib") is not None:
                used.add_metric(labels, float(w["gpu_memory_used_mib"]))
            if gpu and (cap := _fb_limit_mib(plan, gpu)) is not None:
                limit.add_metric(labels, float(cap))
        yield from (running, util, used, limit)


def exposition(*, inventory: Mapping, metrics: Mapping, workloads: Iterable[Mapping], hostname: str) -> bytes:
    """Prometheus's text format for one scrape of these figures (the protocol's shapes)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Scrape(inventory=inventory, metrics=metrics, workloads=workloads, hostname=hostname))
    return generate_latest(registry)


def answer(workloads: Workloads, method: str, *, authorised: bool) -> tuple[int, str, bytes]:
    """``(status, content type, body)`` for a request to ``/metrics``: the node token is required
    (``authorised``: the API checked it, as on every other path), and NVML is read afresh."""
    if not authorised:
        return 401, "text/plain; charset=utf-8", b"a valid 'Authorization: Bearer <node token>' is required\n"
    if method != "GET":
        return 405, "text/plain; charset=utf-8", f"{method} is not allowed on /metrics\n".encode()
    metrics, per_session = workloads.reader.metrics(workloads.pids_by_session(), workloads.gpu_of_session())
    rows = [{**w.status(per_session.get(w.session_id)), "user": w.spec.get("user")} for w in workloads.all()]
    body = exposition(
        inventory=workloads.reader.inventory(),
        metrics=metrics,
        workloads=rows,
        hostname=socket.gethostname(),
    )
    return 200, CONTENT_TYPE_LATEST, body
