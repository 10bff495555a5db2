"""The sessions, catalog, quota and admin API: every endpoint, and every bad input a clear 4xx that
leaves nothing allocated and nothing half-written."""

from __future__ import annotations

import logging
import uuid

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from rest_framework.test import APIClient

from billing.models import AuditEntry, LedgerHold
from billing.services.ledger import overdraft_for, system_account, transfer_post, wallet_for
from portal.services import access_token_create, team_create
from provisioner.models import Allocation, HomeUsage, Node, Quota, Session
from provisioner.quotas import quota_set
from provisioner.sealing import unseal
from provisioner.services.sessions import session_launch
from tests.provisioner.conftest import (
    A100,
    ENV,
    beat,
    client_for,
    counts,
    gpu,
    make_node,
    make_user,
    workload_status,
)

pytestmark = pytest.mark.django_db


@pytest.fixture
def fleet(catalog):
    """One node: an A100 for slices (best effort), a second A100, a T4 and an H200 in MIG."""
    node, token = make_node(
        "node-a",
        [
            gpu(0, "GPU-a-0"),
            gpu(1, "GPU-a-1"),
            gpu(2, "GPU-a-2", "NVIDIA Tesla T4", 15360),
            gpu(
                3,
                "GPU-a-3",
                "NVIDIA H200",
                143771,
                mig_devices=[
                    {"uuid": f"MIG-a-3-{i}", "profile": "1g.18gb", "memory_total_mib": 16384}
                    for i in range(7)
                ],
            ),
        ],
        sharing_policy="best-effort",
    )
    return node


def launch(client: APIClient, key: str | None = None, **fields):
    body = {"gpu_model": A100, "profile": "whole", "environment": ENV, **fields}
    headers = {"HTTP_IDEMPOTENCY_KEY": key} if key else {}
    return client.post("/api/v1/sessions", body, format="json", **headers)


def assert_error(response, status: int, field: str | None = None, code: str | None = None) -> dict:
    assert response.status_code == status, response.content
    error = response.json()["error"]
    assert error["message"]
    if field is not None:
        assert field in error["fields"], error
    if code is not None:
        assert error["code"].startswith(code), error
    return error


# --- catalog -----------------------------------------------------------------------------------------


def test_catalog_lists_models_profiles_prices_and_what_fits_now(fleet):
    body = client_for(make_user()).get("/api/v1/catalog").json()
    models = {m["name"]: m for m in body["gpu_models"]}
    assert set(models) == {A100, "T4", "H200"}
    a100 = {p["profile"]: p for p in models[A100]["profiles"]}
    assert a100["whole"]["available"] == 2
    assert a100["1/8"]["available"] == 16
    assert a100["whole"]["price"]["price_micros_per_hour"] == 12_000_000
    assert a100["1/2"]["price"]["price_micros_per_hour"] == 6_000_000
    h200 = {p["profile"]: p for p in models["H200"]["profiles"]}
    assert h200["1g.18gb"]["available"] == 7
    assert h200["whole"]["available"] == 0  # its only card is laid out in MIG
    assert body["cpu"]["price"]["price_micros_per_hour"] == 360_000
    assert [e["name"] for e in body["environments"]] == [ENV]
    assert body["currency"]


def test_the_catalog_offers_a_gpu_count_only_where_a_node_has_that_many(fleet):
    a100 = {
        p["profile"]: p
        for m in client_for(make_user()).get("/api/v1/catalog").json()["gpu_models"]
        if m["name"] == A100
        for p in m["profiles"]
    }
    assert "4x" not in a100  # the model lists it, but node-a has two A100s
    assert a100["2x"]["gpu_count"] == 2 and a100["2x"]["available"] == 1
    assert a100["2x"]["price"]["price_micros_per_hour"] == 2 * a100["whole"]["price"]["price_micros_per_hour"]
    assert (
        a100["2x"]["price"]["card_burn_micros_per_hour"]
        == 2 * a100["whole"]["price"]["card_burn_micros_per_hour"]
    )


def test_a_2x_launch_holds_both_gpus_lists_them_and_counts_16_eighths(fleet, sent_tasks):
    user = make_user()
    client = client_for(user)
    response = launch(client, profile="2x")
    assert response.status_code == 201, response.content
    body = client.get(f"/api/v1/sessions/{response.json()['id']}").json()
    assert body["profile"] == "2x" and body["price"]["price_micros_per_hour"] == 24_000_000
    assert sorted(d["uuid"] for d in body["limits"]["devices"]) == ["GPU-a-0", "GPU-a-1"]
    assert client.get("/api/v1/quota").json()["user"]["usage"]["eighths"] == 16
    assert_error(launch(client, profile="4x"), 400, "profile")  # no node has four


