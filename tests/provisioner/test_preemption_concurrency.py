"""Preemption racing launches, stops and queue dispatches on one real PostgreSQL (threads, each with
its own connection): no slot is ever held twice, no interruptible session is claimed by two on-demand
sessions, and the slots a preempted session frees go to the session it was stopped for."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from billing.services.pricing import price_set
from provisioner.models import Allocation, AllocationSlot, Session, StopWarning
from provisioner.services.limits import sessions_preempt_due
from provisioner.services.sessions import queue_dispatch, session_end
from tests.provisioner.factories import A100, catalog_make, fleet_make, launch, no_start_task, user_make
from tests.provisioner.test_concurrency import _assert_allocations_consistent, _race

pytestmark = pytest.mark.django_db(transaction=True)
GPUS = 6
S = Session.State


@pytest.fixture
def full_of_interruptible(monkeypatch, settings):
    """Six whole GPUs, each running one interruptible session."""
    no_start_task(monkeypatch)
    monkeypatch.setattr("provisioner.enqueue.queue_dispatch", lambda: None)
    monkeypatch.setattr("provisioner.enqueue.session_stop", lambda session_id: None)
    settings.SESSION_LAUNCH_RATE = (1_000_000, 60)
    model = catalog_make(A100)
    price_set(
        gpu_model=A100,
        profile="whole",
        price_micros_per_hour=12_000_000,
        interruptible_price_micros_per_hour=3_000_000,
    )
    devices = fleet_make(model, nodes=2, gpus_per_node=GPUS // 2)
    victims = [launch(user_make(), profile="whole", tier="interruptible") for _ in range(GPUS)]
    Session.objects.filter(id__in=[v.id for v in victims]).update(state=S.RUNNING, running_at=timezone.now())
    return devices, victims


def _end_stopping() -> None:
    for session_id in Session.objects.filter(state=S.STOPPING).values_list("id", flat=True):
        session_end(session_id=session_id, to=S.STOPPED, reason="gone", from_states=[S.STOPPING])


def _assert_every_slot_once_and_held_only_for_a_waiting_session() -> None:
    _assert_allocations_consistent()
    assert len(set(AllocationSlot.objects.values_list("device_id", "slot"))) == AllocationSlot.objects.count()
    for allocation in Allocation.objects.select_related("session__preempted_for"):
        session = allocation.session
        if session.state in Session.ENDED:  # held: only for the on-demand session still waiting
            assert session.preempted_for is not None and session.preempted_for.state == S.QUEUED
        else:
            assert session.state in (S.PLACING, S.RUNNING, S.STOPPING)


def test_on_demand_launches_racing_claim_each_interruptible_session_once(full_of_interruptible):
    _devices, victims = full_of_interruptible
    users = [user_make() for _ in range(12)]
    tiers = ["on_demand"] * 9 + ["interruptible"] * 3
    results = _race(12, lambda i: launch(users[i], profile="whole", tier=tiers[i]))
    assert all(isinstance(r, Session) for r in results), results
    assert set(Session.objects.filter(id__in=[r.id for r in results]).values_list("state", flat=True)) == {
        S.QUEUED
    }
    claimed = Session.objects.filter(preempted_for__isnull=False)
    # each victim was claimed by one session and warned once; a lost claim left no warning behind
    assert StopWarning.objects.filter(kind="preempt").count() == claimed.count() >= 1
    assert set(claimed.values_list("preempted_for__tier", flat=True)) == {"on_demand"}
    for claimer_id in set(claimed.values_list("preempted_for_id", flat=True)):
        assert claimed.filter(preempted_for_id=claimer_id).count() == 1  # a whole GPU: one victim each
    assert {v.id for v in victims} >= set(claimed.values_list("id", flat=True))
    _assert_every_slot_once_and_held_only_for_a_waiting_session()


def test_preemption_stops_and_hand_overs_racing_launches_never_hold_a_slot_twice(full_of_interruptible):
    devices, victims = full_of_interruptible
    waiting = [launch(user_make(), profile="whole") for _ in range(GPUS)]
    for _ in range(GPUS):
        queue_dispatch()  # every on-demand session claims a victim of its own
    assert Session.objects.filter(preempted_for__isnull=False).count() == GPUS
    later = timezone.now() + timedelta(hours=1)
    users = [[user_make() for _ in range(3)] for _ in range(24)]

    def work(i):
        if i % 3 == 0:  # stop due victims, end them, launch into what they free, dispatch
            for user in users[i]:
                sessions_preempt_due(now=later)
                _end_stopping()
                launch(user, profile="whole", tier="interruptible")
                queue_dispatch()
            return None
        tier = "interruptible" if i % 3 == 1 else "on_demand"
        return launch(users[i][0], profile="whole", tier=tier)

    results = _race(24, work)
    assert not [r for r in results if isinstance(r, Exception)], results
    _assert_every_slot_once_and_held_only_for_a_waiting_session()
    sessions_preempt_due(now=later)
    _end_stopping()
    queue_dispatch()
    _assert_every_slot_once_and_held_only_for_a_waiting_session()
    # the slots of each victim went to the session it was stopped for, and to nobody else first
    for session in Session.objects.filter(id__in=[w.id for w in waiting]):
        victim = Session.objects.get(preempted_for=session)
        assert victim.state == S.STOPPED
        assert (session.state, session.device_id) == (S.PLACING, victim.device_id)
    assert not Session.objects.filter(tier="interruptible", state=S.PLACING).exists()
    assert Allocation.objects.count() == len(devices)
