"""The inventory and metrics code over the fake pynvml (the same code runs over the real one)."""

from __future__ import annotations

import os

import pynvml
import pytest

from agents.nvml import GpuReader, nvml_source
from agents.nvml.fake import FakeNvml
from agents.nvml.fleet import parse_fleet
from tests.agents.conftest import REPO

FLEETS = REPO / "agents" / "fleets"


def _reader(text: str) -> tuple[GpuReader, FakeNvml]:
    fake = FakeNvml(parse_fleet(text))
    fake.nvmlInit()
    return GpuReader(fake), fake


def test_shipped_fleets_inventory():
    node_a = GpuReader(nvml_source("fake", fleet_path=str(FLEETS / "node-a.yaml")).open()).inventory()
    assert [g["name"] for g in node_a["gpus"]] == ["NVIDIA A100-SXM4-80GB"] * 4 + ["NVIDIA Tesla T4"] * 2
    assert [g["memory_total_mib"] for g in node_a["gpus"]] == [81920] * 4 + [15360] * 2
    assert (
        len({g["uuid"] for g in node_a["gpus"]}) == 6 and len({g["pci_bus_id"] for g in node_a["gpus"]}) == 6
    )
    node_b = GpuReader(nvml_source("fake", fleet_path=str(FLEETS / "node-b.yaml")).open()).inventory()
    plain, mig = node_b["gpus"]
    assert (plain["mig_mode"], plain["mig_devices"]) == (False, [])
    assert mig["mig_mode"] is True
    assert [m["profile"] for m in mig["mig_devices"]] == ["1g.18gb"] * 7
    assert all(m["uuid"].startswith("MIG-") and m["memory_total_mib"] == 17920 for m in mig["mig_devices"])
    assert node_b["driver_version"] == "550.90.07" and node_b["cuda_version"] == "12.4"


def test_uuids_are_deterministic_per_node_and_index():
    text = "node: n1\ngpus:\n  - {model: A100-SXM4-80GB, memory_mib: 81920, count: 2}\n"
    first, _ = _reader(text)
    second, _ = _reader(text)
    other, _ = _reader(text.replace("n1", "n2"))
    assert first.inventory() == second.inventory()
    assert first.inventory()["gpus"][0]["uuid"] != other.inventory()["gpus"][0]["uuid"]


def test_fake_raises_the_real_pynvml_errors():
    _, fake = _reader("node: n1\ngpus:\n  - {model: Tesla T4, memory_mib: 15360}\n")
    handle = fake.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        fake.nvmlDeviceGetMigMode(handle)  # a T4 has no MIG
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        fake.nvmlDeviceGetHandleByIndex(5)
    fake.nvmlShutdown()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        fake.nvmlDeviceGetCount()


def test_not_supported_figures_are_null():
    reader, _ = _reader(
        "node: n1\ngpus:\n  - model: A100-SXM4-80GB\n    memory_mib: 81920\n"
        "    faults: {not_supported: [power, energy, temperature, pci]}\n"
    )
    gpu = reader.inventory()["gpus"][0]
    assert gpu["pci_bus_id"] is None and gpu["health"] == "ok" and gpu["memory_total_mib"] == 81920
    metrics, _ = reader.metrics()
    figures = metrics["gpus"][0]
    assert figures["power_w"] is None and figures["energy_mj"] is None and figures["temperature_c"] is None
    assert figures["memory_used_mib"] == 0 and figures["gpu_util_percent"] == 0


def test_a_gpu_lost_from_the_start_or_after_some_calls_reports_health_lost():
    reader, _ = _reader(
        "node: n1\ngpus:\n"
        "  - {model: A100-SXM4-80GB, memory_mib: 81920, faults: {lost: true}}\n"
        "  - {model: A100-SXM4-80GB, memory_mib: 81920, faults: {lost_after_calls: 8}}\n"
    )
    inventory = reader.inventory()
    assert inventory["gpus"][0]["health"] == "lost" and inventory["gpus"][0]["uuid"] is None
    assert inventory["gpus"][1]["health"] == "ok"
    known_uuid = inventory["gpus"][1]["uuid"]
    metrics, _ = reader.metrics()  # the 8 calls run out during this pass
    assert reader.inventory()["gpus"][1]["health"] == "lost"
    assert reader.inventory()["gpus"][1]["uuid"] == known_uuid
    metrics, _ = reader.metrics()
    assert metrics["gpus"][1] == {
        "uuid": known_uuid, "gpu_util_percent": None, "memory_util_percent": None, "memory_used_mib": None,
        "temperature_c": None, "power_w": None, "energy_mj": None,
    }  # fmt: skip


