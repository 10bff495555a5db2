"""``POST /api/agent/heartbeat``: node-authenticated, strict about shape, and a refused heartbeat leaves
no trace. The agent's own heartbeat client (agents/heartbeat.py) talks to the real endpoint."""

from __future__ import annotations

import copy
import json
import sys

import pytest
from rest_framework.test import APIClient

from agents.heartbeat import build_heartbeat, post_heartbeat
from agents.home_usage import HomeMeter
from agents.nvml import GpuReader, nvml_source
from billing.models import Meter
from provisioner.models import Device, DeviceSample, HomeUsage, Node, Session
from provisioner.selectors import workload_user
from provisioner.services.nodes import node_enroll
from provisioner.services.sessions import session_launch
from tests.agents.conftest import CI_FLEET
from tests.provisioner.conftest import (
    A100,
    ENV,
    counts,
    gpu,
    heartbeat_body,
    make_node,
    make_user,
    workload_status,
)

pytestmark = pytest.mark.django_db
URL = "/api/agent/heartbeat"


def post(token: str | None, body, *, raw: str | None = None):
    client = APIClient()
    headers = {"HTTP_AUTHORIZATION": f"Bearer {token}"} if token is not None else {}
    data = raw if raw is not None else json.dumps(body)
    return client.post(URL, data, content_type="application/json", **headers)


@pytest.fixture
def enrolled(catalog):
    enrolment = node_enroll(name="node-a", address="http://127.0.0.1:9")
    return enrolment.node, enrolment.token


def test_a_heartbeat_records_inventory_metrics_and_answers_desired_workloads(enrolled):
    node, token = enrolled
    body = heartbeat_body(
        [gpu(0, "GPU-a-0"), gpu(1, "GPU-a-1", "NVIDIA Tesla T4", 15360)],
        metrics=[{"uuid": "GPU-a-0", "gpu_util_percent": 37, "memory_used_mib": 2048, "temperature_c": 45}],
    )
    response = post(token, body)
    assert response.status_code == 200, response.content
    assert response.json() == {
        "desired_workloads": [],
        "heartbeat_interval_seconds": 5,
        "environments": [sys.executable],  # the published interpreters, for the agent to check
    }
    node.refresh_from_db()
    assert node.last_heartbeat_at is not None
    assert (node.agent_version, node.runtime, node.driver_version) == ("0.1.0", "process", "550.54.15")
    devices = {d.uuid: d for d in Device.objects.filter(node=node)}
    assert devices["GPU-a-0"].gpu_model.name == A100
    assert devices["GPU-a-1"].gpu_model.name == "T4"
    assert DeviceSample.objects.get(device=devices["GPU-a-0"]).gpu_util_percent == 37


def test_the_answer_carries_the_spec_of_a_placed_session_and_running_opens_the_meter(enrolled):
    node, token = enrolled
    post(token, heartbeat_body([gpu(0, "GPU-a-0")]))
    user = make_user()
    session = session_launch(
        user=user,
        account=user.account,
        gpu_model=A100,
        profile="whole",
        environment=ENV,
        max_hours=1,
        idle_minutes=30,
        idempotency_key=None,
    ).session
    (spec,) = post(token, heartbeat_body([gpu(0, "GPU-a-0")])).json()["desired_workloads"]
    assert spec["session_id"] == str(session.id)
    assert spec["allocation"] == {
        "device_uuid": "GPU-a-0",
        "profile": "whole",
        "slot_start": 0,
        "slot_count": 8,
        "sharing_policy": "exclusive",
    }
    assert spec["base_url"] == f"/jupyter/{session.id}/"
    assert spec["environment"]["name"] == ENV and spec["token"]
    post(token, heartbeat_body([gpu(0, "GPU-a-0")], [workload_status(session, "running")]))
    session.refresh_from_db()
    assert session.state == "running" and session.upstream == "http://127.0.0.1:45678"
    assert Meter.objects.get(session_ref=str(session.id)).state == "open"


