"""GPU plans: property tests over every profile and policy, and the refusals."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agents.gpuplan import (
    LD_SO_PRELOAD,
    SHARED_POLICIES,
    SLICE_PROFILES,
    VGPU_LIB_TARGET,
    Allocation,
    GpuPlan,
    HostGpuTools,
    PlanError,
    cpu_plan,
    device_nodes,
    enforcement,
    gpu_plan,
)

GPU = "GPU-11111111-1111-1111-1111-111111111111"
MIG_GPU = "GPU-22222222-2222-2222-2222-222222222222"
MIGS = {
    "1g.10gb": "MIG-aaaaaaaa-0000-0000-0000-000000000001",
    "3g.40gb": "MIG-aaaaaaaa-0000-0000-0000-000000000002",
}
TOOLS = HostGpuTools(
    vgpu_lib="/opt/hami/libvgpu.so",
    vgpu_preload_file="/var/lib/agent/vgpu/ld.so.preload",
    mps_control="/usr/bin/nvidia-cuda-mps-control",
    mps_root="/var/lib/agent/mps",
)


def inventory(memory_mib: int = 81920) -> dict:
    return {
        "gpus": [
            {
                "index": 0,
                "uuid": GPU,
                "memory_total_mib": memory_mib,
                "mig_mode": False,
                "health": "ok",
                "mig_devices": [],
            },
            {
                "index": 1,
                "uuid": MIG_GPU,
                "memory_total_mib": 81920,
                "mig_mode": True,
                "health": "ok",
                "mig_devices": [
                    {"uuid": MIGS["1g.10gb"], "profile": "1g.10gb", "memory_total_mib": 9728},
                    {"uuid": MIGS["3g.40gb"], "profile": "3g.40gb", "memory_total_mib": 40192},
                ],
            },
        ]
    }


slices = st.sampled_from(sorted(p for p in SLICE_PROFILES if p != "whole"))


@st.composite
def valid_slice(draw):
    profile = draw(slices)
    size = SLICE_PROFILES[profile]
    start = draw(st.sampled_from(range(0, 8, size)))
    return Allocation(GPU, profile, start, size, draw(st.sampled_from(SHARED_POLICIES)))


@settings(max_examples=300, deadline=None)
@given(valid_slice(), st.integers(min_value=4096, max_value=200_000))
def test_valid_slices_get_limits_matching_their_fraction(allocation, memory_mib):
    plan = gpu_plan(allocation, inventory(memory_mib), tools=TOOLS)
    fraction_mib = memory_mib * allocation.slot_count // 8
    percent = 100 * allocation.slot_count // 8
    assert plan.env["CUDA_VISIBLE_DEVICES"] == plan.env["NVIDIA_VISIBLE_DEVICES"] == GPU
    assert plan.memory_limit_mib == fraction_mib
    assert fraction_mib * 8 <= memory_mib * allocation.slot_count < (fraction_mib + 1) * 8
    if allocation.sharing_policy == "fixed-share":
        assert plan.env["CUDA_DEVICE_MEMORY_LIMIT"] == f"{fraction_mib}m"
        assert plan.env["CUDA_DEVICE_SM_LIMIT"] == str(percent) and plan.sm_percent == percent
        assert {(m.source, m.target) for m in plan.mounts} == {
            (TOOLS.vgpu_lib, VGPU_LIB_TARGET),
            (TOOLS.vgpu_preload_file, LD_SO_PRELOAD),
        }
    elif allocation.sharing_policy == "equal-share":
        assert plan.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == str(percent)
        assert plan.env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"0={fraction_mib}M"
        assert (
            plan.env["CUDA_MPS_PIPE_DIRECTORY"] == f"/var/lib/agent/mps/{GPU}/pipe" == plan.mps_pipe_directory
        )
        assert plan.env["CUDA_MPS_LOG_DIRECTORY"] == f"/var/lib/agent/mps/{GPU}/log"
        assert "CUDA_DEVICE_SM_LIMIT" not in plan.env
    else:
        assert plan.env["CUDA_DEVICE_MEMORY_LIMIT"] == f"{fraction_mib}m"
        assert "CUDA_DEVICE_SM_LIMIT" not in plan.env and plan.sm_percent is None
    assert GpuPlan.from_json(plan.to_json()) == plan


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from(sorted(SLICE_PROFILES)),
    st.integers(min_value=-2, max_value=10),
    st.integers(min_value=-1, max_value=10),
    st.sampled_from(SHARED_POLICIES + ("exclusive",)),
)
def test_invalid_slot_ranges_are_refused(profile, start, count, policy):
    size = SLICE_PROFILES[profile]
    valid_policy = policy == "exclusive" if profile == "whole" else policy != "exclusive"
    valid = count == size and start >= 0 and start + count <= 8 and start % size == 0 and valid_policy
    allocation = Allocation(GPU, profile, start, count, policy)
    if valid:
        assert gpu_plan(allocation, inventory(), tools=TOOLS).slot_start == start
    else:
        with pytest.raises(PlanError) as caught:
            gpu_plan(allocation, inventory(), tools=TOOLS)
        assert set(caught.value.fields) <= {
            "allocation.slot_start",
            "allocation.slot_count",
            "allocation.sharing_policy",
        }


@settings(max_examples=200, deadline=None)
@given(valid_slice(), valid_slice())
def test_one_policy_per_gpu_and_no_shared_slot(first, second):
    served = gpu_plan(first, inventory(), tools=TOOLS, session_id="a").shares("a")[0]
    overlap = (
        first.slot_start < second.slot_start + second.slot_count
        and second.slot_start < first.slot_start + first.slot_count
    )
    if first.sharing_policy != second.sharing_policy or overlap:
        with pytest.raises(PlanError) as caught:
            gpu_plan(second, inventory(), running=[served], tools=TOOLS, session_id="b")
        assert caught.value.code == "gpu_busy"
        field = (
            "allocation.sharing_policy"
            if first.sharing_policy != second.sharing_policy
            else "allocation.slot_start"
        )
        assert field in caught.value.fields
    else:
        gpu_plan(second, inventory(), running=[served], tools=TOOLS, session_id="b")
    # The same session re-planned does not collide with itself.
    gpu_plan(first, inventory(), running=[served], tools=TOOLS, session_id="a")


def test_whole_card_and_mig_device_are_passed_through():
    whole = gpu_plan(Allocation(GPU, "whole", 0, 8, "exclusive"), inventory())
    assert whole.env == {"CUDA_VISIBLE_DEVICES": GPU, "NVIDIA_VISIBLE_DEVICES": GPU}
    assert whole.memory_limit_mib is None and whole.mounts == ()
    mig = gpu_plan(Allocation(MIGS["3g.40gb"], "3g.40gb", 0, 8, "exclusive"), inventory())
    assert mig.env["CUDA_VISIBLE_DEVICES"] == MIGS["3g.40gb"] and mig.gpu_uuid == MIG_GPU
    assert cpu_plan().env == {"CUDA_VISIBLE_DEVICES": "", "NVIDIA_VISIBLE_DEVICES": "void"}


@pytest.mark.parametrize(
    ("allocation", "field", "why"),
    [
        (Allocation("GPU-nope", "1/4", 0, 2, "best-effort"), "allocation.device_uuid", "no such"),
        (Allocation(GPU, "1/2", 6, 4, "best-effort"), "allocation.slot_start", "outside"),
        (Allocation(GPU, "1/4", 2, 4, "best-effort"), "allocation.slot_count", "takes 2"),
        (Allocation(GPU, "1/4", 3, 2, "best-effort"), "allocation.slot_start", "multiple of 2"),
        (Allocation(MIGS["1g.10gb"], "3g.40gb", 0, 8, "exclusive"), "allocation.profile", "larger"),
        (Allocation(MIGS["3g.40gb"], "1g.10gb", 0, 8, "exclusive"), "allocation.profile", "not a 1g.10gb"),
        (Allocation(GPU, "1g.10gb", 0, 8, "exclusive"), "allocation.profile", "not in MIG mode"),
        (Allocation(MIG_GPU, "1/4", 0, 2, "best-effort"), "allocation.profile", "MIG mode"),
        (Allocation(MIG_GPU, "1g.10gb", 0, 8, "exclusive"), "allocation.device_uuid", "MIG device"),
        (Allocation(MIGS["1g.10gb"], "1/8", 0, 1, "best-effort"), "allocation.profile", "slice profile"),
        (
            Allocation(MIGS["1g.10gb"], "1g.10gb", 0, 8, "best-effort"),
            "allocation.sharing_policy",
            "exclusive",
        ),
        (Allocation(GPU, "1/4", 0, 2, "exclusive"), "allocation.sharing_policy", "shared"),
        (Allocation(GPU, "1/4", 0, 2, "round-robin"), "allocation.sharing_policy", "one of"),
        (Allocation(GPU, "2/3", 0, 2, "best-effort"), "allocation.profile", "must be"),
    ],
)
def test_refusals_name_the_field(allocation, field, why):
    with pytest.raises(PlanError) as caught:
        gpu_plan(allocation, inventory(), tools=TOOLS)
    assert field in caught.value.fields and why in caught.value.fields[field], caught.value.fields


def test_sharing_tools_absent_are_refused_and_best_effort_is_advisory_without_libvgpu():
    bare = HostGpuTools(vgpu_lib_configured="/opt/hami/libvgpu.so")
    with pytest.raises(PlanError, match="libvgpu.so, absent at /opt/hami/libvgpu.so"):
        gpu_plan(Allocation(GPU, "1/4", 0, 2, "fixed-share"), inventory(), tools=bare)
    with pytest.raises(PlanError, match="nvidia-cuda-mps-control"):
        gpu_plan(Allocation(GPU, "1/4", 0, 2, "equal-share"), inventory(), tools=bare)
    plan = gpu_plan(Allocation(GPU, "1/4", 0, 2, "best-effort"), inventory(), tools=bare)
    assert plan.preload_vgpu is False and plan.env["CUDA_DEVICE_MEMORY_LIMIT"] == "20480m"


def test_a_lost_gpu_takes_no_workload():
    lost = inventory()
    lost["gpus"][0]["health"] = "lost"
    with pytest.raises(PlanError, match="lost"):
        gpu_plan(Allocation(GPU, "whole", 0, 8, "exclusive"), lost)


def _claims(plan, **host) -> dict[str, tuple[bool, str]]:
    return {k: (v["enforced"], v["by"]) for k, v in enforcement(plan, **host).items()}


def test_enforcement_claims_only_what_the_host_holds():
    sandboxed = {"device_isolated": True, "preload_pinned": True}
    whole = gpu_plan(Allocation(GPU, "whole", 0, 8, "exclusive"), inventory())
    assert _claims(whole, **sandboxed) == {
        "device": (True, "device-nodes"), "memory": (True, "whole-device"), "compute": (True, "whole-device")
    }  # fmt: skip
    assert _claims(whole, device_isolated=False, preload_pinned=False)["device"] == (False, "environment")
    fixed = gpu_plan(Allocation(GPU, "1/4", 0, 2, "fixed-share"), inventory(), tools=TOOLS)
    assert _claims(fixed, **sandboxed)["memory"] == (True, "libvgpu")
    # libvgpu.so by LD_PRELOAD alone (no sandbox): the tenant can unset it, so it is advisory.
    assert _claims(fixed, device_isolated=False, preload_pinned=False)["memory"] == (
        False,
        "ld-preload-variable",
    )
    bare = gpu_plan(Allocation(GPU, "1/4", 0, 2, "best-effort"), inventory(), tools=HostGpuTools())
    assert _claims(bare, **sandboxed) == {
        "device": (True, "device-nodes"), "memory": (False, "no-libvgpu"), "compute": (False, "time-slicing")
    }  # fmt: skip
    mig = gpu_plan(Allocation(MIGS["3g.40gb"], "3g.40gb", 0, 8, "exclusive"), inventory())
    assert _claims(mig, **sandboxed)["memory"] == (True, "mig")
    mps = gpu_plan(Allocation(GPU, "1/2", 0, 4, "equal-share"), inventory(), tools=TOOLS)
    assert _claims(mps, **sandboxed)["compute"] == (True, "mps")
    assert enforcement(cpu_plan(), **sandboxed) is None


def test_device_nodes_name_the_gpu_its_minor_and_a_mig_devices_capabilities(tmp_path):
    gpu = {"index": 1, "minor_number": 3}
    assert device_nodes(gpu, None) == ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia3")
    caps = tmp_path / "capabilities" / "gpu3" / "mig" / "gi2"
    (caps / "ci0").mkdir(parents=True)
    (caps / "access").write_text("DeviceFileMinor: 21\nDeviceFileMode: 292\n")
    (caps / "ci0" / "access").write_text("DeviceFileMinor: 22\n")
    mig = {"gpu_instance_id": 2, "compute_instance_id": 0}
    assert device_nodes(gpu, mig, capabilities=str(tmp_path / "capabilities"))[-2:] == (
        "nvidia-caps/nvidia-cap21",
        "nvidia-caps/nvidia-cap22",
    )


# --- multi-GPU plans: N whole GPUs of the node ---------------------------------------------------------


def _board(gpus: int = 4) -> dict:
    """A node of ``gpus`` plain GPUs, as the reader reports them."""
    return {
        "gpus": [
            {
                "index": i,
                "uuid": f"GPU-{i:08d}-0000",
                "memory_total_mib": 81920,
                "mig_mode": False,
                "health": "ok",
            }
            for i in range(gpus)
        ]
    }


def _multi(profile: str, uuids: list[str]) -> Allocation:
    return Allocation(uuids[0], profile, 0, 8, "exclusive", tuple(uuids))


def test_a_multi_gpu_plan_sees_every_gpu_and_only_them():
    uuids = [f"GPU-{i:08d}-0000" for i in (1, 2)]
    plan = gpu_plan(_multi("2x", uuids), _board(), tools=TOOLS, session_id="s")
    assert plan.env["CUDA_VISIBLE_DEVICES"] == plan.env["NVIDIA_VISIBLE_DEVICES"] == ",".join(uuids)
    assert [n for n in plan.device_nodes if n.startswith("nvidia") and n[6:].isdigit()] == [
        "nvidia1",
        "nvidia2",
    ]
    assert [s.gpu_uuid for s in plan.shares("s")] == uuids
    report = enforcement(plan, device_isolated=True, preload_pinned=False)
    assert set(report["per_device"]) == set(uuids)
    assert report["per_device"][uuids[1]]["device"] == {"enforced": True, "by": "device-nodes"}
    assert GpuPlan.from_json(plan.to_json()) == plan


@pytest.mark.parametrize(
    ("allocation", "field"),
    [
        (_multi("2x", ["GPU-00000001-0000"]), "allocation.device_uuids"),  # one GPU short
        (_multi("2x", ["GPU-00000001-0000", "GPU-00000001-0000"]), "allocation.device_uuids"),  # twice
        (_multi("2x", ["GPU-00000001-0000", "GPU-99999999-0000"]), "allocation.device_uuids"),  # not here
        (
            Allocation(
                "GPU-00000000-0000", "2x", 0, 8, "fixed-share", ("GPU-00000000-0000", "GPU-00000001-0000")
            ),
            "allocation.sharing_policy",
        ),
    ],
)
def test_a_multi_gpu_plan_refuses_a_wrong_list_or_policy(allocation, field):
    with pytest.raises(PlanError) as refused:
        gpu_plan(allocation, _board(), tools=TOOLS)
    assert field in refused.value.fields


def test_a_multi_gpu_plan_refuses_a_gpu_another_workload_holds():
    board = _board()
    slice_of_one = Allocation("GPU-00000001-0000", "1/8", 0, 1, "best-effort")
    held = gpu_plan(slice_of_one, board, tools=TOOLS, session_id="other").shares("other")
    with pytest.raises(PlanError) as refused:
        gpu_plan(
            _multi("2x", ["GPU-00000000-0000", "GPU-00000001-0000"]), board, running=held, session_id="s"
        )
    assert refused.value.code == "gpu_busy"
    gpu_plan(_multi("2x", ["GPU-00000002-0000", "GPU-00000003-0000"]), board, running=held, session_id="s")
