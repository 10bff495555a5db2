"""The agent's heartbeat: inventory, metrics, workload states in; the desired workloads out.

One transaction per heartbeat, the node row locked first (one heartbeat of a node at a time), then
its device rows in id order. A malformed body or a device UUID that belongs to another node raises
before anything is written, so a refused heartbeat leaves no trace.
"""

from __future__ import annotations

import math
import re
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import connection, transaction
from django.db.models import DateTimeField, Value
from django.db.models.functions import Greatest
from django.utils import timezone
from django.utils.dateparse import parse_datetime
from psycopg.types.json import Jsonb

from billing.models import Account
from billing.services.metering import meter_alive
from core.errors import Conflict, ValidationFailed
from provisioner.catalog_cache import catalog_changed
from provisioner.messages import message
from provisioner.models import (
    SLOTS_PER_GPU,
    Allocation,
    Device,
    DeviceSample,
    Environment,
    GpuModel,
    Node,
    Session,
    StopWarning,
)
from provisioner.selectors import desired_workloads, published_pythons, workload_user
from provisioner.services import sessions as lifecycle
from provisioner.services.environments import node_environments_record

S = Session.State
WORKLOAD_STATES = ("starting", "running", "exited", "failed")
MAX_INDEX = 32767  # the columns' ranges: a figure outside them is garbage, not a bigger GPU
MAX_MIB = 2**31 - 1


# --- validation --------------------------------------------------------------------------------------


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _num_or_none(value) -> bool:
    return value is None or (isinstance(value, int | float) and not isinstance(value, bool))


def _str(value, *, required: bool = True) -> bool:
    return isinstance(value, str) and (bool(value) or not required)


ENFORCED_BY = {
    "device-nodes",  # the sandbox's /dev holds only this GPU's nodes
    "device-request",  # the container runtime was given this GPU alone
    "environment",  # CUDA_VISIBLE_DEVICES only, which the workload can change
    "whole-device",
    "mig",
    "mps",
    "libvgpu",  # libvgpu.so through an /etc/ld.so.preload the workload cannot change
    "ld-preload-variable",  # libvgpu.so through LD_PRELOAD only, which the workload can unset
    "no-libvgpu",
    "time-slicing",
}


MAX_GPUS_PER_SESSION = 16


def enforcement_clean(value) -> dict | None:
    """A workload's ``enforcement`` report as stored on its session, or None when the agent sent none
    or sent garbage (the page then says nothing is known to be enforced)."""
    if not isinstance(value, dict):
        return None
    cleaned = {}
    for key in ("device", "memory", "compute"):
        part = value.get(key)
        if not isinstance(part, dict) or not isinstance(part.get("enforced"), bool):
            return None
        if part.get("by") not in ENFORCED_BY:
            return None
        cleaned[key] = {"enforced": part["enforced"], "by": part["by"]}
    per_device = value.get("per_device")
    if isinstance(per_device, dict) and 0 < len(per_device) <= MAX_GPUS_PER_SESSION:
        devices = {
            u: enforcement_clean({k: part.get(k) for k in ("device", "memory", "compute")})
            for u, part in per_device.items()
            if _str(u) and len(u) <= 100 and isinstance(part, dict)
        }
        if len(devices) == len(per_device) and all(devices.values()):  # a multi-GPU session: each GPU
            cleaned["per_device"] = devices
    return cleaned


_TOPOLOGY_GROUP = re.compile(r"[A-Za-z0-9_.:-]{1,64}")


def topology_group_clean(value) -> str:
    """A GPU's topology group as reported (a short name), or blank when absent or garbage: the GPU is
    then placed as if its node were one group."""
    return value if isinstance(value, str) and _TOPOLOGY_GROUP.fullmatch(value) else ""


def _count(value) -> int | None:
    return value if _is_int(value) and value >= 0 else None