def test_the_api_needs_a_login():
    for path in ("/api/v1/catalog", "/api/v1/sessions", "/api/v1/quota", f"/api/v1/sessions/{uuid.uuid4()}"):
        response = APIClient().get(path)
        assert response.status_code in (401, 403)
        assert response.json()["error"]["code"]


# --- launch ------------------------------------------------------------------------------------------


def test_launch_places_a_whole_card_and_shows_its_limits(
    fleet, sent_tasks, django_capture_on_commit_callbacks
):
    user = make_user()
    with django_capture_on_commit_callbacks(execute=True):
        response = launch(client_for(user), max_hours=2, idle_minutes=30)
    assert response.status_code == 201, response.content
    body = response.json()
    assert body["state"] == "placing"
    assert body["node"] == "node-a"
    assert body["account"]["id"] == user.account_id
    assert body["price"]["price_micros_per_hour"] == 12_000_000
    limits = body["limits"]
    assert limits["device"]["uuid"] in ("GPU-a-0", "GPU-a-1")
    assert (limits["slot_start"], limits["slot_count"], limits["compute_percent"]) == (0, 8, 100)
    assert limits["memory_cap_mib"] == 81920
    assert limits["sharing_policy"] == "exclusive"
    assert (limits["max_seconds"], limits["idle_seconds"]) == (7200, 1800)
    assert body["jupyter_url"] is None and body["queue"] is None and body["cost"] is None
    assert Allocation.objects.filter(session_id=body["id"]).exists()
    assert ("session_start_task", (body["id"],)) in sent_tasks


def test_a_slice_takes_an_aligned_block_of_a_shared_gpu(fleet, sent_tasks):
    client = client_for(make_user())
    first = launch(client, profile="1/4").json()
    second = launch(client, profile="1/4").json()
    assert first["limits"]["sharing_policy"] == "best-effort"
    assert first["limits"]["memory_cap_mib"] == 81920 * 2 // 8
    assert first["limits"]["compute_percent"] == 25
    assert first["limits"]["device"]["uuid"] == second["limits"]["device"]["uuid"]  # binpack
    assert {first["limits"]["slot_start"], second["limits"]["slot_start"]} == {0, 2}


def test_a_mig_profile_goes_to_a_mig_device(fleet, sent_tasks):
    body = launch(client_for(make_user()), gpu_model="H200", profile="1g.18gb").json()
    assert body["limits"]["device"]["uuid"].startswith("MIG-a-3-")
    assert body["limits"]["device"]["kind"] == "mig"
    assert body["limits"]["sharing_policy"] == "exclusive"


def test_a_cpu_session_needs_no_gpu(fleet, sent_tasks):
    body = launch(client_for(make_user()), gpu_model="", profile="cpu").json()
    assert body["state"] == "placing"
    assert body["gpu_model"] is None and body["limits"]["device"] is None
    assert not Allocation.objects.exists()


def test_the_same_idempotency_key_returns_the_same_session(fleet, sent_tasks):
    client = client_for(make_user())
    first = launch(client, key="launch-1")
    assert first.status_code == 201
    before = counts()
    again = launch(client, key="launch-1")
    assert again.status_code == 200
    assert again.json()["id"] == first.json()["id"]
    assert counts() == before
    other = launch(client, key="launch-2")
    assert other.status_code == 201 and other.json()["id"] != first.json()["id"]


def test_a_replay_finds_its_session_with_one_lookup_of_the_key(fleet, sent_tasks):
    client = client_for(make_user())
    first = launch(client, key="launch-1")
    with CaptureQueriesContext(connection) as queries:
        again = launch(client, key="launch-1")
    assert again.status_code == 200 and again.json()["id"] == first.json()["id"]
    lookups = [q["sql"] for q in queries.captured_queries if '"idempotency_key" = ' in q["sql"]]
    assert len(lookups) == 1, lookups