@pytest.mark.parametrize(
    "authorization",
    [None, "", "Bearer", "Bearer wrong-token-0123456789", "Basic bm9kZTpwYXNz", "Token {token}", "Bearer  "],
)
def test_a_wrong_or_missing_token_is_a_401_and_writes_nothing(enrolled, authorization):
    node, token = enrolled
    before = counts()
    client = APIClient()
    headers = {} if authorization is None else {"HTTP_AUTHORIZATION": authorization.format(token=token)}
    response = client.post(URL, heartbeat_body([gpu(0, "GPU-a-0")]), format="json", **headers)
    assert response.status_code == 401, response.content
    assert response.json()["error"]["code"] == "unauthorised"
    assert counts() == before
    assert Node.objects.get(id=node.id).last_heartbeat_at is None


def test_a_user_access_token_is_not_a_node_token(enrolled):
    from portal.services import access_token_create

    _token, raw = access_token_create(user=make_user(), name="x", scopes=["read", "sessions"])
    assert post(raw, heartbeat_body([])).status_code == 401


def _garbage_bodies():
    good = heartbeat_body(
        [
            gpu(
                0,
                "GPU-a-0",
                mig_devices=[{"uuid": "MIG-a-0-0", "profile": "1g.10gb", "memory_total_mib": 9728}],
            )
        ],
        metrics=[{"uuid": "GPU-a-0", "gpu_util_percent": 1}],
    )

    def mutate(path: str, value):
        body = copy.deepcopy(good)
        *parents, last = path.split(".")
        target = body
        for key in parents:
            target = target[int(key)] if key.isdigit() else target[key]
        if value is KeyError:
            del target[last]
        else:
            target[int(last) if last.isdigit() else last] = value
        return body

    return [
        ("not an object", [1, 2, 3]),
        ("a string", "heartbeat"),
        ("no inventory", mutate("inventory", KeyError)),
        ("gpus not a list", mutate("inventory.gpus", {"0": {}})),
        ("gpu not an object", mutate("inventory.gpus.0", "GPU-a-0")),
        ("empty uuid", mutate("inventory.gpus.0.uuid", "")),
        ("uuid too long", mutate("inventory.gpus.0.uuid", "G" * 101)),
        ("index a string", mutate("inventory.gpus.0.index", "0")),
        ("index negative", mutate("inventory.gpus.0.index", -1)),
        ("index huge", mutate("inventory.gpus.0.index", 10**9)),
        ("memory a float", mutate("inventory.gpus.0.memory_total_mib", 81920.5)),
        ("memory huge", mutate("inventory.gpus.0.memory_total_mib", 10**12)),
        ("health unknown", mutate("inventory.gpus.0.health", "melting")),
        ("mig_mode a string", mutate("inventory.gpus.0.mig_mode", "yes")),
        ("mig without profile", mutate("inventory.gpus.0.mig_devices.0.profile", None)),
        ("mig uuid twice", mutate("inventory.gpus.0.mig_devices.0.uuid", "GPU-a-0")),
        ("metrics not an object", mutate("metrics", [])),
        ("metric a string", mutate("metrics.gpus.0.gpu_util_percent", "high")),
        ("metric a boolean", mutate("metrics.gpus.0.gpu_util_percent", True)),
        ("workloads not a list", mutate("workloads", {})),
        ("workload without id", mutate("workloads", [{"state": "running"}])),
        ("workload state unknown", mutate("workloads", [{"session_id": "abc", "state": "dancing"}])),
        (
            "workload upstream a number",
            mutate("workloads", [{"session_id": "a", "state": "running", "upstream": 5}]),
        ),
        ("agent_version a number", mutate("agent_version", 1)),
    ]


@pytest.mark.parametrize(("what", "body"), _garbage_bodies(), ids=[w for w, _b in _garbage_bodies()])
def test_garbage_is_a_400_with_the_error_body_and_writes_nothing(enrolled, what, body):
    node, token = enrolled
    before = counts()
    response = post(token, body)
    assert response.status_code == 400, (what, response.content)
    error = response.json()["error"]
    assert error["code"] == "invalid" and error["message"] and error["fields"], error
    assert counts() == before
    assert Node.objects.get(id=node.id).last_heartbeat_at is None


def test_a_body_that_is_not_json_is_a_400(enrolled):
    _node, token = enrolled
    before = counts()
    for raw in ("{not json", "", '{"inventory": NaN}'):
        response = post(token, None, raw=raw)
        assert response.status_code == 400, (raw, response.content)
        assert response.json()["error"]["message"]
    assert counts() == before


