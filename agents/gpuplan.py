"""GPU plans: what exactly a workload gets from its allocation. Pure functions over dataclasses.

A plan names the device the workload sees (by UUID), the environment that enforces its share, and
the files to mount. The host's facts (is ``libvgpu.so`` there, is the MPS control binary there)
come in as ``HostGpuTools``; nothing here touches the file system.

Sharing policies, one per GPU at a time:
- ``exclusive``: a whole card or a MIG device, passed through by UUID; no caps. A multi-GPU profile
  (``2x``, ``4x``, ``8x``) passes through that many whole cards of this node, all of them by UUID.
- ``fixed-share``: HAMi-core's ``libvgpu.so`` preloaded; ``CUDA_DEVICE_MEMORY_LIMIT`` and
  ``CUDA_DEVICE_SM_LIMIT`` from the slice.
- ``equal-share``: one NVIDIA MPS control daemon per GPU; ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` and
  ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` from the slice.
- ``best-effort``: time slicing with a memory cap only (enforced by ``libvgpu.so`` where present).
"""

from __future__ import annotations

import copy
import functools
import re
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field

SLOTS_PER_GPU = 8
SLICE_PROFILES = {"whole": 8, "1/2": 4, "1/4": 2, "1/8": 1}
SHARING_POLICIES = ("exclusive", "fixed-share", "equal-share", "best-effort")
SHARED_POLICIES = ("fixed-share", "equal-share", "best-effort")
MIG_PROFILE_RE = re.compile(r"^(?P<slices>[1-7])g\.(?P<gb>\d+)gb(?:\+me)?$")
GPU_COUNT_RE = re.compile(r"^(?P<count>[248])x$")  # N whole GPUs: 2x, 4x, 8x
# Where libvgpu.so and its preload list appear inside a sandbox or container, as HAMi lays them out.
VGPU_LIB_TARGET = "/usr/local/vgpu/libvgpu.so"
LD_SO_PRELOAD = "/etc/ld.so.preload"
POLICY_FIELD = "allocation.sharing_policy"


class PlanError(ValueError):
    """An allocation that cannot be served; ``fields`` maps each field path to why."""

    def __init__(self, fields: Mapping[str, str], *, code: str = "invalid_allocation") -> None:
        self.fields = dict(fields)
        self.code = code
        super().__init__("; ".join(f"{path}: {why}" for path, why in self.fields.items()))


@dataclass(frozen=True)
class Allocation:
    device_uuid: str
    profile: str
    slot_start: int
    slot_count: int
    sharing_policy: str
    device_uuids: tuple[str, ...] = ()  # a multi-GPU profile: every GPU, ``device_uuid`` first

    @property
    def devices(self) -> tuple[str, ...]:
        return self.device_uuids or (self.device_uuid,)


@dataclass(frozen=True)
class HostGpuTools:
    """What the host offers for sharing: paths when present, None when absent."""

    vgpu_lib: str | None = None  # libvgpu.so, checked to exist by the caller
    vgpu_preload_file: str | None = None  # a file listing VGPU_LIB_TARGET, for /etc/ld.so.preload
    mps_control: str | None = None  # nvidia-cuda-mps-control
    mps_root: str = "/tmp/suanli-mps"
    vgpu_lib_configured: str = "libvgpu.so"
    mps_control_configured: str = "nvidia-cuda-mps-control"


@dataclass(frozen=True)
class RunningShare:
    """A share already served on a GPU: which GPU, device, policy and slots."""

    session_id: str
    gpu_uuid: str
    device_uuid: str
    sharing_policy: str
    slot_start: int
    slot_count: int


@dataclass(frozen=True)
class Mount:
    source: str
    target: str
    read_only: bool = True