def test_the_launch_throttle_lets_launches_through_and_logs_when_the_cache_is_down(
    fleet, sent_tasks, settings, caplog
):
    settings.SESSION_LAUNCH_RATE = (1, 60)
    settings.CACHES = {
        "default": {
            "BACKEND": "django.core.cache.backends.redis.RedisCache",
            "LOCATION": "redis://127.0.0.1:1/0",  # nothing listens there
            "OPTIONS": {"socket_connect_timeout": 0.5},
        }
    }
    user = make_user()
    with caplog.at_level(logging.WARNING, logger="core.throttle"):
        launched = [
            session_launch(
                user=user, account=user.account, gpu_model=A100, profile="1/8", environment=ENV,
                max_hours=1, idle_minutes=None, idempotency_key=None,
            ).session
            for _ in range(2)
        ]  # fmt: skip
    assert Session.objects.filter(id__in=[s.id for s in launched]).count() == 2
    assert f"throttle skipped: the cache is unreachable (launch:user:{user.pk})" in caplog.text


def test_an_idempotency_key_is_per_user(fleet, sent_tasks):
    mine = launch(client_for(make_user()), key="same").json()
    theirs = launch(client_for(make_user()), key="same").json()
    assert mine["id"] != theirs["id"]


def test_when_nothing_fits_the_session_queues_with_a_position(fleet, sent_tasks):
    for _ in range(2):
        assert launch(client_for(make_user())).json()["state"] == "placing"
    queued = launch(client_for(make_user()))
    assert queued.status_code == 201
    body = queued.json()
    assert body["state"] == "queued"
    assert body["queue"] == {"position": 1, "estimate_seconds": None}
    assert not Allocation.objects.filter(session_id=body["id"]).exists()


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"gpu_model": "V100"}, "gpu_model"),
        ({"profile": "1/3"}, "profile"),
        ({"environment": "R-4.4"}, "environment"),
        ({"gpu_model": "T4", "profile": "1/4"}, "profile"),  # T4 offers whole and 1/2 only
        ({"gpu_model": "H200", "profile": "1/2"}, "profile"),
        ({"profile": None}, "profile"),
        ({"profile": ""}, "profile"),
        ({"profile": ["whole"]}, "profile"),
        ({"max_hours": "many"}, "max_hours"),
        ({"max_hours": -1}, "max_hours"),
        ({"max_hours": 0}, "max_hours"),
        ({"max_hours": 1e308}, "max_hours"),
        ({"idle_minutes": 0}, "idle_minutes"),
        ({"idle_minutes": 1.5}, "idle_minutes"),
        ({"idle_minutes": True}, "idle_minutes"),
        ({"account": "mine"}, "account"),
        ({"environment": "x" * 1000}, "environment"),
    ],
)
def test_bad_launch_input_is_a_400_and_writes_nothing(
    fleet, sent_tasks, django_capture_on_commit_callbacks, fields, field
):
    client = client_for(make_user())
    before = counts()
    with django_capture_on_commit_callbacks(execute=True) as callbacks:
        assert_error(launch(client, **fields), 400, field)
    assert counts() == before
    assert callbacks == [] and sent_tasks == []


def test_a_launch_body_that_is_not_json_is_a_400(fleet):
    client = client_for(make_user())
    before = counts()
    response = client.post("/api/v1/sessions", "{not json", content_type="application/json")
    assert_error(response, 400)
    response = client.post("/api/v1/sessions", [1, 2], format="json")
    assert_error(response, 400)
    assert counts() == before


def test_a_bad_idempotency_key_is_refused(fleet, sent_tasks):
    before = counts()
    assert_error(launch(client_for(make_user()), key="k" * 300), 400, "idempotency_key")
    assert counts() == before


def test_over_quota_is_a_403_and_writes_nothing(fleet, sent_tasks):
    user = make_user()
    quota_set(user=user, limits={"max_sessions": 1})
    client = client_for(user)
    assert launch(client).status_code == 201
    before = counts()
    assert_error(launch(client), 403, code="quota")
    assert counts() == before


@pytest.mark.parametrize(
    ("limits", "fields"),
    [
        ({"max_eighths": 2}, {"profile": "1/2"}),
        ({"allowed_gpu_models": ["T4"]}, {}),
        ({"allowed_profiles": ["1/8"]}, {}),
        ({"max_session_seconds": 3600}, {"max_hours": 2}),
    ],
)
def test_each_quota_limit_refuses_a_launch(fleet, sent_tasks, limits, fields):
    user = make_user()
    quota_set(user=user, limits=limits)
    before = counts()
    assert_error(launch(client_for(user), **fields), 403, code="quota")
    assert counts() == before


def test_too_little_money_is_a_402_and_writes_nothing(fleet, sent_tasks):
    user = make_user(funds=100_000)  # 0.1 of the currency: half a minute of an A100
    before = counts()
    assert_error(launch(client_for(user)), 402, code="insufficient_funds")
    assert counts() == before