def test_out_of_range_figures_are_clamped_not_a_500(enrolled):
    _node, token = enrolled
    body = heartbeat_body(
        [gpu(0, "GPU-a-0")],
        metrics=[
            {"uuid": "GPU-a-0", "gpu_util_percent": 10**12, "temperature_c": -(10**9), "power_w": 1e300}
        ],
    )
    assert post(token, body).status_code == 200
    sample = DeviceSample.objects.get()
    assert (sample.gpu_util_percent, sample.temperature_c) == (32767, -32768)


def test_a_device_that_moved_to_another_node_is_a_409_and_writes_nothing(catalog):
    node_a, _token_a = make_node("node-a", [gpu(0, "GPU-shared-0")])
    node_b, token_b = make_node("node-b", [gpu(0, "GPU-b-0")])
    seen_a = Node.objects.get(id=node_a.id).last_heartbeat_at
    seen_b = Node.objects.get(id=node_b.id).last_heartbeat_at
    before = counts()
    response = post(token_b, heartbeat_body([gpu(0, "GPU-b-0"), gpu(1, "GPU-shared-0")]))
    assert response.status_code == 409, response.content
    error = response.json()["error"]
    assert error["code"] == "device_moved" and "node-a" in error["message"]
    assert counts() == before
    assert Device.objects.get(uuid="GPU-shared-0").node_id == node_a.id
    assert Node.objects.get(id=node_a.id).last_heartbeat_at == seen_a
    assert Node.objects.get(id=node_b.id).last_heartbeat_at == seen_b


def test_a_gpu_missing_from_the_inventory_is_marked_missing_and_not_placed_on(catalog):
    node, token = make_node("node-a", [gpu(0, "GPU-a-0"), gpu(1, "GPU-a-1")])
    post(token, heartbeat_body([gpu(0, "GPU-a-0")]))
    assert Device.objects.get(uuid="GPU-a-1").health == "missing"
    post(token, heartbeat_body([gpu(0, "GPU-a-0"), gpu(1, "GPU-a-1", health="lost")]))
    assert Device.objects.get(uuid="GPU-a-1").health == "lost"


def test_samples_are_a_short_history_not_a_growing_table(catalog, settings):
    settings.DEVICE_SAMPLES_KEPT = 3
    _node, token = make_node("node-a", [gpu(0, "GPU-a-0")])
    for util in range(6):
        post(
            token,
            heartbeat_body([gpu(0, "GPU-a-0")], metrics=[{"uuid": "GPU-a-0", "gpu_util_percent": util}]),
        )
    assert sorted(DeviceSample.objects.values_list("gpu_util_percent", flat=True)) == [3, 4, 5]


def test_a_node_that_was_down_comes_back_to_the_state_it_had(catalog):
    node, token = make_node("node-a")
    Node.objects.filter(id=node.id).update(state="down", state_before_down="cordoned")
    post(token, heartbeat_body([gpu(0, "GPU-node-a-0")]))
    assert Node.objects.get(id=node.id).state == "cordoned"


def test_workloads_of_other_nodes_or_unknown_ids_are_ignored(catalog):
    node_a, _ = make_node("node-a", [gpu(0, "GPU-a-0")])
    _node_b, token_b = make_node("node-b", [gpu(0, "GPU-b-0", "NVIDIA Tesla T4", 15360)])
    user = make_user()
    session = session_launch(
        user=user,
        account=user.account,
        gpu_model=A100,
        profile="whole",
        environment=ENV,
        max_hours=1,
        idle_minutes=30,
        idempotency_key=None,
    ).session
    assert session.node_id == node_a.id
    statuses = [workload_status(session, "running"), {"session_id": "not-a-uuid", "state": "running"}]
    assert (
        post(token_b, heartbeat_body([gpu(0, "GPU-b-0", "NVIDIA Tesla T4", 15360)], statuses)).status_code
        == 200
    )
    assert Session.objects.get(id=session.id).state == "placing"


