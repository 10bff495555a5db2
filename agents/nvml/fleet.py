"""The YAML fleet description the fake NVML is built from, validated strictly.

Every error names the line of the file at fault, so an operator can mend the file quickly.
"""

from __future__ import annotations

import hashlib
import re
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

MIG_PROFILE_RE = re.compile(r"^(?P<slices>[1-7])g\.(?P<gb>\d+)gb(?:\+me)?$")
# Models that can be partitioned with MIG, and how many compute slices each has.
MIG_CAPABLE = ("A100", "A30", "H100", "H200", "H20", "GH200", "B200")
# Memory a MIG device really reports, where it differs from its name (MiB).
MIG_MEMORY_MIB = {
    "1g.5gb": 4864,
    "1g.10gb": 9728,
    "1g.12gb": 10752,
    "1g.18gb": 17920,
    "2g.10gb": 9856,
    "2g.20gb": 19968,
    "2g.35gb": 33280,
    "3g.20gb": 19968,
    "3g.40gb": 40192,
    "3g.71gb": 71424,
    "4g.40gb": 40192,
    "4g.71gb": 71424,
    "7g.80gb": 80896,
    "7g.141gb": 143360,
}
KNOWN_FAULT_CALLS = {
    "name": "nvmlDeviceGetName",
    "pci": "nvmlDeviceGetPciInfo",
    "memory": "nvmlDeviceGetMemoryInfo",
    "utilization": "nvmlDeviceGetUtilizationRates",
    "temperature": "nvmlDeviceGetTemperature",
    "power": "nvmlDeviceGetPowerUsage",
    "energy": "nvmlDeviceGetTotalEnergyConsumption",
    "process_utilization": "nvmlDeviceGetProcessUtilization",
    "running_processes": "nvmlDeviceGetComputeRunningProcesses",
    "mig_mode": "nvmlDeviceGetMigMode",
    "topology": "nvmlDeviceGetTopologyCommonAncestor",
}


class FleetError(ValueError):
    """A fleet file that cannot be used; the message names the file and line."""

    def __init__(self, message: str, *, line: int | None = None, path: str | None = None) -> None:
        self.line = line
        self.path = path
        where = f"{path or '<fleet>'}" + (f":{line}" if line is not None else "")
        super().__init__(f"{where}: {message}")


@dataclass(frozen=True)
class FakeMig:
    uuid: str
    profile: str
    memory_total_mib: int


@dataclass(frozen=True)
class FakeGpu:
    index: int
    uuid: str
    name: str
    pci_bus_id: str
    memory_total_mib: int
    memory_used_mib: int
    gpu_util_percent: int
    memory_util_percent: int
    temperature_c: int
    power_w: float
    mig: tuple[FakeMig, ...] = ()
    # GPUs with the same group share an NVLink domain or PCIe switch; None: NVML reports no topology.
    topology_group: str | None = None
    lost_from_start: bool = False
    lost_after_calls: int | None = None
    not_supported: frozenset[str] = frozenset()
    process_sm_util_percent: int = 10
    process_memory_mib: int = 256


@dataclass(frozen=True)
class Fleet:
    node: str
    driver_version: str | None
    cuda_version: str | None
    gpus: tuple[FakeGpu, ...]
    simulate_processes: bool = True
    source: str = field(default="<fleet>", compare=False)


class _LineDict(dict):
    """A mapping that remembers the line of itself and of each key (1-based)."""

    line: int = 0
    key_lines: dict


class _LineList(list):
    line: int = 0
    item_lines: list


class _LineLoader(yaml.SafeLoader):
    pass


def _construct_mapping(loader: _LineLoader, node: yaml.MappingNode) -> _LineDict:
    mapping = _LineDict()
    mapping.line = node.start_mark.line + 1
    mapping.key_lines = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        if key in mapping:
            raise FleetError(f"duplicate key {key!r}", line=key_node.start_mark.line + 1)
        mapping[key] = loader.construct_object(value_node, deep=True)
        mapping.key_lines[key] = key_node.start_mark.line + 1
    return mapping


def _construct_sequence(loader: _LineLoader, node: yaml.SequenceNode) -> _LineList:
    items = _LineList(loader.construct_object(child, deep=True) for child in node.value)
    items.line = node.start_mark.line + 1
    items.item_lines = [child.start_mark.line + 1 for child in node.value]
    return items


_LineLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)
_LineLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_SEQUENCE_TAG, _construct_sequence)


def deterministic_uuid(kind: str, *parts: object) -> str:
    """A stable NVML-style UUID (``GPU-…`` / ``MIG-…``) derived from the node name and indexes."""
    digest = hashlib.sha256("/".join(str(p) for p in (kind, *parts)).encode()).digest()
    return f"{kind}-{uuid.UUID(bytes=digest[:16])}"


