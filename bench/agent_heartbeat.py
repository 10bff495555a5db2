"""Benchmark: building one agent heartbeat for 8 GPUs and 64 workloads (fake NVML).

Prints milliseconds per build (p50 / p99) for ``build_heartbeat`` beside two baselines measured in
the same run: a naive build that rediscovers the inventory and looks every handle up again for
each figure, and the cost of ``json.dumps`` of the body alone. Never fails on a time.

    .venv/bin/python bench/agent_heartbeat.py [--runs 2000]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agents.gpuplan import Allocation, gpu_plan  # noqa: E402
from agents.heartbeat import build_heartbeat  # noqa: E402
from agents.nvml import GpuReader  # noqa: E402
from agents.nvml.fake import FakeNvml  # noqa: E402
from agents.nvml.fleet import parse_fleet  # noqa: E402
from agents.runtimes import RuntimeHandle  # noqa: E402
from agents.workloads import Workload, now_iso  # noqa: E402

FLEET = """\
node: bench
simulate_processes: false
gpus:
  - {model: A100-SXM4-80GB, memory_mib: 81920, count: 8, utilization: {gpu: 55, memory: 20}}
"""


def setup() -> tuple[GpuReader, FakeNvml, list[Workload], dict[str, set[int]], dict[str, str]]:
    fake = FakeNvml(parse_fleet(FLEET))
    fake.nvmlInit()
    reader = GpuReader(fake)
    inventory = reader.inventory()
    workloads, pids, gpus = [], {}, {}
    for gpu_index, gpu in enumerate(inventory["gpus"]):
        processes = []
        for slot in range(8):  # eight 1/8 slices per GPU: 64 workloads
            sid = f"s{gpu_index}-{slot}"
            plan = gpu_plan(Allocation(gpu["uuid"], "1/8", slot, 1, "best-effort"), inventory)
            workloads.append(
                Workload(
                    sid,
                    {},
                    "f",
                    "t",
                    plan,
                    RuntimeHandle(base_url=f"/jupyter/{sid}/", upstream_url="http://127.0.0.1:1"),
                    "running",
                    started_at=now_iso(),
                )
            )
            session_pids = {100_000 + gpu_index * 100 + slot * 10 + k for k in range(3)}
            pids[sid], gpus[sid] = session_pids, gpu["uuid"]
            processes += [(pid, 5, 512) for pid in session_pids]
        fake.set_processes(gpu["uuid"], processes)
    return reader, fake, workloads, pids, gpus


def naive_heartbeat(nvml, workloads, pids) -> dict:
    """The baseline: rediscover everything and fetch each handle again for every figure."""
    gpus = []
    for index in range(nvml.nvmlDeviceGetCount()):
        get = nvml.nvmlDeviceGetHandleByIndex
        gpus.append(
            {
                "index": index,
                "uuid": nvml.nvmlDeviceGetUUID(get(index)),
                "name": nvml.nvmlDeviceGetName(get(index)),
                "pci_bus_id": nvml.nvmlDeviceGetPciInfo(get(index)).busId,
                "memory_total_mib": nvml.nvmlDeviceGetMemoryInfo(get(index)).total >> 20,
                "gpu_util_percent": nvml.nvmlDeviceGetUtilizationRates(get(index)).gpu,
                "memory_util_percent": nvml.nvmlDeviceGetUtilizationRates(get(index)).memory,
                "memory_used_mib": nvml.nvmlDeviceGetMemoryInfo(get(index)).used >> 20,
                "temperature_c": nvml.nvmlDeviceGetTemperature(get(index), nvml.NVML_TEMPERATURE_GPU),
                "power_w": nvml.nvmlDeviceGetPowerUsage(get(index)) / 1000,
                "energy_mj": nvml.nvmlDeviceGetTotalEnergyConsumption(get(index)),
            }
        )
    statuses = []
    for workload in workloads:  # per workload: scan every GPU's processes again
        used = util = 0
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            used += sum(p.usedGpuMemory >> 20 for p in nvml.nvmlDeviceGetComputeRunningProcesses(handle)
                        if p.pid in pids[workload.session_id])  # fmt: skip
            util += sum(s.smUtil for s in nvml.nvmlDeviceGetProcessUtilization(handle, 0)
                        if s.pid in pids[workload.session_id])  # fmt: skip
        statuses.append(workload.status({"gpu_util_percent": util, "gpu_memory_used_mib": used}))
    return {"gpus": gpus, "workloads": statuses}


def measure(function, runs: int) -> tuple[float, float]:
    samples = []
    for _ in range(runs):
        start = time.perf_counter()
        function()
        samples.append((time.perf_counter() - start) * 1000)
    samples.sort()
    return statistics.median(samples), samples[min(len(samples) - 1, int(len(samples) * 0.99))]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=2000)
    args = parser.parse_args()
    reader, fake, workloads, pids, gpus = setup()

    def ours() -> dict:
        return build_heartbeat(
            listen_url="http://127.0.0.1:8701",
            runtime="process",
            reader=reader,
            workloads=workloads,
            pids_by_session=pids,
            gpu_of_session=gpus,
        )

    body = ours()
    assert len(body["workloads"]) == 64 and len(body["metrics"]["gpus"]) == 8
    assert all(w["gpu_memory_used_mib"] == 1536 for w in body["workloads"])
    naive_runs = max(20, args.runs // 10)

    def naive() -> dict:
        return naive_heartbeat(fake, workloads, pids)

    def sent() -> str:
        return json.dumps(ours())

    figures = [
        ("build_heartbeat (cached handles, one pass per GPU)", measure(ours, args.runs), args.runs),
        ("baseline: naive rediscovery, handle per field", measure(naive, naive_runs), naive_runs),
        ("baseline: json.dumps of the body alone", measure(lambda: json.dumps(body), args.runs), args.runs),
        ("build_heartbeat + json.dumps (what is sent)", measure(sent, args.runs), args.runs),
    ]
    print(f"heartbeat for 8 GPUs, 64 workloads, {len(json.dumps(body))} bytes of JSON")
    for name, (p50, p99), runs in figures:
        print(f"  {name:<52} p50 {p50:7.3f} ms   p99 {p99:7.3f} ms   ({runs} runs)")
    ratio = figures[1][1][0] / figures[0][1][0]
    print(f"  naive / ours at p50: {ratio:.1f}x")


if __name__ == "__main__":
    main()