@pytest.mark.slow
def test_the_agents_own_heartbeat_client_is_understood(live_server, catalog):
    """agents/heartbeat.py builds the body from a fake NVML fleet and POSTs it where the portal listens."""
    enrolment = node_enroll(name="ci-small", address="http://127.0.0.1:9")
    reader = GpuReader(nvml_source("fake", fleet_path=str(CI_FLEET)).open())
    body = build_heartbeat(
        listen_url="http://127.0.0.1:9", runtime="process", reader=reader, workloads=[], pids_by_session={}
    )
    answer = post_heartbeat(live_server.url, enrolment.token, body)
    assert answer["desired_workloads"] == []
    devices = Device.objects.filter(node=enrolment.node)
    assert devices.filter(kind="physical").count() == 2
    assert devices.filter(kind="mig").count() == 5
    assert set(devices.values_list("gpu_model__name", flat=True)) == {A100}
    assert DeviceSample.objects.filter(device__node=enrolment.node).exists()


@pytest.mark.slow
def test_a_quarter_a100_on_a_fresh_node_is_a_spec_its_agent_can_serve(live_server, catalog, tmp_path):
    """Issue 13: a freshly enrolled ci-small node without libvgpu.so or MPS refused a 1/4 A100 with
    invalid_allocation, because its GPUs took the model default (fixed-share). The agent now reports
    the policies it serves; a new GPU gets one of them, so the spec the portal sends is one the agent's
    own planner accepts."""
    from agents.cli import host_gpu_tools
    from agents.gpuplan import Allocation as PlanAllocation
    from agents.gpuplan import gpu_plan

    enrolment = node_enroll(name="ci-small", address="http://127.0.0.1:9")
    reader = GpuReader(nvml_source("fake", fleet_path=str(CI_FLEET)).open())
    tools = host_gpu_tools(tmp_path, vgpu_lib=str(tmp_path / "absent.so"), mps_control="absent-mps-control")

    def beat():
        body = build_heartbeat(
            listen_url="http://127.0.0.1:9",
            runtime="process",
            reader=reader,
            workloads=[],
            pids_by_session={},
            tools=tools,
        )
        return post_heartbeat(live_server.url, enrolment.token, body)

    beat()
    user = make_user()
    session = session_launch(
        user=user,
        account=user.account,
        gpu_model=A100,
        profile="1/4",
        environment=ENV,
        max_hours=1,
        idle_minutes=None,
        idempotency_key=None,
    ).session
    [spec] = [w for w in beat()["desired_workloads"] if w["session_id"] == str(session.id)]
    assert spec["allocation"]["profile"] == "1/4"
    plan = gpu_plan(PlanAllocation(**spec["allocation"]), reader.inventory(), tools=tools)  # no PlanError
    assert plan.sharing_policy == "best-effort" and plan.slot_count == 2


@pytest.mark.slow
def test_a_refused_heartbeat_names_the_status_and_the_portals_reason(live_server, catalog):
    """The agent's error says why: the portal's 409 for a device enrolled on another node."""
    from agents.heartbeat import PortalError

    first = node_enroll(name="ci-small", address="http://127.0.0.1:9")
    second = node_enroll(name="ci-small-2", address="http://127.0.0.1:10")
    reader = GpuReader(nvml_source("fake", fleet_path=str(CI_FLEET)).open())
    body = build_heartbeat(
        listen_url="http://127.0.0.1:9", runtime="process", reader=reader, workloads=[], pids_by_session={}
    )
    post_heartbeat(live_server.url, first.token, body)
    with pytest.raises(PortalError) as refused:
        post_heartbeat(live_server.url, second.token, body)
    message = str(refused.value)
    assert "409" in message and "belongs to node ci-small" in message, message