def load_fleet(path: str | Path) -> Fleet:
    """Read and validate a fleet file; raises FleetError naming the line at fault."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise FleetError(f"cannot read fleet file ({exc.strerror})", path=str(path))
    return parse_fleet(text, source=str(path))


def parse_fleet(text: str, *, source: str = "<fleet>") -> Fleet:
    try:
        document = yaml.load(text, Loader=_LineLoader)  # noqa: S506 - a SafeLoader subclass
    except FleetError as exc:
        raise FleetError(str(exc).split(": ", 1)[1], line=exc.line, path=source)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        problem = getattr(exc, "problem", None) or str(exc)
        raise FleetError(f"not valid YAML: {problem}", line=mark.line + 1 if mark else None, path=source)
    try:
        return _fleet_from_document(document, source)
    except FleetError as exc:
        if exc.path is None:
            raise FleetError(str(exc).split(": ", 1)[1], line=exc.line, path=source)
        raise


def _require_mapping(value: Any, what: str, line: int) -> _LineDict:
    if not isinstance(value, _LineDict):
        raise FleetError(f"{what} must be a mapping", line=getattr(value, "line", line))
    return value


def _check_keys(mapping: _LineDict, allowed: set[str], required: set[str], what: str) -> None:
    for key in mapping:
        if key not in allowed:
            raise FleetError(
                f"unknown key {key!r} in {what} (allowed: {', '.join(sorted(allowed))})",
                line=mapping.key_lines[key],
            )
    for key in sorted(required - set(mapping)):
        raise FleetError(f"{what} needs key {key!r}", line=mapping.line)


def _get(
    mapping: _LineDict,
    key: str,
    kind: type | tuple[type, ...],
    default: Any = None,
    *,
    minimum=None,
    maximum=None,
) -> Any:
    if key not in mapping:
        return default
    value = mapping[key]
    line = mapping.key_lines[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds:
        raise FleetError(f"{key} must be {kinds[0].__name__}, not a boolean", line=line)
    if value is None and type(None) in kinds:
        return None
    if not isinstance(value, kinds):
        raise FleetError(f"{key} must be {' or '.join(k.__name__ for k in kinds)}, got {value!r}", line=line)
    if minimum is not None and value < minimum:
        raise FleetError(f"{key} must be at least {minimum}, got {value!r}", line=line)
    if maximum is not None and value > maximum:
        raise FleetError(f"{key} must be at most {maximum}, got {value!r}", line=line)
    return value


_GPU_KEYS = {
    "model",
    "memory_mib",
    "count",
    "uuid",
    "pci_bus_id",
    "mig",
    "utilization",
    "memory_used_mib",
    "temperature_c",
    "power_w",
    "faults",
    "process_sm_util_percent",
    "process_memory_mib",
    "topology_group",
}


def _fleet_from_document(document: Any, source: str) -> Fleet:
    if document is None:
        raise FleetError("the fleet file is empty", line=1)
    top = _require_mapping(document, "the fleet file", 1)
    _check_keys(
        top,
        {"node", "driver_version", "cuda_version", "gpus", "simulate_processes"},
        {"node", "gpus"},
        "fleet",
    )
    node = _get(top, "node", str)
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}", node):
        raise FleetError(f"node must be a host-like name, got {node!r}", line=top.key_lines["node"])
    driver_version = _get(top, "driver_version", (str, type(None)), "550.54.15")
    cuda_version = _get(top, "cuda_version", (str, type(None)), "12.4")
    simulate_processes = _get(top, "simulate_processes", bool, True)
    gpu_entries = top["gpus"]
    if not isinstance(gpu_entries, _LineList) or not gpu_entries:
        raise FleetError("gpus must be a non-empty list", line=top.key_lines["gpus"])
    gpus: list[FakeGpu] = []
    seen_uuids: dict[str, int] = {}
    for entry, entry_line in zip(gpu_entries, gpu_entries.item_lines, strict=True):
        entry = _require_mapping(entry, "each gpu", entry_line)
        _check_keys(entry, _GPU_KEYS, {"model", "memory_mib"}, "gpu")
        count = _get(entry, "count", int, 1, minimum=1, maximum=64)
        if count > 1 and ("uuid" in entry or "pci_bus_id" in entry):
            raise FleetError("uuid and pci_bus_id cannot be given with count > 1", line=entry.line)
        for _ in range(count):
            gpu = _gpu_from_entry(entry, node, len(gpus))
            for uid, line in [(gpu.uuid, entry.line)] + [(m.uuid, entry.line) for m in gpu.mig]:
                if uid in seen_uuids:
                    raise FleetError(f"uuid {uid} appears twice", line=line)
                seen_uuids[uid] = line
            gpus.append(gpu)
    return Fleet(
        node=node,
        driver_version=driver_version,
        cuda_version=cuda_version,
        gpus=tuple(gpus),
        simulate_processes=simulate_processes,
        source=source,
    )


def _gpu_from_entry(entry: _LineDict, node: str, index: int) -> FakeGpu:
    model = _get(entry, "model", str)
    name = model if model.startswith("NVIDIA ") else f"NVIDIA {model}"
    memory_mib = _get(entry, "memory_mib", int, minimum=1024, maximum=1024 * 1024)
    gpu_uuid = _get(entry, "uuid", str) or deterministic_uuid("GPU", node, index)
    if not re.fullmatch(r"GPU-[0-9a-f-]{8,}", gpu_uuid):
        raise FleetError(
            f"uuid must look like GPU-xxxxxxxx-…, got {gpu_uuid!r}", line=entry.key_lines["uuid"]
        )
    pci = _get(entry, "pci_bus_id", str) or f"00000000:{0x07 + index * 0x10:02X}:00.0"
    if not re.fullmatch(r"[0-9A-Fa-f]{8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7]", pci):
        raise FleetError(
            f"pci_bus_id must look like 00000000:07:00.0, got {pci!r}", line=entry.key_lines["pci_bus_id"]
        )
    util = entry.get("utilization", _LineDict())
    util_line = entry.key_lines.get("utilization", entry.line)
    if not isinstance(util, _LineDict):
        raise FleetError("utilization must be a mapping {gpu: N, memory: N}", line=util_line)
    if util:
        _check_keys(util, {"gpu", "memory"}, set(), "utilization")
    mig = _mig_from_entry(entry, node, index, model, memory_mib)
    faults = entry.get("faults", _LineDict())
    faults_line = entry.key_lines.get("faults", entry.line)
    if not isinstance(faults, _LineDict):
        raise FleetError("faults must be a mapping", line=faults_line)
    if faults:
        _check_keys(faults, {"lost", "lost_after_calls", "not_supported"}, set(), "faults")
    not_supported = faults.get("not_supported", [])
    if not isinstance(not_supported, list):
        raise FleetError("faults.not_supported must be a list", line=faults.key_lines["not_supported"])
    calls = set()
    for item in not_supported:
        if item in KNOWN_FAULT_CALLS:
            calls.add(KNOWN_FAULT_CALLS[item])
        elif item in KNOWN_FAULT_CALLS.values():
            calls.add(item)
        else:
            raise FleetError(
                f"faults.not_supported: unknown figure {item!r} (known: {', '.join(KNOWN_FAULT_CALLS)})",
                line=faults.key_lines["not_supported"],
            )
    memory_used = _get(entry, "memory_used_mib", int, 0, minimum=0, maximum=memory_mib)
    return FakeGpu(
        index=index,
        uuid=gpu_uuid,
        name=name,
        pci_bus_id=pci.upper(),
        memory_total_mib=memory_mib,
        memory_used_mib=memory_used,
        gpu_util_percent=_get(util, "gpu", int, 0, minimum=0, maximum=100),
        memory_util_percent=_get(util, "memory", int, 0, minimum=0, maximum=100),
        temperature_c=_get(entry, "temperature_c", int, 40, minimum=0, maximum=120),
        power_w=float(_get(entry, "power_w", (int, float), 60.0, minimum=0, maximum=2000)),
        mig=mig,
        topology_group=_get(entry, "topology_group", str),
        lost_from_start=_get(faults, "lost", bool, False),
        lost_after_calls=_get(faults, "lost_after_calls", (int, type(None)), None, minimum=0),
        not_supported=frozenset(calls),
        process_sm_util_percent=_get(entry, "process_sm_util_percent", int, 10, minimum=0, maximum=100),
        process_memory_mib=_get(entry, "process_memory_mib", int, 256, minimum=0, maximum=memory_mib),
    )


def _mig_from_entry(
    entry: _LineDict, node: str, index: int, model: str, memory_mib: int
) -> tuple[FakeMig, ...]:
    if "mig" not in entry or entry["mig"] is None:
        return ()
    line = entry.key_lines["mig"]
    raw = entry["mig"]
    profiles: list[str] = []
    if isinstance(raw, _LineDict):  # {"1g.18gb": 7}
        for profile, count in raw.items():
            if not isinstance(count, int) or isinstance(count, bool) or not 1 <= count <= 7:
                raise FleetError(f"mig: count for {profile!r} must be 1..7", line=raw.key_lines[profile])
            profiles.extend([profile] * count)
    elif isinstance(raw, list):
        profiles = list(raw)
    else:
        raise FleetError('mig must be a list of profiles (["1g.18gb", …]) or {profile: count}', line=line)
    if not profiles:
        raise FleetError("mig must name at least one profile (omit it for a non-MIG GPU)", line=line)
    if not any(tag in model for tag in MIG_CAPABLE):
        raise FleetError(f"{model} does not support MIG", line=line)
    slices = 0
    devices = []
    for mig_index, profile in enumerate(profiles):
        match = MIG_PROFILE_RE.match(profile) if isinstance(profile, str) else None
        if not match:
            raise FleetError(f"mig: {profile!r} is not a MIG profile like 1g.18gb", line=line)
        slices += int(match["slices"])
        mem = MIG_MEMORY_MIB.get(profile.removesuffix("+me"), int(match["gb"]) * 1024)
        if mem > memory_mib:
            raise FleetError(f"mig: {profile} is larger than the GPU's {memory_mib} MiB", line=line)
        devices.append(FakeMig(deterministic_uuid("MIG", node, index, mig_index), profile, mem))
    if slices > 7:
        raise FleetError(f"mig: the layout uses {slices} compute slices, a GPU has 7", line=line)
    return tuple(devices)
