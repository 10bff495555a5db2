"""The interruptible tier through the services (provisioner/services/preemption.py and its callers in
sessions and limits): an on-demand launch preempts, the victim is warned, stopped after its grace,
billed to its stop, its slots go to the on-demand session first, and a victim that asked to resume is
queued again and placed when capacity frees."""

from __future__ import annotations

from datetime import timedelta

import pytest

from billing.models import Meter
from billing.services.metering import metering_tick
from billing.services.pricing import price_set
from core.errors import ValidationFailed
from notices.models import Notice
from provisioner.models import Allocation, Session, StopWarning
from provisioner.services.limits import sessions_preempt_due
from provisioner.services.sessions import node_sessions_lost, queue_dispatch, session_launch, session_stop
from tests.provisioner.conftest import A100, ENV, beat, client_for, gpu, make_node, make_user, workload_status

pytestmark = pytest.mark.django_db
CHEAP_MICROS = 4_000_000
GRACE_SECONDS = 120


@pytest.fixture
def node(catalog, settings):
    settings.SESSION_PREEMPT_GRACE_SECONDS = GRACE_SECONDS
    price_set(
        gpu_model=A100,
        profile="whole",
        price_micros_per_hour=12_000_000,
        interruptible_price_micros_per_hour=CHEAP_MICROS,
    )
    node, _token = make_node("node-p", [gpu(0, "GPU-p-0")])
    return node


def launch(user, **fields) -> Session:
    args = {"gpu_model": A100, "profile": "whole", "environment": ENV, "max_hours": 2, "idle_minutes": 60}
    return session_launch(user=user, account=user.account, idempotency_key=None, **{**args, **fields}).session


def states(*sessions: Session) -> list[str]:
    for s in sessions:
        s.refresh_from_db()
    return [s.state for s in sessions]


def run(node, *sessions: Session) -> None:
    beat(node, [workload_status(s, "running") for s in sessions])
    assert set(states(*sessions)) == {"running"}


def preempt_warning(session: Session) -> StopWarning | None:
    return StopWarning.objects.filter(session=session, kind="preempt", cleared_at__isnull=True).first()


def test_an_on_demand_launch_preempts_warns_stops_after_the_grace_and_takes_the_slots_first(node, sent_tasks):
    cheap_user, user, third = make_user(), make_user(), make_user()
    victim = launch(cheap_user, tier="interruptible")
    assert victim.price_micros_per_hour == CHEAP_MICROS
    run(node, victim)

    on_demand = launch(user)
    assert states(on_demand, victim) == ["queued", "running"]
    assert victim.preempted_for_id == on_demand.id
    warning = preempt_warning(victim)
    assert (warning.due_at - warning.created_at).total_seconds() == pytest.approx(GRACE_SECONDS, abs=2)
    assert "An on-demand launch needs this GPU" in warning.message_display
    assert "about 2 minutes" in warning.message_display and "home folder is kept" in warning.message_display
    assert Notice.objects.filter(user=cheap_user, kind="stop_warning").count() == 1

    assert sessions_preempt_due(now=warning.due_at - timedelta(seconds=1)) == 0
    assert states(victim) == ["running"]
    assert sessions_preempt_due(now=warning.due_at + timedelta(seconds=1)) == 1
    assert states(victim) == ["stopping"]
    assert queue_dispatch() == 0  # the agent has not confirmed the workload gone

    beat(node, [])  # the agent confirms it gone: stopped, its slots held for the on-demand session
    assert states(victim) == ["stopped"]
    assert Allocation.objects.filter(session=victim).exists()
    late = launch(third, tier="interruptible")  # free capacity only: none, the slots are held
    assert states(late) == ["queued"]
    assert queue_dispatch() == 1
    assert states(on_demand, late) == ["placing", "queued"]
    assert not Allocation.objects.filter(session=victim).exists()
    assert on_demand.device_id == victim.device_id
    assert preempt_warning(victim) is None