def test_an_account_on_a_ledger_hold_is_a_409_and_one_that_owes_is_a_402(fleet, sent_tasks):
    held, owing = make_user(), make_user()
    hold = LedgerHold.objects.create(kind="balance", subject="la:test", account=held.account)
    before = counts()
    assert_error(launch(client_for(held)), 409, code="account_on_hold")
    # a refund after the money was spent: the wallet is emptied, the rest is owed
    wallet = wallet_for(account=owing.account)
    clearing = system_account(kind="payment_clearing")
    transfer_post(
        debit=wallet,
        credit=clearing,
        amount_micros=wallet.balance_micros,
        kind="refund",
        idempotency_key="r1",
    )
    transfer_post(
        debit=overdraft_for(account=owing.account),
        credit=clearing,
        amount_micros=5_000_000,
        kind="refund",
        idempotency_key="r2",
    )
    assert_error(launch(client_for(owing)), 402, code="account_owes")
    assert counts() == before
    hold.resolved_at = hold.found_at
    hold.save()
    assert launch(client_for(held)).status_code == 201


def test_an_account_the_user_may_not_pay_with_is_a_404(fleet, sent_tasks):
    user, stranger = make_user(), make_user()
    team = team_create(creator=stranger, name="Other Lab")
    client = client_for(user)
    before = counts()
    for account_id in (stranger.account_id, team.account_id, 999_999):
        assert_error(launch(client, account=account_id), 404, "account")
    assert counts() == before


def test_a_team_member_may_pay_with_the_team_account(fleet, sent_tasks):
    lead = make_user()
    team = team_create(creator=lead, name="Vision Lab")
    from tests.billing.conftest import fund

    fund(team.account, 50_000_000)
    response = launch(client_for(lead), account=team.account_id)
    assert response.status_code == 201
    assert response.json()["account"] == {"id": team.account_id, "name": team.account.name, "kind": "team"}


# --- reading sessions --------------------------------------------------------------------------------


def test_list_is_paged_newest_first_and_filters_by_state(fleet, sent_tasks):
    client = client_for(make_user())
    ids = [launch(client, profile="1/8").json()["id"] for _ in range(3)]
    Session.objects.filter(id=ids[0]).update(state="stopped")
    page = client.get("/api/v1/sessions?limit=2").json()
    assert page["count"] == 3
    assert [s["id"] for s in page["results"]] == [ids[2], ids[1]]
    assert page["next"]
    placing = client.get("/api/v1/sessions?state=placing").json()
    assert {s["id"] for s in placing["results"]} == {ids[1], ids[2]}
    both = client.get("/api/v1/sessions?state=placing,stopped").json()
    assert both["count"] == 3
    assert_error(client.get("/api/v1/sessions?state=sleeping"), 400, "state")


def test_other_tenants_sessions_are_404_like_missing_ones(fleet, sent_tasks):
    mine = launch(client_for(make_user())).json()["id"]
    other = client_for(make_user())
    for path in ("", "/events", "/metrics"):
        assert_error(other.get(f"/api/v1/sessions/{mine}{path}"), 404, code="not_found")
    before = counts()
    assert_error(other.post(f"/api/v1/sessions/{mine}/stop"), 404)
    assert counts() == before
    assert Session.objects.get(id=mine).state == "placing"
    assert other.get("/api/v1/sessions").json()["count"] == 0
    for missing in (uuid.uuid4(), "not-a-uuid", "1"):
        assert_error(other.get(f"/api/v1/sessions/{missing}"), 404)


def test_a_running_session_shows_its_jupyter_url_and_cost_never_its_token(fleet, sent_tasks):
    user = make_user()
    client = client_for(user)
    sid = launch(client).json()["id"]
    session = Session.objects.get(id=sid)
    beat(fleet, [workload_status(session, "running")])
    body = client.get(f"/api/v1/sessions/{sid}").json()
    assert body["state"] == "running"
    assert body["jupyter_url"] == f"/jupyter/{sid}/lab/tree/Welcome.ipynb"
    assert body["cost"]["total_micros"] >= 0
    assert body["running_at"] and body["last_alive_at"]
    token = unseal(session.jupyter_token_sealed)
    for path in ("", "/events", "/metrics"):
        assert token not in client.get(f"/api/v1/sessions/{sid}{path}").content.decode()
    assert token not in client.get("/api/v1/sessions").content.decode()