@pytest.mark.parametrize(
    "reported, stored",
    [
        (
            {
                "device": {"enforced": True, "by": "device-nodes"},
                "memory": {"enforced": True, "by": "libvgpu"},
                "compute": {"enforced": True, "by": "libvgpu"},
            },
            {
                "device": {"enforced": True, "by": "device-nodes"},
                "memory": {"enforced": True, "by": "libvgpu"},
                "compute": {"enforced": True, "by": "libvgpu"},
            },
        ),
        ({"device": {"enforced": "yes", "by": "device-nodes"}}, {}),  # garbage is not a claim
        ({"device": {"enforced": True, "by": "magic"}, "memory": {}, "compute": {}}, {}),
        ("everything", {}),
    ],
)
def test_what_the_agent_reports_enforced_is_kept_and_garbage_is_not(enrolled, reported, stored):
    node, token = enrolled
    post(token, heartbeat_body([gpu(0, "GPU-a-0")]))
    user = make_user()
    session = session_launch(
        user=user, account=user.account, gpu_model=A100, profile="whole", environment=ENV, max_hours=1,
        idle_minutes=30, idempotency_key=None,
    ).session  # fmt: skip
    post(token, heartbeat_body([gpu(0, "GPU-a-0")]))
    answer = post(
        token, heartbeat_body([gpu(0, "GPU-a-0")], [workload_status(session, enforcement=reported)])
    )
    assert answer.status_code == 200
    session.refresh_from_db()
    assert session.state == "running" and session.enforcement == stored


def test_topology_groups_are_stored_garbage_is_blank_and_a_2x_spec_lists_one_groups_gpus(enrolled):
    node, token = enrolled
    gpus = [
        gpu(0, "GPU-a-0", topology_group="topo-0"),
        gpu(1, "GPU-a-1", topology_group={"not": "a name"}),  # garbage: as if unknown, never a 500
        gpu(2, "GPU-a-2", topology_group="topo-2"),
        gpu(3, "GPU-a-3", topology_group="topo-2"),
    ]
    assert post(token, heartbeat_body(gpus)).status_code == 200
    stored = dict(Device.objects.filter(node=node).values_list("uuid", "topology_group"))
    assert stored == {"GPU-a-0": "topo-0", "GPU-a-1": "", "GPU-a-2": "topo-2", "GPU-a-3": "topo-2"}
    user = make_user()
    session = session_launch(
        user=user, account=user.account, gpu_model=A100, profile="2x", environment=ENV, max_hours=1,
        idle_minutes=30, idempotency_key=None,
    ).session  # fmt: skip
    (spec,) = post(token, heartbeat_body(gpus)).json()["desired_workloads"]
    assert spec["allocation"]["profile"] == "2x"
    assert spec["allocation"]["device_uuids"] == ["GPU-a-2", "GPU-a-3"]
    assert spec["allocation"]["device_uuid"] == "GPU-a-2"
    whole = {"enforced": True, "by": "whole-device"}
    report = {"device": {"enforced": True, "by": "device-nodes"}, "memory": whole, "compute": whole}
    per_device = {"GPU-a-2": report, "GPU-a-3": report}
    post(
        token,
        heartbeat_body(gpus, [workload_status(session, enforcement={**report, "per_device": per_device})]),
    )
    session.refresh_from_db()
    assert session.enforcement == {**report, "per_device": per_device}
    post(token, heartbeat_body(gpus, [workload_status(session, enforcement={**report, "per_device": [1]})]))
    session.refresh_from_db()
    assert session.enforcement == report  # a garbled per-device report is dropped, the rest kept


def _home(user, *, bytes_=1000, files=3, at="2026-12-05T10:00:00Z") -> dict:
    return {"user": workload_user(user), "bytes": bytes_, "files": files, "measured_at": at}


def test_measured_homes_are_stored_per_user_and_the_newest_measurement_wins(catalog):
    node_a, token_a = make_node("node-a", [gpu(0, "GPU-a-0")])
    node_b, token_b = make_node("node-b", [gpu(0, "GPU-b-0")])
    alice, bob = make_user("alice"), make_user("bob")
    body = heartbeat_body([gpu(0, "GPU-a-0")])
    body["homes"] = [_home(alice, bytes_=5 << 30, files=1200), _home(bob)]
    assert post(token_a, body).status_code == 200
    usage = HomeUsage.objects.get(user=alice)
    assert (usage.bytes, usage.files, usage.node) == (5 << 30, 1200, node_a)
    # a shared root: node-b measured alice's home later, then node-a's older figure arrives late
    newer = heartbeat_body([gpu(0, "GPU-b-0")])
    newer["homes"] = [_home(alice, bytes_=7 << 30, files=1300, at="2026-12-05T10:05:00Z")]
    assert post(token_b, newer).status_code == 200
    older = heartbeat_body([gpu(0, "GPU-a-0")])
    older["homes"] = [_home(alice, bytes_=1, files=1, at="2026-12-05T10:01:00Z")]
    assert post(token_a, older).status_code == 200
    usage.refresh_from_db()
    assert (usage.bytes, usage.files, usage.node) == (7 << 30, 1300, node_b)
    assert HomeUsage.objects.get(user=bob).files == 3