def test_the_victim_is_billed_to_its_stop_at_the_interruptible_price(node, sent_tasks):
    victim = launch(make_user(), tier="interruptible")
    run(node, victim)
    launch(make_user())
    warning = preempt_warning(victim)
    sessions_preempt_due(now=warning.due_at + timedelta(seconds=1))
    beat(node, [])
    victim.refresh_from_db()
    metering_tick(now=victim.ended_at + timedelta(minutes=5))
    meter = Meter.objects.get(session_ref=str(victim.id))
    assert meter.price_micros_per_hour == CHEAP_MICROS
    assert meter.ended_at == victim.last_alive_at <= victim.ended_at
    assert meter.billed_until == meter.ended_at
    assert meter.billed_seconds == int((meter.ended_at - meter.started_at).total_seconds())


def test_a_preempted_session_that_asked_to_resume_is_queued_again_and_placed_when_capacity_frees(
    node, sent_tasks
):
    owner = make_user()
    victim = launch(owner, tier="interruptible", resume=True)
    run(node, victim)
    on_demand = launch(make_user())
    sessions_preempt_due(now=preempt_warning(victim).due_at + timedelta(seconds=1))
    beat(node, [])
    resumed = Session.objects.get(resumed_from=victim)
    assert (resumed.owner_id, resumed.account_id, resumed.profile_id, resumed.environment_id) == (
        victim.owner_id,
        victim.account_id,
        victim.profile_id,
        victim.environment_id,
    )
    assert (resumed.tier, resumed.resume, resumed.state) == ("interruptible", True, "queued")
    assert resumed.price_micros_per_hour == CHEAP_MICROS

    assert queue_dispatch() == 1
    assert states(on_demand, resumed) == ["placing", "queued"]
    run(node, on_demand)
    session_stop(session=on_demand, actor=None, reason="done")
    beat(node, [])
    assert states(on_demand) == ["stopped"]
    assert queue_dispatch() == 1
    assert states(resumed) == ["placing"]


def test_cancelling_the_on_demand_session_spares_its_victims(node, sent_tasks):
    victim = launch(make_user(), tier="interruptible", resume=True)
    run(node, victim)
    on_demand = launch(make_user())
    due = preempt_warning(victim).due_at
    session_stop(session=on_demand, actor=None, reason="changed my mind")
    assert states(on_demand) == ["stopped"]
    victim.refresh_from_db()
    assert victim.preempted_for_id is None and preempt_warning(victim) is None
    assert sessions_preempt_due(now=due + timedelta(seconds=1)) == 0
    assert states(victim) == ["running"]


def test_a_victim_ending_after_its_on_demand_session_gave_up_frees_its_slots(node, sent_tasks):
    victim = launch(make_user(), tier="interruptible")
    run(node, victim)
    on_demand = launch(make_user())
    sessions_preempt_due(now=preempt_warning(victim).due_at + timedelta(seconds=1))
    session_stop(session=on_demand, actor=None, reason="changed my mind")
    beat(node, [])  # the victim was already stopping: it stops, and holds its slots for nobody
    assert states(victim) == ["stopped"]
    assert not Allocation.objects.filter(session=victim).exists()
    assert states(launch(make_user(), tier="interruptible")) == ["placing"]


def test_an_interruptible_launch_never_preempts(node, sent_tasks):
    first = launch(make_user(), tier="interruptible")
    run(node, first)
    second = launch(make_user(), tier="interruptible")
    assert states(second, first) == ["queued", "running"]
    assert preempt_warning(first) is None
    queue_dispatch()
    assert preempt_warning(first) is None and states(second) == ["queued"]


def test_an_on_demand_session_never_is_preempted(node, sent_tasks):
    first = launch(make_user())
    run(node, first)
    second = launch(make_user())
    assert states(second, first) == ["queued", "running"]
    assert not StopWarning.objects.filter(kind="preempt").exists()


def test_the_head_of_the_queue_preempts_in_dispatch(node, sent_tasks):
    blocker = launch(make_user())
    run(node, blocker)
    waiting = launch(make_user())  # nothing to preempt yet: queued
    cheap = make_node("node-q", [gpu(0, "GPU-q-0")])[0]
    victim = launch(make_user(), tier="interruptible")
    run(cheap, victim)
    assert preempt_warning(victim) is None
    assert queue_dispatch() == 0
    victim.refresh_from_db()
    assert victim.preempted_for_id == waiting.id and preempt_warning(victim) is not None