@dataclass(frozen=True)
class GpuPlan:
    gpu_uuid: str | None  # the physical GPU (parent of a MIG device); None for a cpu session
    device_uuid: str | None  # what the workload sees
    profile: str | None
    sharing_policy: str | None
    slot_start: int = 0
    slot_count: int = 0
    env: dict[str, str] = field(default_factory=dict)
    mounts: tuple[Mount, ...] = ()
    memory_limit_mib: int | None = None
    sm_percent: int | None = None
    preload_vgpu: bool = False
    mps_pipe_directory: str | None = None  # set for equal-share: the GPU's MPS daemon
    mps_log_directory: str | None = None
    device_nodes: tuple[str, ...] = ()  # under /dev: what the sandbox's /dev holds (the kernel's check)
    device_uuids: tuple[str, ...] = ()  # a multi-GPU plan: every GPU (``device_uuid`` is the first)

    def to_json(self) -> dict:
        return copy.deepcopy(self.wire)

    @functools.cached_property
    def wire(self) -> dict:
        """The plan as JSON, built once (a heartbeat sends every workload's plan): do not mutate."""
        data = asdict(self)
        data["mounts"] = [asdict(m) for m in self.mounts]
        return data

    @classmethod
    def from_json(cls, data: Mapping) -> GpuPlan:
        values = dict(data)
        values["mounts"] = tuple(Mount(**m) for m in values.get("mounts", ()))
        values["device_nodes"] = tuple(values.get("device_nodes", ()))
        values["device_uuids"] = tuple(values.get("device_uuids", ()))
        return cls(**values)

    def shares(self, session_id: str) -> list[RunningShare]:
        """What the plan holds, one share per GPU (a multi-GPU plan: every slot of each)."""
        if self.gpu_uuid is None or self.device_uuid is None or self.sharing_policy is None:
            return []
        return [
            RunningShare(session_id, uuid, uuid, self.sharing_policy, self.slot_start, self.slot_count)
            for uuid in self.device_uuids
        ] or [
            RunningShare(
                session_id,
                self.gpu_uuid,
                self.device_uuid,
                self.sharing_policy,
                self.slot_start,
                self.slot_count,
            )
        ]


def served_policies(tools: HostGpuTools) -> list[str]:
    """The sharing policies this host can serve, reported in every heartbeat so the portal gives a
    new GPU one of them (fixed-share needs libvgpu.so, equal-share the MPS control binary)."""
    policies = ["exclusive"]
    if tools.vgpu_lib is not None and tools.vgpu_preload_file is not None:
        policies.append("fixed-share")
    if tools.mps_control is not None:
        policies.append("equal-share")
    policies.append("best-effort")
    return policies


def cpu_plan() -> GpuPlan:
    """A session without a GPU: it sees none."""
    return GpuPlan(None, None, None, None, env={"CUDA_VISIBLE_DEVICES": "", "NVIDIA_VISIBLE_DEVICES": "void"})


def _find_device(inventory: Mapping, device_uuid: str) -> tuple[dict, dict | None] | None:
    for gpu in inventory.get("gpus", []):
        if gpu.get("uuid") == device_uuid:
            return gpu, None
        for mig in gpu.get("mig_devices", []):
            if mig.get("uuid") == device_uuid:
                return gpu, mig
    return None


def _mig_slices(profile: str) -> int | None:
    match = MIG_PROFILE_RE.match(profile)
    return int(match["slices"]) if match else None


def gpu_plan(
    allocation: Allocation,
    inventory: Mapping,
    *,
    running: Iterable[RunningShare] = (),
    tools: HostGpuTools = HostGpuTools(),
    session_id: str = "",
) -> GpuPlan:
    """Derive the plan for one allocation, or raise PlanError naming the field and why.

    ``running`` are the shares already served on this host (other sessions); a plan that would mix
    policies on one GPU, or overlap their slots, is refused.
    """
    if GPU_COUNT_RE.match(allocation.profile):
        return _multi_gpu_plan(allocation, inventory, running=running, session_id=session_id)
    gpu, mig, size = _checked_device(allocation, inventory)
    _check_slots(allocation, size)
    _check_running(allocation, gpu["uuid"], running, session_id)
    return _plan(allocation, gpu, mig, tools)