def test_per_workload_figures_map_nvml_processes_to_session_pids():
    reader, fake = _reader(
        "node: n1\nsimulate_processes: false\ngpus:\n"
        "  - {model: A100-SXM4-80GB, memory_mib: 81920}\n"
        "  - {model: A100-SXM4-80GB, memory_mib: 81920, mig: ['3g.40gb', '3g.40gb']}\n"
    )
    inventory = reader.inventory()
    gpu, mig_gpu = inventory["gpus"]
    fake.set_processes(gpu["uuid"], [(101, 30, 1000), (102, 20, 500), (999, 50, 4000)])
    fake.set_processes(mig_gpu["mig_devices"][1]["uuid"], [(201, 70, 2048)])
    on_gpu = {"a": gpu["uuid"], "b": mig_gpu["uuid"], "idle": gpu["uuid"]}
    metrics, sessions = reader.metrics({"a": {101, 102}, "b": {201}, "idle": {301}}, on_gpu)
    mib = 1024 * 1024
    assert sessions["a"] == {
        "gpu_util_percent": 50,
        "gpu_memory_used_mib": 1500,
        "gpu_memory_bytes": 1500 * mib,
    }
    assert sessions["b"] == {
        "gpu_util_percent": None,
        "gpu_memory_used_mib": 2048,
        "gpu_memory_bytes": 2048 * mib,
    }  # no per-process util in MIG: the MIG device's own processes give its memory only
    assert sessions["idle"] == {"gpu_util_percent": 0, "gpu_memory_used_mib": 0, "gpu_memory_bytes": 0}
    assert metrics["gpus"][0]["memory_used_mib"] == 5500


def test_each_mig_device_reports_its_own_memory_beside_its_card():
    reader, fake = _reader(
        "node: n1\nsimulate_processes: false\ngpus:\n"
        "  - {model: A100-SXM4-80GB, memory_mib: 81920, mig: ['3g.40gb', '3g.40gb']}\n"
    )
    card = reader.inventory()["gpus"][0]
    first, second = (mig["uuid"] for mig in card["mig_devices"])
    fake.set_processes(second, [(201, 70, 2048)])
    metrics, _ = reader.metrics()
    by_uuid = {figures["uuid"]: figures for figures in metrics["gpus"]}
    assert set(by_uuid) == {card["uuid"], first, second}
    assert by_uuid[first]["memory_used_mib"] == 0 and by_uuid[second]["memory_used_mib"] == 2048
    # NVML gives a MIG device neither utilisation nor power: null, never the card's
    assert by_uuid[second]["gpu_util_percent"] is None and by_uuid[second]["power_w"] is None


def test_simulated_processes_are_found_by_their_cuda_visible_devices(tmp_path):
    import subprocess
    import sys

    reader, _ = _reader(
        "node: n1\ngpus:\n  - {model: A100-SXM4-80GB, memory_mib: 81920, process_memory_mib: 300}\n"
    )
    uuid = reader.inventory()["gpus"][0]["uuid"]
    child = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(30)"],
        env={**os.environ, "CUDA_VISIBLE_DEVICES": uuid},
    )
    try:
        import time

        time.sleep(1.1)  # past the fake's /proc scan cache
        _, sessions = reader.metrics({"s": {child.pid}})
        assert sessions["s"]["gpu_memory_used_mib"] == 300
    finally:
        child.kill()
        child.wait()


def test_topology_groups_join_gpus_under_one_switch_and_stay_unknown_where_nvml_cannot_tell():
    reader, _ = _reader((FLEETS / "node-c.yaml").read_text())
    assert [g["topology_group"] for g in reader.inventory()["gpus"]] == ["topo-0"] * 4 + ["topo-4"] * 4
    reader, _ = _reader((FLEETS / "ci-small.yaml").read_text())
    assert {g["topology_group"] for g in reader.inventory()["gpus"]} == {None}