@pytest.mark.parametrize(
    "garbage",
    [
        "not a list",
        {"user": "x"},
        ["a string"],
        {"user": None, "bytes": 1, "files": 1, "measured_at": "2026-12-05T10:00:00Z"},
        {"user": "../etc-1", "bytes": 1, "files": 1, "measured_at": "2026-12-05T10:00:00Z"},
        {"user": "nobody-999999", "bytes": 1, "files": 1, "measured_at": "2026-12-05T10:00:00Z"},
        {"user": "ALICE", "bytes": 1, "files": 1, "measured_at": "2026-12-05T10:00:00Z"},
        {"user": "USER", "bytes": -1, "files": 1, "measured_at": "2026-12-05T10:00:00Z"},
        {"user": "USER", "bytes": 1.5, "files": 1, "measured_at": "2026-12-05T10:00:00Z"},
        {"user": "USER", "bytes": True, "files": 1, "measured_at": "2026-12-05T10:00:00Z"},
        {"user": "USER", "bytes": 2**64, "files": 1, "measured_at": "2026-12-05T10:00:00Z"},
        {"user": "USER", "bytes": 1, "files": "7", "measured_at": "2026-12-05T10:00:00Z"},
        {"user": "USER", "bytes": 1, "files": 1, "measured_at": "yesterday"},
        {"user": "USER", "bytes": 1, "files": 1, "measured_at": "2026-02-30T10:00:00Z"},
        {"user": "USER", "bytes": 1, "files": 1},
    ],
)
def test_a_garbage_home_entry_is_dropped_and_the_heartbeat_recorded(enrolled, garbage):
    node, token = enrolled
    alice, other = make_user("alice"), make_user("other")
    if isinstance(garbage, dict) and garbage.get("user") == "USER":
        garbage = {**garbage, "user": workload_user(alice)}
    if isinstance(garbage, dict) and garbage.get("user") == "ALICE":  # another user's id under a name
        garbage = {**garbage, "user": f"alice-{other.pk}"}
    body = heartbeat_body([gpu(0, "GPU-a-0")])
    body["homes"] = [garbage, _home(other)] if isinstance(garbage, dict) else garbage
    response = post(token, body)
    assert response.status_code == 200, response.content
    node.refresh_from_db()
    assert node.last_heartbeat_at is not None
    assert not HomeUsage.objects.filter(user=alice).exists()
    if isinstance(garbage, dict) and garbage["user"] == f"alice-{other.pk}":
        assert not HomeUsage.objects.filter(user=other, files=1).exists()
    elif isinstance(garbage, dict):
        assert HomeUsage.objects.get(user=other).files == 3  # the good entry beside it is kept


def test_a_measurement_from_a_clock_ahead_counts_as_now(enrolled):
    node, token = enrolled
    alice = make_user("alice")
    body = heartbeat_body([gpu(0, "GPU-a-0")])
    body["homes"] = [_home(alice, at="2099-01-01T00:00:00Z")]
    post(token, body)
    assert HomeUsage.objects.get(user=alice).measured_at.year < 2099


@pytest.mark.slow
def test_the_agents_homes_reach_the_portal(live_server, catalog, tmp_path):
    token = node_enroll(name="ci-small", address="http://127.0.0.1:9").token
    alice = make_user("alice")
    (tmp_path / workload_user(alice) / "work").mkdir(parents=True)
    (tmp_path / workload_user(alice) / "work" / "a.txt").write_text("hello")
    meter = HomeMeter(tmp_path, shared=False)
    meter.step()
    reader = GpuReader(nvml_source("fake", fleet_path=str(CI_FLEET)).open())
    body = build_heartbeat(
        listen_url="http://x", runtime="process", reader=reader, workloads=[], pids_by_session={},
        homes=meter.pending(),
    )  # fmt: skip
    post_heartbeat(live_server.url, token, body)
    assert HomeUsage.objects.get(user=alice).files == 2