def _multi_gpu_plan(
    a: Allocation, inventory: Mapping, *, running: Iterable[RunningShare], session_id: str
) -> GpuPlan:
    """N whole GPUs of this node, passed through together: every one healthy, not in MIG mode, listed
    once, exclusive and free of other workloads; the workload sees all of them and only them."""
    count = int(GPU_COUNT_RE.match(a.profile)["count"])
    uuids = a.devices
    if len(uuids) != count or len(set(uuids)) != count or uuids[0] != a.device_uuid:
        raise PlanError(
            {"allocation.device_uuids": f"{a.profile} lists {count} distinct GPUs, device_uuid first"}
        )
    if a.sharing_policy != "exclusive":
        raise PlanError({POLICY_FIELD: "whole cards are passed through: use exclusive"})
    gpus = []
    for uuid in uuids:
        found = _find_device(inventory, uuid)
        if found is None or found[1] is not None:
            raise PlanError({"allocation.device_uuids": f"{uuid} is not a GPU of this node"})
        gpu = found[0]
        if gpu.get("health") != "ok" or gpu.get("mig_mode"):
            raise PlanError({"allocation.device_uuids": f"{uuid} is lost or in MIG mode"})
        gpus.append(gpu)
    for uuid in uuids:
        whole = Allocation(uuid, "whole", a.slot_start, a.slot_count, a.sharing_policy)
        _check_slots(whole, SLOTS_PER_GPU)
        _check_running(whole, uuid, running, session_id)
    visible = ",".join(uuids)
    return GpuPlan(
        gpu_uuid=uuids[0],
        device_uuid=uuids[0],
        profile=a.profile,
        sharing_policy=a.sharing_policy,
        slot_start=a.slot_start,
        slot_count=a.slot_count,
        env={"CUDA_VISIBLE_DEVICES": visible, "NVIDIA_VISIBLE_DEVICES": visible},
        device_nodes=tuple(dict.fromkeys(n for gpu in gpus for n in device_nodes(gpu, None))),
        device_uuids=uuids,
    )


def _checked_device(a: Allocation, inventory: Mapping) -> tuple[Mapping, Mapping | None, int]:
    """The allocation's GPU, its MIG device (None for a physical GPU) and the slots its profile
    takes, once the profile and the policy suit that device."""
    errors: dict[str, str] = {}
    if a.sharing_policy not in SHARING_POLICIES:
        errors[POLICY_FIELD] = f"must be one of {', '.join(SHARING_POLICIES)}"
    is_slice = a.profile in SLICE_PROFILES
    mig_slices = _mig_slices(a.profile)
    if not is_slice and mig_slices is None:
        errors["allocation.profile"] = "must be whole, 1/2, 1/4, 1/8 or a MIG profile such as 1g.18gb"
    found = _find_device(inventory, a.device_uuid)
    if found is None:
        errors["allocation.device_uuid"] = "no such GPU or MIG device on this node"
    if errors:
        raise PlanError(errors)
    gpu, mig = found
    if gpu.get("health") != "ok":
        raise PlanError({"allocation.device_uuid": "this GPU is lost (NVML reports it gone)"})
    if mig is not None:
        return gpu, mig, _mig_device_slots(a, mig, is_slice=is_slice, mig_slices=mig_slices)
    return gpu, None, _gpu_slots(a, gpu, mig_slices=mig_slices)


def _mig_device_slots(a: Allocation, mig: Mapping, *, is_slice: bool, mig_slices: int | None) -> int:
    if is_slice:
        raise PlanError(
            {"allocation.profile": f"{a.profile} is a slice profile; a MIG device takes its MIG profile"}
        )
    device_slices = _mig_slices(mig.get("profile") or "")
    if device_slices is not None and mig_slices > device_slices:
        raise PlanError(
            {"allocation.profile": f"{a.profile} is larger than the device ({mig.get('profile')})"}
        )
    if a.profile != mig.get("profile"):
        raise PlanError({"allocation.profile": f"the device is a {mig.get('profile')}, not a {a.profile}"})
    if a.sharing_policy != "exclusive":
        raise PlanError({POLICY_FIELD: "a MIG device is passed through: use exclusive"})
    return SLOTS_PER_GPU


def _gpu_slots(a: Allocation, gpu: Mapping, *, mig_slices: int | None) -> int:
    if mig_slices is not None:
        if gpu.get("mig_mode"):
            raise PlanError(
                {"allocation.device_uuid": "a MIG profile names a MIG device (MIG-…), not its GPU"}
            )
        raise PlanError({"allocation.profile": f"{a.profile} is a MIG profile; this GPU is not in MIG mode"})
    if gpu.get("mig_mode"):
        raise PlanError({"allocation.profile": "this GPU is in MIG mode: allocate one of its MIG devices"})
    if a.profile == "whole" and a.sharing_policy != "exclusive":
        raise PlanError({POLICY_FIELD: "a whole card is passed through: use exclusive"})
    if a.profile != "whole" and a.sharing_policy == "exclusive":
        raise PlanError(
            {POLICY_FIELD: f"a {a.profile} slice is shared: use one of {', '.join(SHARED_POLICIES)}"}
        )
    return SLICE_PROFILES[a.profile]