def test_events_tell_the_story_of_a_session(fleet, sent_tasks):
    client = client_for(make_user())
    sid = launch(client).json()["id"]
    beat(fleet, [workload_status(Session.objects.get(id=sid), "running")])
    events = client.get(f"/api/v1/sessions/{sid}/events").json()
    assert [e["to_state"] for e in events if e["kind"] == "state"] == ["placing", "running"]
    assert events[0]["kind"] == "launch"
    running = events[-1]
    assert (running["message"], running["message_code"], running["message_params"]) == (
        "Jupyter is running",
        "running",
        {},
    )


def test_metrics_are_the_device_samples_of_the_sessions_life(fleet, sent_tasks):
    client = client_for(make_user())
    sid = launch(client).json()["id"]
    session = Session.objects.get(id=sid)
    assert client.get(f"/api/v1/sessions/{sid}/metrics").json()["samples"] == []
    beat(fleet, [workload_status(session, "running")])
    session.refresh_from_db()
    for util in (10, 60, 90):
        beat(
            fleet,
            [workload_status(session, "running")],
            metrics=[{"uuid": session.device.uuid, "gpu_util_percent": util, "memory_used_mib": 1024}],
        )
    body = client.get(f"/api/v1/sessions/{sid}/metrics").json()
    assert body["device"] == session.device.uuid
    assert [s["gpu_util_percent"] for s in body["samples"]] == [10, 60, 90]


# --- stop --------------------------------------------------------------------------------------------


def test_stop_moves_a_placed_session_to_stopping_and_is_idempotent(
    fleet, sent_tasks, django_capture_on_commit_callbacks
):
    client = client_for(make_user())
    sid = launch(client).json()["id"]
    with django_capture_on_commit_callbacks(execute=True):
        response = client.post(f"/api/v1/sessions/{sid}/stop", {"reason": "done for today"}, format="json")
    assert response.status_code == 200
    assert response.json()["state"] == "stopping"
    body = response.json()
    assert body["reason"].endswith(": done for today")  # the English text, as before
    assert body["reason_code"] == "stop_by" and body["reason_params"]["why"] == "done for today"
    assert ("session_stop_task", (sid,)) in sent_tasks
    again = client.post(f"/api/v1/sessions/{sid}/stop")
    assert again.status_code == 200 and again.json()["state"] == "stopping"
    assert Allocation.objects.filter(session_id=sid).exists()  # freed once the agent confirms it gone
    beat(fleet, [])
    assert client.get(f"/api/v1/sessions/{sid}").json()["state"] == "stopped"
    assert not Allocation.objects.filter(session_id=sid).exists()


def test_stop_with_a_garbage_reason_is_a_400(fleet, sent_tasks):
    client = client_for(make_user())
    sid = launch(client).json()["id"]
    assert_error(
        client.post(f"/api/v1/sessions/{sid}/stop", {"reason": "x" * 500}, format="json"), 400, "reason"
    )
    assert Session.objects.get(id=sid).state == "placing"


# --- quota -------------------------------------------------------------------------------------------


def test_quota_shows_limits_and_usage_for_the_user_and_their_teams(fleet, sent_tasks):
    user = make_user()
    team = team_create(creator=user, name="Course 101")
    quota_set(account=team.account, limits={"max_eighths": 16})
    quota_set(user=user, account=team.account, limits={"max_eighths": 2})
    client = client_for(user)
    launch(client, profile="1/2")
    body = client.get("/api/v1/quota").json()
    assert body["user"]["usage"] == {"sessions": 1, "eighths": 4, "spend_micros": 0}
    assert body["user"]["limits"]["max_sessions"] == 4
    (course,) = body["teams"]
    assert course["account"] == team.account_id
    assert course["team"]["limits"]["max_eighths"] == 16
    assert course["member"]["limits"]["max_eighths"] == 2
    assert body["user"]["home"] is None  # not measured yet
    assert body["user"]["limits"]["max_home_bytes"] == 20 * 2**30


def test_quota_shows_the_measured_home(fleet):
    user = make_user()
    quota_set(user=user, limits={"max_home_files": 10})
    HomeUsage.objects.create(user=user, bytes=4096, files=11, measured_at=timezone.now())
    body = client_for(user).get("/api/v1/quota").json()["user"]
    assert body["home"]["files"] == 11 and body["home"]["over"] is True
    assert body["limits"]["max_home_files"] == 10


# --- tokens and scopes -------------------------------------------------------------------------------


