"""Races on one real PostgreSQL: many threads, each with its own connection, launching through
``session_launch`` (admission, funds and placement in one transaction). Only our own scheduling hooks
(the start task and the queue dispatch queued after commit) are replaced; placement and the database
are the real ones."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor, wait

import pytest
from django.db import OperationalError, connection

from core.errors import ApplicationError, QuotaExceeded
from provisioner.models import Allocation, AllocationSlot, Device, Session
from provisioner.placement import aligned_starts
from provisioner.quotas import quota_set
from provisioner.selectors import queue_order
from provisioner.services.sessions import queue_dispatch, session_end
from tests.provisioner.factories import (
    A100,
    catalog_make,
    fleet_make,
    launch,
    no_start_task,
    used_masks,
    user_make,
)

pytestmark = pytest.mark.django_db(transaction=True)
DEADLINE_SECONDS = 120
SIZES = {"whole": 8, "1/2": 4, "1/4": 2, "1/8": 1}
GPUS = {"2x": 2, "4x": 4}


def _connect() -> None:
    """Open this thread's connection; a server at its connection limit gets up to a minute to free one
    (the processes an earlier end-to-end test started may still be closing theirs)."""
    for _ in range(1200):
        try:
            connection.ensure_connection()
            return
        except OperationalError:
            time.sleep(0.05)
    connection.ensure_connection()


def _race(n: int, fn) -> list:
    """Run ``fn(i)`` for i in range(n) on n threads released at once; return results or the domain
    errors raised. Fails if any thread is still running after the deadline (a deadlock or a hang)."""
    connection.close()  # the server allows ~100 connections: leave them to the threads
    barrier = threading.Barrier(n, timeout=DEADLINE_SECONDS)

    def call(i):
        try:
            _connect()
            barrier.wait()
            return fn(i)
        except ApplicationError as exc:
            return exc
        finally:
            connection.close()

    pool = ThreadPoolExecutor(n)
    futures = [pool.submit(call, i) for i in range(n)]
    done, hung = wait(futures, timeout=DEADLINE_SECONDS)
    pool.shutdown(wait=not hung)
    assert not hung, f"{len(hung)} of {n} threads did not finish within {DEADLINE_SECONDS} s"
    return [f.result() for f in futures]


@pytest.fixture
def ten_gpus(monkeypatch, settings):
    no_start_task(monkeypatch)
    settings.SESSION_LAUNCH_RATE = (1_000_000, 60)  # one user's 50 launches at once race on the quota
    model = catalog_make(A100)
    return fleet_make(model, nodes=2, gpus_per_node=5)


def _assert_allocations_consistent() -> None:
    """Every slot row belongs to the allocation covering it (on one of its session's devices); every
    allocation to a placed session."""
    slots = list(AllocationSlot.objects.values_list("device_id", "slot", "allocation_id"))
    assert len({(d, s) for d, s, _a in slots}) == len(slots)
    allocations = {a.id: a for a in Allocation.objects.select_related("session")}
    devices = {a.id: [d.id for d in a.session.gpu_devices()] for a in allocations.values()}
    assert sum(a.slot_count * len(devices[a.id]) for a in allocations.values()) == len(slots)
    for device_id, slot, allocation_id in slots:
        allocation = allocations[allocation_id]
        assert device_id in devices[allocation_id]
        assert allocation.slot_start <= slot < allocation.slot_start + allocation.slot_count
    for allocation in allocations.values():
        session = allocation.session
        assert allocation.slot_start % allocation.slot_count == 0
        assert (session.device_id, session.slot_start, session.slot_count) == (
            allocation.device_id,
            allocation.slot_start,
            allocation.slot_count,
        )


def test_a_hundred_launches_onto_ten_gpus_fill_every_eighth_once(ten_gpus):
    users = [user_make() for _ in range(100)]
    results = _race(100, lambda i: launch(users[i], profile="1/8"))
    assert all(isinstance(r, Session) for r in results), [r for r in results if not isinstance(r, Session)]
    states = Counter(Session.objects.values_list("state", flat=True))
    assert states == {Session.State.PLACING: 80, Session.State.QUEUED: 20}
    assert AllocationSlot.objects.count() == 80
    assert used_masks() == {gpu.id: 0xFF for gpu in ten_gpus}
    _assert_allocations_consistent()


def test_a_hundred_mixed_launches_queue_only_what_no_free_block_fits(ten_gpus):
    rng = random.Random(4)
    profiles = rng.choices(["1/8", "1/4", "1/2", "whole"], weights=[4, 3, 2, 1], k=100)
    users = [user_make() for _ in range(100)]
    results = _race(100, lambda i: launch(users[i], profile=profiles[i]))
    assert all(isinstance(r, Session) for r in results)
    _assert_allocations_consistent()
    masks = used_masks()
    placed = Session.objects.filter(state=Session.State.PLACING).select_related("profile")
    assert sum(SIZES[s.profile.name] for s in placed) == sum(m.bit_count() for m in masks.values())
    # Slots were only ever taken, never freed: a block free now was free all along, so a queued
    # session means no block of its size was free when it launched.
    queued = {
        s.profile.name for s in Session.objects.filter(state=Session.State.QUEUED).select_related("profile")
    }
    assert queued, "the demand was meant to exceed the 80 eighths"
    for name in queued:
        assert not any(aligned_starts(masks.get(gpu.id, 0), SIZES[name]) for gpu in ten_gpus), name


def test_racing_multi_gpu_launches_never_hold_a_slot_twice(ten_gpus, settings):
    """Fifty launches at once, a third of them 2x or 4x among wholes and slices, on two nodes of five
    GPUs: no slot held twice, each multi-GPU session on GPUs of one node, all of them whole, and a
    queued 4x only when no node had four free GPUs."""
    settings.QUOTA_DEFAULT_MAX_EIGHTHS = 32  # a 4x counts 32 eighths
    rng = random.Random(11)
    profiles = rng.choices(["2x", "4x", "whole", "1/2", "1/8"], weights=[3, 2, 2, 2, 3], k=50)
    users = [user_make() for _ in range(50)]
    results = _race(50, lambda i: launch(users[i], profile=profiles[i]))
    assert all(isinstance(r, Session) for r in results), [r for r in results if not isinstance(r, Session)]
    _assert_allocations_consistent()
    masks = used_masks()
    placed = Session.objects.filter(state=Session.State.PLACING).select_related("profile")
    assert any(s.profile.name in GPUS for s in placed)
    for session in placed:
        held = session.gpu_devices()
        assert len(held) == GPUS.get(session.profile.name, 1)
        if session.profile.name in GPUS:
            assert len({d.node_id for d in held}) == 1
            assert all(masks[d.id] == 0xFF for d in held)
    eighths = sum(8 * GPUS.get(s.profile.name, 0) or SIZES[s.profile.name] for s in placed)
    assert eighths == sum(m.bit_count() for m in masks.values())
    if Session.objects.filter(state=Session.State.QUEUED, profile__name="4x").exists():
        free = Counter(gpu.node_id for gpu in ten_gpus if masks.get(gpu.id, 0) == 0)
        assert max(free.values(), default=0) < 4


def test_a_quota_of_two_holds_under_fifty_simultaneous_launches(ten_gpus):
    user = user_make()
    quota_set(user=user, limits={"max_sessions": 2})
    results = _race(50, lambda i: launch(user, profile="1/8"))
    sessions = [r for r in results if isinstance(r, Session)]
    refused = [r for r in results if isinstance(r, QuotaExceeded)]
    assert len(sessions) == 2 and len(refused) == 48
    assert {r.code for r in refused} == {"quota_sessions"}
    assert Session.objects.filter(owner=user).count() == 2
    assert AllocationSlot.objects.count() == 2


def test_a_gpu_share_quota_holds_under_simultaneous_launches(ten_gpus):
    user = user_make()
    quota_set(user=user, limits={"max_eighths": 5, "max_sessions": 100})
    results = _race(40, lambda i: launch(user, profile=["1/8", "1/4"][i % 2]))
    assert sum(SIZES[r.profile.name] for r in results if isinstance(r, Session)) <= 5
    assert AllocationSlot.objects.count() <= 5


def test_launches_ends_and_dispatches_at_once_never_deadlock(ten_gpus, monkeypatch):
    """Sixty threads: most launch, some end random placed sessions (freeing slots), some run the queue
    dispatch; all finish, and no slot is held twice."""
    monkeypatch.setattr("provisioner.enqueue.queue_dispatch", lambda: None)
    users = [user_make() for _ in range(60)]
    rng = random.Random(7)
    profiles = rng.choices(["1/8", "1/4", "1/2", "whole"], k=60)

    def work(i):
        if i % 6 == 5:
            for _ in range(3):
                victim = Session.objects.filter(state=Session.State.PLACING).order_by("?").first()
                if victim is not None:
                    session_end(session_id=victim.id, to=Session.State.STOPPED, reason="race")
                queue_dispatch()
            return None
        return [launch(users[i], profile=profiles[i]) for _ in range(2)]

    results = _race(60, work)
    assert not [r for r in results if isinstance(r, Exception)]
    _assert_allocations_consistent()
    assert not Allocation.objects.exclude(session__state=Session.State.PLACING).exists()
    # After a final dispatch the head of the queue is what no free block fits (it blocks those behind
    # it, so a big request is not starved by small ones).
    queue_dispatch()
    masks = used_masks()
    waiting = queue_order(list(Session.objects.filter(state=Session.State.QUEUED).select_related("profile")))
    if waiting:
        size = SIZES[waiting[0].profile.name]
        assert not any(
            aligned_starts(masks.get(d, 0), size) for d in Device.objects.values_list("id", flat=True)
        )