def _check_slots(a: Allocation, size: int) -> None:
    if a.slot_count != size:
        raise PlanError(
            {"allocation.slot_count": f"profile {a.profile} takes {size} slots, not {a.slot_count}"}
        )
    if not 0 <= a.slot_start < SLOTS_PER_GPU or a.slot_start + a.slot_count > SLOTS_PER_GPU:
        raise PlanError(
            {"allocation.slot_start": f"slots {a.slot_start}..{a.slot_start + a.slot_count} lie outside 0..8"}
        )
    if a.slot_start % size:
        raise PlanError({"allocation.slot_start": f"a slice of {size} slots starts at a multiple of {size}"})


def _check_running(a: Allocation, gpu_uuid: str, running: Iterable[RunningShare], session_id: str) -> None:
    """PlanError ``gpu_busy`` when the GPU serves another policy or the slots overlap another's."""
    for share in running:
        if share.session_id == session_id or share.gpu_uuid != gpu_uuid:
            continue
        if share.sharing_policy != a.sharing_policy:
            raise PlanError(
                {POLICY_FIELD: f"GPU {gpu_uuid} already serves {share.sharing_policy} workloads"},
                code="gpu_busy",
            )
        if share.device_uuid == a.device_uuid and (
            a.slot_start < share.slot_start + share.slot_count
            and share.slot_start < a.slot_start + a.slot_count
        ):
            raise PlanError(
                {"allocation.slot_start": f"slots overlap those of session {share.session_id}"},
                code="gpu_busy",
            )


def _plan(a: Allocation, gpu: Mapping, mig: Mapping | None, tools: HostGpuTools) -> GpuPlan:
    """The plan of a checked allocation under its sharing policy."""
    gpu_uuid = gpu["uuid"]
    device_memory_mib = (mig or gpu).get("memory_total_mib") or 0
    env = {"CUDA_VISIBLE_DEVICES": a.device_uuid, "NVIDIA_VISIBLE_DEVICES": a.device_uuid}
    memory_limit_mib = device_memory_mib * a.slot_count // SLOTS_PER_GPU
    percent = 100 * a.slot_count // SLOTS_PER_GPU
    common = {
        "gpu_uuid": gpu_uuid,
        "device_uuid": a.device_uuid,
        "profile": a.profile,
        "sharing_policy": a.sharing_policy,
        "slot_start": a.slot_start,
        "slot_count": a.slot_count,
        "device_nodes": device_nodes(gpu, mig),
    }
    if a.sharing_policy == "exclusive":
        return GpuPlan(**common, env=env)
    if a.sharing_policy == "fixed-share":
        if tools.vgpu_lib is None or tools.vgpu_preload_file is None:
            raise PlanError(
                {POLICY_FIELD: f"fixed-share needs libvgpu.so, absent at {tools.vgpu_lib_configured}"}
            )
        env |= {"CUDA_DEVICE_MEMORY_LIMIT": f"{memory_limit_mib}m", "CUDA_DEVICE_SM_LIMIT": str(percent)}
        return GpuPlan(
            **common,
            env=env,
            mounts=_vgpu_mounts(tools),
            memory_limit_mib=memory_limit_mib,
            sm_percent=percent,
            preload_vgpu=True,
        )
    if a.sharing_policy == "equal-share":
        return _equal_share_plan(common, env, tools, memory_limit_mib=memory_limit_mib, percent=percent)
    # best-effort: time slicing, a memory cap only; enforced where libvgpu.so is present.
    env |= {"CUDA_DEVICE_MEMORY_LIMIT": f"{memory_limit_mib}m"}
    enforced = tools.vgpu_lib is not None and tools.vgpu_preload_file is not None
    return GpuPlan(
        **common,
        env=env,
        mounts=_vgpu_mounts(tools) if enforced else (),
        memory_limit_mib=memory_limit_mib,
        preload_vgpu=enforced,
    )