def _figure(value, *, top: float) -> float | None:
    """A figure in 0..top, or None (NaN and infinities included: Python's JSON reads them)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if not math.isfinite(value) or not 0 <= value <= top:
        return None
    return float(value)


def _instant(value) -> datetime | None:
    try:
        at = parse_datetime(value) if isinstance(value, str) else None
    except ValueError:  # well formed but no such time
        return None
    if at is not None and timezone.is_naive(at):
        at = timezone.make_aware(at, UTC)
    return at


def activity_clean(value) -> dict:
    """A workload's ``activity`` report (docs/AGENT_PROTOCOL.md) flattened, each figure None where the
    agent sent none or garbage: a node that reports nonsense loses that sign of use, not its
    heartbeat."""
    value = value if isinstance(value, dict) else {}
    jupyter = value.get("jupyter") if isinstance(value.get("jupyter"), dict) else {}
    return {
        "last_activity": _instant(jupyter.get("last_activity")),
        "busy_kernels": _count(jupyter.get("busy_kernels")),
        "connections": _count(jupyter.get("connections")),
        "cpu_seconds": _figure(value.get("cpu_seconds"), top=1e12),
        "gpu_util_percent": _figure(value.get("gpu_util_percent"), top=100),
        "gpu_memory_bytes": _count(value.get("gpu_memory_bytes")),
    }


MAX_HOMES = 5000  # in one heartbeat; the agent sends only what it measured since the last one
_HOME_NAME = re.compile(r"(?P<name>[A-Za-z0-9_][A-Za-z0-9_.-]{0,63})-(?P<id>[0-9]{1,18})")
_MAX_BIGINT = 2**63 - 1


def homes_clean(value, *, now: datetime) -> dict[int, dict]:
    """The ``homes`` report (docs/AGENT_PROTOCOL.md) by user id, the newest entry of each user; an entry
    that is garbage (a name that is no home's, a figure that is not a count, no time) is dropped, the
    heartbeat never refused for it. A time ahead of ``now`` (a node's clock) counts as ``now``, so it
    cannot win over later measurements. Whether each name is its user's home is checked on recording."""
    cleaned: dict[int, dict] = {}
    for entry in value[:MAX_HOMES] if isinstance(value, list) else []:
        if not isinstance(entry, dict) or not isinstance(entry.get("user"), str):
            continue
        named = _HOME_NAME.fullmatch(entry["user"])
        at = _instant(entry.get("measured_at"))
        figures = [_count(entry.get(k)) for k in ("bytes", "files")]
        if named is None or at is None or any(f is None or f > _MAX_BIGINT for f in figures):
            continue
        user_id, at = int(named["id"]), min(at, now)
        if user_id not in cleaned or cleaned[user_id]["measured_at"] < at:
            cleaned[user_id] = {
                "name": entry["user"],
                "bytes": figures[0],
                "files": figures[1],
                "measured_at": at,
            }
    return cleaned


_TEAM_KEY = re.compile(r"[0-9]{1,18}")


def team_folders_clean(value, *, now: datetime) -> dict[int, dict]:
    """The ``team_folders`` report (docs/AGENT_PROTOCOL.md) by team account id, the newest entry of
    each, garbage dropped as ``homes_clean`` drops it (the heartbeat is never refused for it). Whether
    each id is a team's account is checked on recording."""
    cleaned: dict[int, dict] = {}
    for entry in value[:MAX_HOMES] if isinstance(value, list) else []:
        if not isinstance(entry, dict) or not isinstance(entry.get("team"), str):
            continue
        at = _instant(entry.get("measured_at"))
        figures = [_count(entry.get(k)) for k in ("bytes", "files")]
        if (
            not _TEAM_KEY.fullmatch(entry["team"])
            or at is None
            or any(f is None or f > _MAX_BIGINT for f in figures)
        ):
            continue
        account_id, at = int(entry["team"]), min(at, now)
        if account_id not in cleaned or cleaned[account_id]["measured_at"] < at:
            cleaned[account_id] = {"bytes": figures[0], "files": figures[1], "measured_at": at}
    return cleaned


def heartbeat_validate(body) -> dict:
    """Check the shape of a heartbeat (docs/AGENT_PROTOCOL.md); raise ValidationFailed naming each field
    at fault. Unknown extra fields are tolerated (the agent may grow), wrong types are not."""
    if not isinstance(body, dict):
        raise ValidationFailed("The heartbeat must be a JSON object.", fields={"": "must be an object"})
    errors: dict[str, str] = {}
    for key in ("agent_version", "runtime"):
        if key in body and not _str(body[key], required=False):
            errors[key] = "must be a string"
    errors |= _inventory_errors(body.get("inventory"))
    errors |= _capabilities_errors(body.get("capabilities", {}))
    errors |= _metrics_errors(body.get("metrics", {"gpus": []}))
    errors |= _workloads_errors(body.get("workloads", []))
    if errors:
        raise ValidationFailed(
            "Malformed heartbeat: " + "; ".join(f"{k}: {v}" for k, v in list(errors.items())[:5]),
            fields=errors,
        )
    return body


def _inventory_errors(inventory) -> dict[str, str]:
    """The GPUs and their MIG devices; a UUID may appear once in the whole inventory."""
    if not isinstance(inventory, dict):
        return {"inventory": "must be an object"}
    gpus = inventory.get("gpus")
    if not isinstance(gpus, list):
        return {"inventory.gpus": "must be a list"}
    errors: dict[str, str] = {}
    seen: set[str] = set()
    for i, gpu in enumerate(gpus):
        where = f"inventory.gpus.{i}"
        if not isinstance(gpu, dict):
            errors[where] = "must be an object"
            continue
        errors |= _uuid_errors(gpu, where, seen)
        if not _is_int(gpu.get("index")) or not 0 <= gpu["index"] <= MAX_INDEX:
            errors[f"{where}.index"] = f"must be an integer in 0..{MAX_INDEX}"
        if not _str(gpu.get("name")):
            errors[f"{where}.name"] = "must be a non-empty string"
        if not _is_int(gpu.get("memory_total_mib")) or not 0 <= gpu["memory_total_mib"] <= MAX_MIB:
            errors[f"{where}.memory_total_mib"] = "must be an integer ≥ 0"
        if "mig_mode" in gpu and not isinstance(gpu["mig_mode"], bool):
            errors[f"{where}.mig_mode"] = "must be a boolean"
        if gpu.get("health", "ok") not in ("ok", "lost"):
            errors[f"{where}.health"] = "must be ok or lost"
        migs = gpu.get("mig_devices", [])
        if not isinstance(migs, list):
            errors[f"{where}.mig_devices"] = "must be a list"
            continue
        for j, mig in enumerate(migs):
            errors |= _mig_device_errors(mig, f"{where}.mig_devices.{j}", seen)
    return errors


def _uuid_errors(device: dict, where: str, seen: set[str]) -> dict[str, str]:
    """A device's UUID: a string of at most 100 characters, not in ``seen`` (which it joins)."""
    device_uuid = device.get("uuid")
    if not _str(device_uuid) or len(device_uuid) > 100:
        return {f"{where}.uuid": "must be a non-empty string"}
    if device_uuid in seen:
        return {f"{where}.uuid": "listed twice"}
    seen.add(device_uuid)
    return {}


def _mig_device_errors(mig, where: str, seen: set[str]) -> dict[str, str]:
    if not isinstance(mig, dict):
        return {where: "must be an object"}
    errors = _uuid_errors(mig, where, seen)
    if not _str(mig.get("profile")):
        errors[f"{where}.profile"] = "must be a non-empty string"
    mig_mib = mig.get("memory_total_mib", 0)
    if mig_mib is not None and (not _is_int(mig_mib) or not 0 <= mig_mib <= MAX_MIB):
        errors[f"{where}.memory_total_mib"] = "must be an integer ≥ 0"
    return errors


def _capabilities_errors(capabilities) -> dict[str, str]:
    policies = capabilities.get("sharing_policies", []) if isinstance(capabilities, dict) else None
    if not isinstance(policies, list) or not all(isinstance(p, str) for p in policies):
        return {"capabilities": "must be an object whose sharing_policies is a list of strings"}
    pythons = capabilities.get("environments", [])
    if not isinstance(pythons, list) or not all(isinstance(p, str) for p in pythons):
        return {"capabilities.environments": "must be a list of strings"}
    interfaces = capabilities.get("interfaces", [])
    if not isinstance(interfaces, list) or not all(isinstance(i, str) for i in interfaces):
        return {"capabilities.interfaces": "must be a list of strings"}
    return {}


def _interfaces_served(capabilities) -> list[str]:
    """What the node's workloads can serve; an agent from before the interfaces serves JupyterLab."""
    reported = (capabilities or {}).get("interfaces") or ["jupyterlab"]
    return sorted({i for i in reported if i in Environment.Interface.values})


SAMPLE_FIGURES = (
    "gpu_util_percent",
    "memory_util_percent",
    "memory_used_mib",
    "temperature_c",
    "power_w",
    "energy_mj",
)


def _metrics_errors(metrics) -> dict[str, str]:
    if not isinstance(metrics, dict) or not isinstance(metrics.get("gpus", []), list):
        return {"metrics": "must be an object with a list of gpus"}
    errors: dict[str, str] = {}
    for i, sample in enumerate(metrics.get("gpus", [])):
        if not isinstance(sample, dict) or not _str(sample.get("uuid")):
            errors[f"metrics.gpus.{i}"] = "must be an object with a uuid"
            continue
        for key in SAMPLE_FIGURES:
            if not _num_or_none(sample.get(key)):
                errors[f"metrics.gpus.{i}.{key}"] = "must be a number or null"
    return errors


def _workloads_errors(workloads) -> dict[str, str]:
    if not isinstance(workloads, list):
        return {"workloads": "must be a list"}
    errors: dict[str, str] = {}
    for i, status in enumerate(workloads):
        if not isinstance(status, dict) or not _str(status.get("session_id")):
            errors[f"workloads.{i}"] = "must be an object with a session_id"
            continue
        if status.get("state") not in WORKLOAD_STATES:
            errors[f"workloads.{i}.state"] = f"must be one of {', '.join(WORKLOAD_STATES)}"
        for key in ("upstream", "exit_reason"):
            if status.get(key) is not None and not isinstance(status[key], str):
                errors[f"workloads.{i}.{key}"] = "must be a string or null"
        if not _num_or_none(status.get("gpu_util_percent")):
            errors[f"workloads.{i}.gpu_util_percent"] = "must be a number or null"
    return errors


# --- recording ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HeartbeatAnswer:
    """The answer to a heartbeat; the API renders it as ``serializers.HeartbeatOut``."""

    desired_workloads: list[dict]
    heartbeat_interval_seconds: int
    environments: list[str]  # the published interpreters, for the agent to say which it has


def _new_device_policy(node: Node, served: list[str] | None) -> str:
    """A GPU seen for the first time gets the node's ``sharing_policy`` label, else the model default,
    as long as the agent serves it (fixed-share needs HAMi's libvgpu.so, equal-share MPS); otherwise the
    first shared policy the agent reports it serves. An agent that reports nothing is taken at its word
    for the label or default (older agents)."""
    wanted = (node.labels or {}).get("sharing_policy") if isinstance(node.labels, dict) else None
    if wanted not in Device.Sharing.values:
        wanted = Device._meta.get_field("sharing_policy").default
    if served is None or wanted in served:
        return wanted
    return next((p for p in Device.SHARED if p in served), Device.Sharing.EXCLUSIVE)


def _model_for(nvml_name: str, models: list[GpuModel]) -> GpuModel | None:
    return next((m for m in models if m.matches(nvml_name)), None)


def _record_inventory(
    node: Node, inventory: dict, now: datetime, served: list[str] | None = None
) -> dict[str, Device]:
    gpus = inventory.get("gpus", [])
    uuids = [g["uuid"] for g in gpus] + [m["uuid"] for g in gpus for m in g.get("mig_devices", [])]
    elsewhere = list(
        Device.objects.filter(uuid__in=uuids).exclude(node=node).values_list("uuid", "node__name")[:5]
    )
    if elsewhere:
        raise Conflict(
            "Device "
            + ", ".join(f"{u} belongs to node {n}" for u, n in elsewhere)
            + ": a GPU moved between nodes needs an admin to remove it from the old node first.",
            code="device_moved",
            fields={"inventory.gpus": "a device UUID belongs to another node"},
        )
    models = list(GpuModel.objects.all())
    # Most beats change nothing: then no device is locked (a launch placing on one is never held up by
    # a node's heartbeat), and ``last_seen_at`` moves on every device not locked at this instant.
    seen = {d.uuid: d for d in Device.objects.filter(node=node).order_by("id")}
    if _inventory_unchanged(gpus, seen, models):
        _devices_seen([d.id for d in seen.values()], now)
        return {g["uuid"]: seen[g["uuid"]] for g in gpus} | {
            m["uuid"]: seen[m["uuid"]] for g in gpus for m in g.get("mig_devices", [])
        }
    existing = {
        d.uuid: d
        for d in Device.objects.select_for_update(of=("self",), no_key=True).filter(node=node).order_by("id")
    }
    by_uuid: dict[str, Device] = {}
    unchanged: list[int] = []

    def upsert(device: Device, **fields) -> Device:
        """Write the device only when the inventory changed it; the rest only get ``last_seen_at``."""
        if device.pk is not None and _as_reported(device, fields):
            unchanged.append(device.pk)
        else:
            for key, value in fields.items():
                setattr(device, key, value)
            device.last_seen_at = now
            device.save()  # a device came or changed: its post_save drops the cached catalog
        by_uuid[device.uuid] = device
        return device

    new_policy = _new_device_policy(node, served)
    for gpu in gpus:
        model = _model_for(gpu["name"], models)
        device = upsert(
            existing.get(gpu["uuid"])
            or Device(node=node, uuid=gpu["uuid"], kind=Device.Kind.PHYSICAL, sharing_policy=new_policy),
            **_gpu_fields(gpu, model),
        )
        for mig in gpu.get("mig_devices", []):
            upsert(
                existing.get(mig["uuid"]) or Device(node=node, uuid=mig["uuid"], kind=Device.Kind.MIG),
                **_mig_fields(mig, device),
            )
    if unchanged:
        Device.objects.filter(id__in=unchanged).update(last_seen_at=now)
    gone = [d.id for u, d in existing.items() if u not in by_uuid and d.health != Device.Health.MISSING]
    if gone:
        Device.objects.filter(id__in=gone).update(health=Device.Health.MISSING)
        catalog_changed()
    return by_uuid


def _gpu_fields(gpu: dict, model: GpuModel | None) -> dict:
    """A physical GPU's device fields as the inventory reports them."""
    return {
        "index": gpu["index"],
        "nvml_name": gpu["name"][:100],
        "gpu_model_id": model.pk if model else None,
        "pci_bus_id": str(gpu.get("pci_bus_id") or "")[:32],
        "topology_group": topology_group_clean(gpu.get("topology_group")),
        "memory_mib": gpu["memory_total_mib"],
        "mig_mode": bool(gpu.get("mig_mode")),
        "health": gpu.get("health", "ok"),
    }


def _mig_fields(mig: dict, parent: Device) -> dict:
    """A MIG device's fields as the inventory reports them, under its GPU's ``parent`` device."""
    return {
        "parent_id": parent.pk,
        "index": parent.index,
        "gpu_model_id": parent.gpu_model_id,
        "nvml_name": parent.nvml_name,
        "mig_profile": mig["profile"][:32],
        "memory_mib": mig.get("memory_total_mib") or 0,
        "health": parent.health,
        "sharing_policy": Device.Sharing.EXCLUSIVE,
    }


def _as_reported(device: Device, fields: dict) -> bool:
    """Whether ``device`` already has the ``fields`` the inventory reports for it."""
    return all(getattr(device, key) == value for key, value in fields.items())


def _inventory_unchanged(gpus: list[dict], devices: dict[str, Device], models: list[GpuModel]) -> bool:
    """Whether the node's ``devices`` (read without locks) are already what ``gpus`` reports: none new,
    none changed, none gone that is not marked missing yet."""

    for gpu in gpus:
        device = devices.get(gpu["uuid"])
        if device is None or not _as_reported(device, _gpu_fields(gpu, _model_for(gpu["name"], models))):
            return False
        for mig in gpu.get("mig_devices", []):
            found = devices.get(mig["uuid"])
            if found is None or not _as_reported(found, _mig_fields(mig, device)):
                return False
    reported = {g["uuid"] for g in gpus} | {m["uuid"] for g in gpus for m in g.get("mig_devices", [])}
    return all(d.health == Device.Health.MISSING for u, d in devices.items() if u not in reported)


def _devices_seen(device_ids: list[int], now: datetime) -> None:
    """``last_seen_at = now`` on these devices, skipping any a placement holds at this instant (the
    next beat marks it): one statement, no wait."""
    if not device_ids:
        return
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE provisioner_device SET last_seen_at = %s WHERE id IN (SELECT id FROM provisioner_device "
            "WHERE id = ANY(%s) ORDER BY id FOR NO KEY UPDATE SKIP LOCKED)",
            [now, device_ids],
        )


def _devices_figures(latest: dict[int, dict]) -> None:
    """``last_metrics`` of these devices, skipping any a placement holds at this instant (the next beat
    writes it; the sample is kept all the same): one statement, no wait. A heartbeat that waited here
    for one device while holding others (``_devices_seen`` takes those it finds free) closed a cycle
    with placements that lock every device in id order: PostgreSQL's deadlock, a 500 for the launches."""
    if not latest:
        return
    ids = sorted(latest)
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE provisioner_device AS d SET last_metrics = f.figures "
            "FROM unnest(%s::bigint[], %s::jsonb[]) AS f(id, figures) "
            "WHERE d.id = f.id AND d.id IN (SELECT id FROM provisioner_device "
            "WHERE id = ANY(%s) ORDER BY id FOR NO KEY UPDATE SKIP LOCKED)",
            [ids, [Jsonb(latest[i]) for i in ids], ids],
        )


_HOME_USAGE_SQL = """
INSERT INTO provisioner_homeusage (user_id, bytes, files, measured_at, node_id) VALUES {rows}
ON CONFLICT (user_id) DO UPDATE
SET bytes = EXCLUDED.bytes, files = EXCLUDED.files, measured_at = EXCLUDED.measured_at,
    node_id = EXCLUDED.node_id
WHERE provisioner_homeusage.measured_at < EXCLUDED.measured_at
"""


def _record_homes(node: Node, homes: dict[int, dict]) -> None:
    """Store each home's figures unless a newer measurement is stored (one statement, whatever the
    order heartbeats of several nodes land in). A name that is not its user's home is ignored."""
    if not homes:
        return
    users = get_user_model().objects.filter(pk__in=list(homes))
    rows = [
        (user.pk, homes[user.pk]["bytes"], homes[user.pk]["files"], homes[user.pk]["measured_at"], node.pk)
        for user in users
        if workload_user(user) == homes[user.pk]["name"]
    ]
    if rows:
        with connection.cursor() as cursor:
            cursor.execute(
                _HOME_USAGE_SQL.format(rows=", ".join(["(%s, %s, %s, %s, %s)"] * len(rows))),
                [figure for row in rows for figure in row],
            )


_TEAM_FOLDER_USAGE_SQL = """
INSERT INTO provisioner_teamfolderusage (account_id, bytes, files, measured_at, node_id) VALUES {rows}
ON CONFLICT (account_id) DO UPDATE
SET bytes = EXCLUDED.bytes, files = EXCLUDED.files, measured_at = EXCLUDED.measured_at,
    node_id = EXCLUDED.node_id
WHERE provisioner_teamfolderusage.measured_at < EXCLUDED.measured_at
"""


def _record_team_folders(node: Node, folders: dict[int, dict]) -> None:
    """Store each team folder's figures unless a newer measurement is stored (one statement, as
    ``_record_homes``). An id that is not a team account's is ignored."""
    if not folders:
        return
    teams = Account.objects.filter(pk__in=list(folders), kind=Account.Kind.TEAM).values_list("pk", flat=True)
    rows = [
        (pk, folders[pk]["bytes"], folders[pk]["files"], folders[pk]["measured_at"], node.pk)
        for pk in sorted(teams)
    ]
    if rows:
        with connection.cursor() as cursor:
            cursor.execute(
                _TEAM_FOLDER_USAGE_SQL.format(rows=", ".join(["(%s, %s, %s, %s, %s)"] * len(rows))),
                [figure for row in rows for figure in row],
            )


_PRUNE_SQL = """
DELETE FROM provisioner_devicesample WHERE id IN (
    SELECT id FROM (
        SELECT id, row_number() OVER (PARTITION BY device_id ORDER BY collected_at DESC, id DESC) AS rn
        FROM provisioner_devicesample WHERE device_id = ANY(%s)
    ) ranked WHERE rn > %s
)
"""


def _record_metrics(metrics: dict, devices: dict[str, Device], now: datetime) -> dict[int, float]:
    """Store each device's figures and a sample of them; returns each device's utilisation by id."""
    collected = parse_datetime(str(metrics.get("collected_at") or "")) or now
    if timezone.is_naive(collected):
        collected = timezone.make_aware(collected, UTC)
    samples = []
    latest: dict[int, dict] = {}
    for sample in metrics.get("gpus", []):
        device = devices.get(sample["uuid"])
        if device is None:
            continue
        figures = {k: v for k, v in sample.items() if k != "uuid"}
        latest[device.id] = {**figures, "collected_at": collected.isoformat()}
        samples.append(
            DeviceSample(
                device=device,
                collected_at=collected,
                gpu_util_percent=_small(sample.get("gpu_util_percent")),
                memory_used_mib=_small(sample.get("memory_used_mib"), top=2**31 - 1),
                temperature_c=_small(sample.get("temperature_c")),
                power_w=sample.get("power_w"),
            )
        )
    _devices_figures(latest)
    if samples:
        DeviceSample.objects.bulk_create(samples)
        with connection.cursor() as cursor:
            cursor.execute(_PRUNE_SQL, [[s.device_id for s in samples], settings.DEVICE_SAMPLES_KEPT])
    return {s.device_id: s.gpu_util_percent for s in samples if s.gpu_util_percent is not None}


def _small(value, *, top: int = 32767) -> int | None:
    """A reported figure clamped into its column (smallint unless ``top`` says otherwise)."""
    return None if value is None else int(max(-top - 1, min(value, top)))


def _session_uuid(raw: str) -> uuid.UUID | None:
    try:
        return uuid.UUID(raw)
    except ValueError:
        return None


def _record_workloads(
    node: Node, workloads: list[dict], now: datetime, device_util: dict[int, float]
) -> None:
    """Apply what the agent reports of each of its workloads to the session, then end what it no longer
    runs; a session in use restarts its idle clock and clears its live idle warning. Reports of
    sessions not placed on this node are ignored (the agent stops them as orphans). ``device_util``:
    each device's utilisation in this heartbeat, by device id."""
    reported = {sid: w for w in workloads if (sid := _session_uuid(w["session_id"])) is not None}
    sessions = {
        s.id: s
        for s in Session.objects.filter(node=node)
        .filter(id__in=list(reported))
        .only("id", "state", "idle_seconds", "device_id", "slot_count", "cpu_seconds", "cpu_seen_at")
    }
    alive: list[str] = []
    active: list[uuid.UUID] = []
    for sid, status in reported.items():
        session = sessions.get(sid)
        if session is None:
            continue  # not ours: the agent stops it as an orphan (it is not desired)
        state = status["state"]
        if state == "running":
            seen_alive, seen_active = _workload_running(session, status, now, device_util)
            if seen_alive:
                alive.append(str(sid))
            if seen_active:
                active.append(sid)
        elif state == "starting":
            if session.state == S.PLACING:
                lifecycle.session_mark_starting(session_id=sid)
        elif state in ("exited", "failed"):
            _workload_ended(node, session, status, now)
    if alive:
        meter_alive(session_refs=alive, alive_at=now)
    if active:
        Session.objects.filter(id__in=active).update(last_active_at=now)
        StopWarning.objects.filter(
            session_id__in=active, kind=StopWarning.Kind.IDLE, cleared_at__isnull=True
        ).update(cleared_at=now)
    listed_live = {sid for sid, w in reported.items() if w["state"] in ("starting", "running")}
    _unlisted_sessions_end(node, listed_live=listed_live, now=now)


def _workload_running(
    session: Session, status: dict, now: datetime, device_util: dict[int, float]
) -> tuple[bool, bool]:
    """A workload the agent reports running: a placing or starting session becomes running; a running
    one records that it is alive, its GPU use, its CPU seconds and what the agent enforces. Returns
    (alive, active): whether the session was running when recorded (its meter follows), and whether
    it showed any sign of use (``_in_use``: its idle clock restarts)."""
    if session.state in (S.PLACING, S.STARTING):
        lifecycle.session_mark_running(session_id=session.id, upstream=status.get("upstream") or "", at=now)
        session.state = S.RUNNING
    if session.state != S.RUNNING:
        return False, False
    util = status.get("gpu_util_percent")
    activity = activity_clean(status.get("activity"))
    in_use = _in_use(session, activity, _session_gpu_percent(session, activity, util, device_util), now)
    # Never backwards: the start poll may have marked it running (alive at the poll's later
    # time) after this heartbeat took ``now`` and before it read the session here. A last
    # alive time before it ran would leave a lost session's meter, which starts when it ran,
    # billed past the session's last alive time.
    alive_at = Greatest("last_alive_at", Value(now, output_field=DateTimeField()))
    fields = {"last_alive_at": alive_at, "gpu_util_percent": _small(util)}
    if activity["cpu_seconds"] is not None:
        fields |= {"cpu_seconds": activity["cpu_seconds"], "cpu_seen_at": now}
    if upstream := status.get("upstream"):
        fields["upstream"] = upstream
    if (enforced := enforcement_clean(status.get("enforcement"))) is not None:
        fields["enforcement"] = enforced
    # The meter follows the session: a stop that lands between our read and this update
    # leaves both at the last time the session was seen alive while running.
    if not Session.objects.filter(id=session.id, state=S.RUNNING).update(**fields):
        return False, False
    return True, in_use


def _session_gpu_percent(
    session: Session, activity: dict, util: float | None, device_util: dict[int, float]
) -> float | None:
    """The GPU use of the session's own processes (the activity's figure, else the status's from an
    older agent); the whole device's utilisation only when there is no per-process figure and the
    session holds the whole device, so that another tenant's work never keeps it alive."""
    own = activity["gpu_util_percent"]
    if own is None:
        own = _figure(util, top=100)
    if own is None and session.slot_count == SLOTS_PER_GPU:
        own = device_util.get(session.device_id)
    return own


def _in_use(session: Session, activity: dict, gpu_percent: float | None, now: datetime) -> bool:
    """Whether the session showed any sign of use in this report: a kernel executing, kernel or
    terminal activity within the heartbeat window, a browser connected (SESSION_IDLE_COUNT_CONNECTED),
    its CPU use since the previous report at SESSION_IDLE_CPU_PERCENT of one core or more, or its GPU
    use at SESSION_IDLE_GPU_PERCENT or more. Idle only when none; an unknown figure is no sign."""
    cpu_percent = _cpu_percent(session, activity["cpu_seconds"], now)
    return (
        bool(activity["busy_kernels"])
        or (activity["last_activity"] is not None and _recent(activity["last_activity"], now))
        or (settings.SESSION_IDLE_COUNT_CONNECTED and bool(activity["connections"]))
        or (cpu_percent is not None and cpu_percent >= settings.SESSION_IDLE_CPU_PERCENT)
        or (gpu_percent is not None and gpu_percent >= settings.SESSION_IDLE_GPU_PERCENT)
    )


def _cpu_percent(session: Session, cpu_seconds: float | None, now: datetime) -> float | None:
    """Percent of one core the workload used since its previous CPU report; None without one, or when
    the figure went down (a process ended unreaped, a restarted container)."""
    if cpu_seconds is None or session.cpu_seconds is None or session.cpu_seen_at is None:
        return None
    spent, elapsed = cpu_seconds - session.cpu_seconds, (now - session.cpu_seen_at).total_seconds()
    if spent < 0 or elapsed <= 0:
        return None
    return 100 * spent / elapsed


def _workload_ended(node: Node, session: Session, status: dict, now: datetime) -> None:
    """A workload the agent reports exited or failed: a running session whose Jupyter exited is
    stopped, any other on the node failed, and a stopping one stopped."""
    state = status["state"]
    why = status.get("exit_reason") or (
        message("jupyter_exited_plain") if state == "exited" else message("workload_failed")
    )
    if session.state == S.RUNNING and state == "exited":
        lifecycle.session_end(
            session_id=session.id,
            to=S.STOPPED,
            reason=message("jupyter_exited", why=why),
            from_states=[S.RUNNING],
            ended_at=now,
        )
    elif session.state in Session.ON_NODE:
        lifecycle.session_end(
            session_id=session.id,
            to=S.FAILED,
            reason=message("failed_on", node=node.name, why=why),
            from_states=list(Session.ON_NODE),
            ended_at=now,
        )
    elif session.state == S.STOPPING:
        lifecycle.session_end(
            session_id=session.id,
            to=S.STOPPED,
            reason=message("stopped"),
            from_states=[S.STOPPING],
            ended_at=now,
        )


def _unlisted_sessions_end(node: Node, *, listed_live: set[uuid.UUID], now: datetime) -> None:
    """Whatever the agent no longer runs: stopping → stopped; ended sessions give their slots back."""
    for sid in (
        Session.objects.filter(node=node, state=S.STOPPING)
        .exclude(id__in=listed_live)
        .values_list("id", flat=True)
    ):
        lifecycle.session_end(
            session_id=sid, to=S.STOPPED, reason=message("stopped"), from_states=[S.STOPPING], ended_at=now
        )
    gone = (
        Allocation.objects.filter(session__node=node, session__state__in=Session.ENDED)
        .exclude(session_id__in=listed_live)
        .values_list("session_id", flat=True)
    )
    lifecycle.session_freed_after_gone(session_ids=list(gone))


def _recent(at: datetime, now: datetime) -> bool:
    """Within the heartbeat window: three intervals, for a late heartbeat and the node's clock."""
    return (now - at).total_seconds() < settings.AGENT_HEARTBEAT_INTERVAL_SECONDS * 3


def heartbeat_record(*, node: Node, body) -> HeartbeatAnswer:
    """Record one heartbeat and answer the node's desired workloads.

    Validates first (ValidationFailed, nothing written); in one transaction: locks the node row, checks
    that no reported device UUID belongs to another node (Conflict, nothing written), upserts devices,
    records metrics (keeping the last DEVICE_SAMPLES_KEPT per device), applies workload states to
    sessions (conditional transitions, meters alive/open/close), stores the homes' and team folders'
    measured usage (the newest measurement of each wins; garbage entries dropped), the published
    interpreters the agent has (``capabilities.environments``; the answer names them all, for the agent
    to check), and marks the node seen (a node that was down comes back to the state it had). Safe to
    repeat.
    """
    body = heartbeat_validate(body)
    with transaction.atomic():
        node = Node.objects.select_for_update(no_key=True).get(id=node.id)
        now = timezone.now()  # after the lock: heartbeats of one node are recorded in time order
        served = (body.get("capabilities") or {}).get("sharing_policies")
        devices = _record_inventory(node, body["inventory"], now, served)
        device_util = _record_metrics(body.get("metrics") or {}, devices, now)
        _record_workloads(node, body.get("workloads", []), now, device_util)
        _record_homes(node, homes_clean(body.get("homes"), now=now))
        _record_team_folders(node, team_folders_clean(body.get("team_folders"), now=now))
        node.last_heartbeat_at = now
        node.agent_version = str(body.get("agent_version") or "")[:32]
        node.runtime = str(body.get("runtime") or "")[:32]
        node.driver_version = str(body["inventory"].get("driver_version") or "")[:32]
        node.cuda_version = str(body["inventory"].get("cuda_version") or "")[:32]
        fields = ["last_heartbeat_at", "agent_version", "runtime", "driver_version", "cuda_version"]
        served = node_environments_record(
            node=node, reported=(body.get("capabilities") or {}).get("environments")
        )
        if served is not None:
            node.environments = served
            fields.append("environments")
        interfaces = _interfaces_served(body.get("capabilities"))
        if interfaces != node.interfaces:  # rarely: an agent restarted with(out) code-server
            node.interfaces = interfaces
            fields.append("interfaces")  # a change the catalog is told of (its environments)
        if node.state == Node.State.DOWN:
            node.state = node.state_before_down or Node.State.ACTIVE
            node.state_before_down = ""
            fields += ["state", "state_before_down"]  # the catalog is told by the save (provisioner.apps)
        node.save(update_fields=fields)  # what the beat says, nothing an admin edited meanwhile
        desired = desired_workloads(node=node)
    return HeartbeatAnswer(desired, settings.AGENT_HEARTBEAT_INTERVAL_SECONDS, published_pythons())


def nodes_liveness_sweep(*, now: datetime | None = None) -> list[str]:
    """Mark nodes without a heartbeat for NODE_LIVENESS_SECONDS down (conditional update) and their
    sessions lost, billed to their last alive time. Returns the names of the nodes marked down."""
    now = now or timezone.now()
    cutoff = now - timedelta(seconds=settings.NODE_LIVENESS_SECONDS)
    down = []
    for node in Node.objects.exclude(state=Node.State.DOWN).filter(last_heartbeat_at__lt=cutoff):
        with transaction.atomic():
            moved = Node.objects.filter(id=node.id, state=node.state, last_heartbeat_at__lt=cutoff).update(
                state=Node.State.DOWN, state_before_down=node.state
            )
            if not moved:
                continue
            catalog_changed()
            lifecycle.node_sessions_lost(
                node=node,
                reason=message("node_silent", node=node.name, time=f"{node.last_heartbeat_at:%H:%M:%S}"),
            )
        down.append(node.name)
    return down