def test_a_read_token_reads_sessions_but_cannot_launch(fleet, sent_tasks):
    user = make_user()
    _token, raw = access_token_create(user=user, name="ci", scopes=["read"])
    client = APIClient(HTTP_AUTHORIZATION=f"Bearer {raw}")
    assert client.get("/api/v1/sessions").status_code == 200
    assert client.get("/api/v1/catalog").status_code == 200
    before = counts()
    assert_error(launch(client), 403)
    assert counts() == before
    _token, raw = access_token_create(user=user, name="launcher", scopes=["sessions"])
    assert launch(APIClient(HTTP_AUTHORIZATION=f"Bearer {raw}")).status_code == 201


# --- admin -------------------------------------------------------------------------------------------


def test_admin_endpoints_are_for_staff_only(fleet):
    client = client_for(make_user())
    node = Node.objects.get(name="node-a")
    before = counts()
    assert_error(client.get("/api/v1/admin/nodes"), 403)
    assert_error(
        client.post("/api/v1/admin/nodes", {"name": "x", "address": "http://h:1"}, format="json"), 403
    )
    assert_error(client.post(f"/api/v1/admin/nodes/{node.id}/cordon"), 403)
    assert_error(client.get("/api/v1/admin/quotas"), 403)
    assert_error(client.put("/api/v1/admin/quotas", {"user": 1, "limits": {}}, format="json"), 403)
    assert counts() == before
    assert Node.objects.get(id=node.id).state == "active"


def test_staff_enrol_a_node_and_get_its_token_once(fleet):
    staff = client_for(make_user(staff=True))
    response = staff.post(
        "/api/v1/admin/nodes", {"name": "node-c", "address": "http://10.0.0.7:8701"}, format="json"
    )
    assert response.status_code == 201, response.content
    body = response.json()
    assert body["token"] and body["state"] == "active" and body["devices"] == []
    listed = {n["name"]: n for n in staff.get("/api/v1/admin/nodes").json()}
    assert "token" not in listed["node-c"]
    assert len(listed["node-a"]["devices"]) == 4 + 7
    assert listed["node-a"]["devices"][0]["slot_map"] == [None] * 8
    assert AuditEntry.objects.filter(action="node.enroll", target_id=str(body["id"])).exists()
    for bad in ({"name": "", "address": "http://h:1"}, {"name": "n", "address": "ftp://h"}, {"name": "n"}):
        assert_error(staff.post("/api/v1/admin/nodes", bad, format="json"), 400)
    assert Node.objects.count() == 2


def test_staff_cordon_drain_and_uncordon_a_node(fleet, sent_tasks):
    sid = launch(client_for(make_user())).json()["id"]
    staff = client_for(make_user(staff=True))
    node = Node.objects.get(name="node-a")
    assert staff.post(f"/api/v1/admin/nodes/{node.id}/cordon").json()["state"] == "cordoned"
    # a cordoned node takes no new session: this one queues
    assert launch(client_for(make_user())).json()["state"] == "queued"
    assert (
        staff.post(f"/api/v1/admin/nodes/{node.id}/drain", {"reason": "maintenance"}, format="json").json()[
            "state"
        ]
        == "draining"
    )
    assert Session.objects.get(id=sid).state == "stopping"
    assert staff.post(f"/api/v1/admin/nodes/{node.id}/uncordon").json()["state"] == "active"
    assert_error(staff.post(f"/api/v1/admin/nodes/{node.id}/reboot"), 400)
    assert_error(staff.post("/api/v1/admin/nodes/999999/cordon"), 404)
    actions = list(AuditEntry.objects.filter(target_id=str(node.id)).values_list("action", flat=True))
    assert {"node.cordon", "node.drain", "node.uncordon"} <= set(actions)


def test_staff_set_quotas_with_an_audit_row(fleet):
    staff_user = make_user(staff=True)
    staff = client_for(staff_user)
    user = make_user()
    response = staff.put(
        "/api/v1/admin/quotas",
        {"user": user.id, "limits": {"max_sessions": 1, "allowed_profiles": ["1/8"]}, "reason": "course"},
        format="json",
    )
    assert response.status_code == 200, response.content
    assert response.json()["limits"]["max_sessions"] == 1
    staff.put("/api/v1/admin/quotas", {"user": user.id, "limits": {"max_eighths": 4}}, format="json")
    quota = Quota.objects.get(user=user, account__isnull=True)
    assert (quota.max_sessions, quota.max_eighths, quota.allowed_profiles) == (1, 4, ["1/8"])
    audits = AuditEntry.objects.filter(action="quota.set", target_id=str(quota.id)).order_by("id")
    assert [a.actor_id for a in audits] == [staff_user.id, staff_user.id]
    assert audits[1].before["max_eighths"] is None and audits[1].after["max_eighths"] == 4
    assert [q["id"] for q in staff.get("/api/v1/admin/quotas").json()] == [quota.id]