def test_the_interruptible_tier_needs_its_price(node):
    price_set(gpu_model=A100, profile="whole", price_micros_per_hour=12_000_000)
    with pytest.raises(ValidationFailed) as refused:
        launch(make_user(), tier="interruptible")
    assert refused.value.code == "unpriced"
    with pytest.raises(ValidationFailed):
        launch(make_user(), gpu_model="", profile="cpu", tier="interruptible")
    with pytest.raises(ValidationFailed):
        launch(make_user(), tier="spot")


def test_the_session_page_and_the_api_show_the_preemption_and_the_resume(node, sent_tasks, client):
    owner = make_user()
    victim = launch(owner, tier="interruptible", resume=True)
    run(node, victim)
    launch(make_user())
    sessions_preempt_due(now=preempt_warning(victim).due_at + timedelta(seconds=1))
    beat(node, [])
    resumed = Session.objects.get(resumed_from=victim)
    client.force_login(owner)
    page = client.get(f"/sessions/{victim.id}/").content.decode()
    assert "Preempted; waiting to resume" in page and f"/sessions/{resumed.id}/" in page
    assert f"/sessions/{victim.id}/" in client.get(f"/sessions/{resumed.id}/").content.decode()
    body = client_for(owner).get(f"/api/v1/sessions/{victim.id}").json()
    assert (body["tier"], body["preempted"], body["resumed_as"]) == ("interruptible", True, str(resumed.id))


def test_the_launch_page_and_the_catalog_show_the_interruptible_price_beside_on_demand(node, client):
    user = make_user()
    client.force_login(user)
    page = client.get("/launch/", {"gpu_model": A100, "profile": "1/2"}).content.decode()
    assert 'data-testid="interruptible-price"' in page and 'name="tier" value="interruptible"' in page
    offered = client_for(user).get("/api/v1/catalog").json()["gpu_models"]
    half = next(p for m in offered if m["name"] == A100 for p in m["profiles"] if p["profile"] == "1/2")
    assert half["price"]["price_micros_per_hour"] == 6_000_000
    assert half["price"]["interruptible"]["price_micros_per_hour"] == CHEAP_MICROS // 2
    t4 = next(p for m in offered if m["name"] == "T4" for p in m["profiles"] if p["profile"] == "whole")
    assert t4["price"]["interruptible"] is None


def test_a_launch_through_the_form_can_be_interruptible_and_resume(node, client, sent_tasks):
    user = make_user()
    client.force_login(user)
    client.post(
        "/launch/",
        {"gpu_model": A100, "profile": "whole", "environment": ENV, "tier": "interruptible", "resume": "on"},
    )
    session = Session.objects.get(owner=user)
    assert (session.tier, session.resume, session.price_micros_per_hour) == (
        "interruptible",
        True,
        CHEAP_MICROS,
    )


def test_a_victim_its_owner_stops_during_the_grace_does_not_resume(node, sent_tasks):
    owner = make_user()
    victim = launch(owner, tier="interruptible", resume=True)
    run(node, victim)
    on_demand = launch(make_user())
    due = preempt_warning(victim).due_at
    session_stop(session=victim, actor=owner, reason="done anyway")
    assert sessions_preempt_due(now=due + timedelta(seconds=1)) == 0
    beat(node, [])
    victim.refresh_from_db()
    assert victim.state == "stopped" and victim.preempted_at is None
    assert not Session.objects.filter(resumed_from=victim).exists()
    assert queue_dispatch() == 1 and states(on_demand) == ["placing"]  # its slots still went first


def test_a_lost_victim_keeps_its_slots_until_the_agent_confirms_them_gone(node, sent_tasks):
    victim = launch(make_user(), tier="interruptible")
    run(node, victim)
    on_demand = launch(make_user())
    node_sessions_lost(node=node, reason="node down")
    assert states(victim) == ["lost"]
    queue_dispatch()  # the lost victim's slots are neither handed over nor freed
    assert Allocation.objects.filter(session=victim).exists()
    assert states(on_demand) == ["queued"]
    beat(node, [])  # the agent is back and runs nothing: the lost rule frees them, for anyone
    assert not Allocation.objects.filter(session=victim).exists()
    assert queue_dispatch() == 1 and states(on_demand) == ["placing"]