def _equal_share_plan(
    common: dict, env: dict[str, str], tools: HostGpuTools, *, memory_limit_mib: int, percent: int
) -> GpuPlan:
    if tools.mps_control is None:
        raise PlanError(
            {POLICY_FIELD: f"equal-share needs NVIDIA MPS ({tools.mps_control_configured} not found)"}
        )
    pipe = f"{tools.mps_root}/{common['gpu_uuid']}/pipe"
    log = f"{tools.mps_root}/{common['gpu_uuid']}/log"
    env |= {
        "CUDA_MPS_PIPE_DIRECTORY": pipe,
        "CUDA_MPS_LOG_DIRECTORY": log,
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(percent),
        # NVIDIA's form is "<ordinal>=<limit>": ordinals as the client enumerates its devices, and
        # CUDA_VISIBLE_DEVICES leaves the workload exactly one, ordinal 0.
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"0={memory_limit_mib}M",
    }
    return GpuPlan(
        **common,
        env=env,
        mounts=(Mount(pipe, pipe, read_only=False),),
        memory_limit_mib=memory_limit_mib,
        sm_percent=percent,
        mps_pipe_directory=pipe,
        mps_log_directory=log,
    )


def enforcement(
    plan: GpuPlan, *, device_isolated: bool, preload_pinned: bool, isolated_by: str = "device-nodes"
) -> dict | None:
    """What the host really enforces of a plan, for the portal's pages: ``{"device", "memory",
    "compute"}``, each ``{"enforced": bool, "by": …}``. ``device_isolated``: the workload can open no
    other GPU's device node (the sandbox's /dev, a container's device request); ``preload_pinned``:
    libvgpu.so is loaded through an ``/etc/ld.so.preload`` the workload cannot change. A multi-GPU plan
    adds ``per_device``: the same report for each of its GPUs, by UUID. None for a workload without a
    GPU."""
    if plan.gpu_uuid is None:
        return None
    mig = (plan.device_uuid or "").startswith("MIG-")
    device = {"enforced": device_isolated, "by": isolated_by if device_isolated else "environment"}
    if mig:
        return {
            "device": device,
            "memory": {"enforced": True, "by": "mig"},
            "compute": {"enforced": True, "by": "mig"},
        }
    if plan.sharing_policy == "exclusive":
        whole = {"enforced": device_isolated, "by": "whole-device" if device_isolated else "environment"}
        report = {"device": device, "memory": whole, "compute": whole}
        if plan.device_uuids:  # one sandbox or container holds every GPU of the plan alike
            report["per_device"] = {uuid: dict(report) for uuid in plan.device_uuids}
        return report
    if plan.sharing_policy == "equal-share":
        return {
            "device": device,
            "memory": {"enforced": True, "by": "mps"},
            "compute": {"enforced": True, "by": "mps"},
        }
    if plan.preload_vgpu:
        capped = {"enforced": preload_pinned, "by": "libvgpu" if preload_pinned else "ld-preload-variable"}
    else:
        capped = {"enforced": False, "by": "no-libvgpu"}
    compute = capped if plan.sharing_policy == "fixed-share" else {"enforced": False, "by": "time-slicing"}
    return {"device": device, "memory": capped, "compute": compute}


CONTROL_NODES = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools")
MIG_CAPABILITIES = "/proc/driver/nvidia/capabilities"


def device_nodes(
    gpu: Mapping, mig: Mapping | None, *, capabilities: str = MIG_CAPABILITIES
) -> tuple[str, ...]:
    """The /dev nodes a workload on this GPU (or MIG device) needs, and no other GPU's: the driver's
    control nodes, ``nvidia<minor>`` of the physical GPU and, for a MIG device, the ``nvidia-caps``
    nodes of its GPU and compute instance (their minors are in the driver's capability files)."""
    minor = gpu.get("minor_number")
    minor = gpu.get("index") if minor is None else minor
    nodes = [*CONTROL_NODES, f"nvidia{minor}"]
    if mig is not None and mig.get("gpu_instance_id") is not None:
        folder = f"{capabilities}/gpu{minor}/mig/gi{mig['gpu_instance_id']}"
        for access in (f"{folder}/access", f"{folder}/ci{mig.get('compute_instance_id') or 0}/access"):
            try:
                with open(access) as text:
                    found = re.search(r"DeviceFileMinor:\s*(\d+)", text.read())
            except OSError:
                continue
            if found:
                nodes.append(f"nvidia-caps/nvidia-cap{found.group(1)}")
    return tuple(nodes)


def _vgpu_mounts(tools: HostGpuTools) -> tuple[Mount, ...]:
    return (Mount(tools.vgpu_lib, VGPU_LIB_TARGET), Mount(tools.vgpu_preload_file, LD_SO_PRELOAD))