@pytest.mark.parametrize(
    "body",
    [
        {"limits": {"max_sessions": 1}},
        {"user": 999_999, "limits": {"max_sessions": 1}},
        {"account": 999_999, "limits": {"max_sessions": 1}},
        {"user": "me", "limits": {}},
        {"user": 1, "limits": {"max_sessions": -1}},
        {"user": 1, "limits": {"max_sessions": "lots"}},
        {"user": 1, "limits": {"allowed_profiles": "whole"}},
        {"user": 1, "limits": "none"},
    ],
)
def test_bad_quota_input_is_a_4xx_and_writes_nothing(fleet, body):
    staff = client_for(make_user(staff=True))
    if body.get("user") == 1:
        body = {**body, "user": make_user().id}
    before = counts()
    audits = AuditEntry.objects.count()
    response = staff.put("/api/v1/admin/quotas", body, format="json")
    assert response.status_code in (400, 404), response.content
    assert response.json()["error"]["message"]
    assert counts() == before
    assert AuditEntry.objects.count() == audits


def test_the_openapi_schema_documents_the_provisioner(client):
    schema = client.get("/api/schema/", HTTP_ACCEPT="application/json").json()
    for path in (
        "/api/v1/catalog",
        "/api/v1/sessions",
        "/api/v1/sessions/{session_id}",
        "/api/v1/sessions/{session_id}/stop",
        "/api/v1/sessions/{session_id}/events",
        "/api/v1/sessions/{session_id}/metrics",
        "/api/v1/sessions/{session_id}/notices",
        "/api/v1/sessions/{session_id}/still-here",
        "/api/v1/quota",
        "/api/v1/admin/nodes",
        "/api/v1/admin/quotas",
        "/api/agent/heartbeat",
    ):
        assert path in schema["paths"], path
    launch_op = schema["paths"]["/api/v1/sessions"]["post"]
    assert {"201", "200"} <= set(launch_op["responses"])
    assert any(p["name"] == "Idempotency-Key" for p in launch_op["parameters"])


# --- the admin site, the node command and the demo seed ----------------------------------------------


def test_every_provisioner_admin_page_renders(fleet, sent_tasks, client):
    from django.urls import reverse

    launch(client_for(make_user())).json()
    staff = make_user(staff=True)
    client.force_login(staff)
    for model in (
        "gpumodel",
        "profile",
        "environment",
        "node",
        "device",
        "devicesample",
        "session",
        "allocation",
        "quota",
    ):
        response = client.get(reverse(f"admin:provisioner_{model}_changelist"))
        assert response.status_code == 200, model
    device = Node.objects.get(name="node-a").devices.first()
    assert client.get(reverse("admin:provisioner_device_change", args=[device.id])).status_code == 200
    session = Session.objects.get()
    assert client.get(reverse("admin:provisioner_session_change", args=[session.id])).status_code == 200
    assert (
        unseal(session.jupyter_token_sealed)
        not in client.get(reverse("admin:provisioner_session_change", args=[session.id])).content.decode()
    )


def test_admin_actions_go_through_the_services(fleet, sent_tasks, client):
    from django.urls import reverse

    sid = launch(client_for(make_user())).json()["id"]
    client.force_login(make_user(staff=True))
    node = Node.objects.get(name="node-a")
    url = reverse("admin:provisioner_node_changelist")
    client.post(url, {"action": "node_cordon", "_selected_action": [node.id]})
    assert Node.objects.get(id=node.id).state == "cordoned"
    assert AuditEntry.objects.filter(action="node.cordon").exists()
    client.post(
        reverse("admin:provisioner_session_changelist"), {"action": "force_stop", "_selected_action": [sid]}
    )
    assert Session.objects.get(id=sid).state == "stopping"
    free = node.devices.filter(kind="physical", gpu_model__name=A100, allocations__isnull=True).first()
    response = client.post(
        reverse("admin:provisioner_device_change", args=[free.id]), {"sharing_policy": "equal-share"}
    )
    assert response.status_code == 302
    assert node.devices.get(id=free.id).sharing_policy == "equal-share"
    assert AuditEntry.objects.filter(action="device.sharing_policy", target_id=str(free.id)).exists()
    user = make_user()
    response = client.post(
        reverse("admin:provisioner_quota_add"),
        {"user": user.id, "max_sessions": "2", "allowed_gpu_models": "null", "allowed_profiles": "null"},
    )
    assert response.status_code == 302, response.content.decode()[:2000]
    assert Quota.objects.get(user=user).max_sessions == 2
    assert AuditEntry.objects.filter(action="quota.set").exists()


def test_the_node_command_enrols_and_writes_a_private_token_file(db, tmp_path):
    from django.core.management import call_command

    from provisioner.services.nodes import node_by_token

    path = tmp_path / "agents" / "node-x" / "token"
    call_command("node", "add", "node-x", "--address", "http://127.0.0.1:8799", "--token-file", str(path))
    assert path.stat().st_mode & 0o777 == 0o600
    assert node_by_token(token=path.read_text().strip()).name == "node-x"
    from io import StringIO

    out = StringIO()
    call_command("node", "list", stdout=out)
    assert "node-x" in out.getvalue() and "never" in out.getvalue()


def test_the_demo_seed_is_idempotent_and_keeps_tokens(db, tmp_path):
    from billing.models import Price
    from provisioner.demo import seed
    from provisioner.models import Environment, GpuModel
    from provisioner.services.nodes import node_by_token

    first = seed(data_dir=tmp_path)
    token_a = (tmp_path / "agents" / "node-a" / "token").read_text().strip()
    assert node_by_token(token=token_a).name == "node-a"
    assert first["nodes"]["node-a"]["token"] == "enrolled"
    prices = Price.objects.count()
    second = seed(data_dir=tmp_path)
    assert second["nodes"]["node-a"]["token"] == "kept"
    assert (tmp_path / "agents" / "node-a" / "token").read_text().strip() == token_a
    assert Price.objects.count() == prices and second["prices"] == []
    (tmp_path / "agents" / "node-b" / "token").unlink()
    assert seed(data_dir=tmp_path)["nodes"]["node-b"]["token"] == "written"
    token_b = (tmp_path / "agents" / "node-b" / "token").read_text().strip()
    assert node_by_token(token=token_b).name == "node-b"
    assert set(GpuModel.objects.values_list("name", flat=True)) == {A100, "T4", "H200"}
    assert Environment.objects.get(interface="jupyterlab").python
    # VS Code is seeded too; the catalog offers it only once a node reports code-server
    assert Environment.objects.get(interface="vscode").python


def test_the_demo_nodes_are_dialled_where_the_procfiles_agents_listen(db, tmp_path, monkeypatch):
    """`make run` with AGENT_A_PORT / AGENT_B_PORT: the portal must dial those ports, also after a run
    that used others (the launch worked, then every start and the proxy met a refused connection)."""
    from provisioner.demo import seed
    from provisioner.models import Node

    seed(data_dir=tmp_path)
    assert Node.objects.get(name="node-a").address == "http://127.0.0.1:8701"
    monkeypatch.setenv("AGENT_A_PORT", "8761")
    monkeypatch.setenv("AGENT_B_PORT", "8762")
    assert seed(data_dir=tmp_path)["nodes"]["node-b"]["address"] == "http://127.0.0.1:8762"
    assert dict(Node.objects.values_list("name", "address")) == {
        "node-a": "http://127.0.0.1:8761",
        "node-b": "http://127.0.0.1:8762",
    }


def test_the_sessions_list_takes_as_many_queries_for_twelve_sessions_as_for_three(
    fleet, sent_tasks, django_assert_max_num_queries
):
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    user = make_user()
    quota_set(user=user, limits={"max_sessions": 50, "max_eighths": 200})
    client = client_for(user)

    def add(*, slices: int, t4: int) -> None:
        ids = [launch(client, profile="1/8").json()["id"] for _ in range(slices)]
        ids += [launch(client, gpu_model="T4").json()["id"] for _ in range(t4)]
        beat(
            fleet,
            [workload_status(s, "running") for s in Session.objects.filter(id__in=ids, state="placing")],
        )

    add(slices=1, t4=2)  # running on an A100 slice and the T4, one queued for the T4
    assert {s.state for s in Session.objects.filter(owner=user)} == {"running", "queued"}
    client.get("/api/v1/sessions")
    with CaptureQueriesContext(connection) as three:
        assert client.get("/api/v1/sessions").json()["count"] == 3
    most = len(three)  # now: connection.queries keeps only the last 9,000
    add(slices=6, t4=3)
    with django_assert_max_num_queries(most):
        body = client.get("/api/v1/sessions").json()
    assert body["count"] == 12
    assert sum(s["jupyter_url"] is not None for s in body["results"]) == 8
