"""Placement: the buddy allocator's decisions (pure, with property tests) and the database half."""

from __future__ import annotations

import pytest
from django.db import IntegrityError, transaction
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from provisioner import models as provisioner_models
from provisioner import placement
from provisioner.models import Allocation, AllocationSlot, Device, Node, Session
from provisioner.placement import (
    BEST_START,
    BINPACK,
    EXCLUSIVE,
    SHARED,
    SPREAD,
    Choice,
    FreeIndex,
    Request,
    aligned_starts,
    allocation_free,
    allocation_place,
    block_mask,
    largest_free_buddy,
)
from tests.provisioner.factories import (
    A100,
    catalog_make,
    gpu_make,
    launch,
    mig_make,
    no_start_task,
    node_make,
    profiles_ensure,
    session_row,
    slot_pairs,
    used_masks,
    user_make,
)

M = "m"


def _index(*devices: tuple[int, str, int]) -> FreeIndex:
    index = FreeIndex()
    for device_id, cls, mask in devices:
        index.add(device_id, gpu_model=M, device_class=cls, mask=mask)
    return index


def _slice(eighths: int) -> Request:
    return Request(M, "slice", eighths)


# --- the decision, by example --------------------------------------------------------------------------


def test_slot_count_matches_the_models():
    assert placement.SLOTS_PER_GPU == provisioner_models.SLOTS_PER_GPU


@pytest.mark.parametrize("count", [1, 2, 4, 8])
def test_every_best_block_is_aligned_and_free(count):
    for mask in range(256):
        start = BEST_START[(mask, count)]
        if start is None:
            assert aligned_starts(mask, count) == []
        else:
            assert start % count == 0
            assert not mask & block_mask(start, count)


def test_a_stray_eighth_goes_next_to_the_used_one_not_into_the_free_half():
    assert BEST_START[(0b0000_0001, 1)] == 1
    assert BEST_START[(0b0000_0011, 1)] == 2
    assert BEST_START[(0b0000_0011, 2)] == 2  # the quarter beside, not the free half 4..7
    assert BEST_START[(0b0001_0000, 1)] == 5


def test_binpack_fills_a_hole_before_breaking_a_free_half_on_a_fuller_gpu():
    index = _index((1, SHARED, 0b0000_1111), (2, SHARED, 0b0000_0001))
    assert index.choose(_slice(1), BINPACK) == Choice(2, 1, 1)
    assert index.choose(_slice(4), BINPACK) == Choice(1, 4, 4)


def test_binpack_prefers_the_fuller_gpu_among_equal_holes():
    index = _index((1, SHARED, 0b0000_0001), (2, SHARED, 0b0111_1111), (3, SHARED, 0))
    assert index.choose(_slice(1), BINPACK) == Choice(2, 7, 1)


def test_binpack_keeps_free_cards_whole_while_a_used_gpu_has_room():
    index = _index((1, SHARED, 0), (2, SHARED, 0b0000_0001), (3, SHARED, 0))
    assert index.choose(_slice(4), BINPACK) == Choice(2, 4, 4)
    assert index.choose(Request(M, "whole"), BINPACK).device_id in (1, 3)


def test_spread_takes_the_emptiest_gpu():
    index = _index((1, SHARED, 0b0000_0001), (2, SHARED, 0b0000_0011), (3, SHARED, 0))
    assert index.choose(_slice(1), SPREAD) == Choice(3, 0, 1)
    index.occupy(Choice(3, 0, 1))
    assert index.choose(_slice(1), SPREAD) in (Choice(1, 1, 1), Choice(3, 1, 1))
    index.occupy(index.choose(_slice(1), SPREAD))
    assert index.choose(_slice(1), SPREAD).slot_start == 1  # the other of the two least used


def test_the_pick_within_a_bucket_is_the_last_device_to_arrive_there():
    index = _index((1, SHARED, 0), (2, SHARED, 0), (3, SHARED, 0))
    assert index.choose(Request(M, "whole")) == Choice(3, 0, 8)
    assert [c.device_id for c in index.choices(Request(M, "whole"))] == [3, 2, 1]
    index.remove(3)
    index.add(3, gpu_model=M, device_class=SHARED, mask=0)
    index.remove(1)  # from the middle of a bucket: the last one moves into its place
    assert sorted(c.device_id for c in index.choices(Request(M, "whole"))) == [2, 3]
    with pytest.raises(ValueError):
        index.add(2, gpu_model=M, device_class=SHARED, mask=0)


def test_whole_takes_only_a_fully_free_gpu_exclusive_first():
    index = _index((1, SHARED, 0), (2, EXCLUSIVE, 0b1), (3, EXCLUSIVE, 0))
    assert index.choose(Request(M, "whole")) == Choice(3, 0, 8)
    index.occupy(Choice(3, 0, 8))
    assert index.choose(Request(M, "whole")) == Choice(1, 0, 8)
    index.occupy(Choice(1, 0, 8))
    assert index.choose(Request(M, "whole")) is None


def test_slices_never_go_to_exclusive_or_mig_devices():
    index = _index((1, EXCLUSIVE, 0), (2, "mig:1g.10gb", 0))
    assert index.choose(_slice(1)) is None
    assert index.choose(_slice(1), SPREAD) is None


def test_mig_profile_takes_only_a_free_device_of_that_profile():
    index = _index((1, "mig:2g.20gb", 0), (2, "mig:1g.10gb", 0xFF), (3, "mig:1g.10gb", 0), (4, SHARED, 0))
    assert index.choose(Request(M, "mig", mig_profile="1g.10gb")) == Choice(3, 0, 8)
    assert index.choose(Request(M, "mig", mig_profile="3g.40gb")) is None


def test_another_models_devices_are_never_chosen():
    index = _index((1, SHARED, 0))
    assert index.choose(Request("other", "slice", 1)) is None


def test_occupying_a_taken_slot_is_refused_and_release_frees_it():
    index = _index((1, SHARED, 0))
    index.occupy(Choice(1, 0, 2))
    with pytest.raises(ValueError):
        index.occupy(Choice(1, 1, 1))
    index.release(Choice(1, 0, 2))
    assert index.mask(1) == 0


def test_copy_is_independent():
    index = _index((1, SHARED, 0))
    other = index.copy()
    other.occupy(Choice(1, 0, 8))
    assert index.mask(1) == 0 and other.mask(1) == 0xFF


# --- the decision, as properties ----------------------------------------------------------------------

CLASSES = [SHARED, SHARED, SHARED, EXCLUSIVE, "mig:1g.10gb", "mig:2g.20gb"]
REQUESTS = st.one_of(
    st.sampled_from([1, 2, 4]).map(lambda n: ("slice", n, "")),
    st.just(("whole", 8, "")),
    st.sampled_from(["1g.10gb", "2g.20gb", "3g.40gb"]).map(lambda p: ("mig", 8, p)),
)
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("place"), REQUESTS, st.sampled_from([BINPACK, SPREAD])),
        st.tuples(st.just("free"), st.integers(0, 1000), st.none()),
    ),
    max_size=120,
)


def _fits(classes, masks, request: Request) -> list[tuple[int, int]]:
    """Every (device, start) a request could take, by brute force over the fleet."""
    found = []
    for device_id, cls in classes.items():
        if request.kind == "slice":
            if cls == SHARED:
                found += [(device_id, s) for s in aligned_starts(masks[device_id], request.eighths)]
        elif request.kind == "whole":
            if cls in (SHARED, EXCLUSIVE) and masks[device_id] == 0:
                found.append((device_id, 0))
        elif cls == f"mig:{request.mig_profile}" and masks[device_id] == 0:
            found.append((device_id, 0))
    return found


@settings(max_examples=300, deadline=None)
@given(fleet=st.lists(st.sampled_from(CLASSES), min_size=1, max_size=12), ops=OPS)
def test_every_decision_is_the_best_fit_and_no_slot_is_given_twice(fleet, ops):
    index = FreeIndex()
    classes = {i + 1: cls for i, cls in enumerate(fleet)}
    masks = dict.fromkeys(classes, 0)  # the truth, kept apart from the index
    held: list[Choice] = []
    for device_id, cls in classes.items():
        index.add(device_id, gpu_model=M, device_class=cls, mask=0)
    for op, what, policy in ops:
        if op == "free":
            if held:
                choice = held.pop(what % len(held))
                masks[choice.device_id] &= ~block_mask(choice.slot_start, choice.slot_count)
                index.release(choice)
            continue
        kind, eighths, profile = what
        request = Request(M, kind, eighths, profile)
        fits = _fits(classes, masks, request)
        choice = index.choose(request, policy)
        if not fits:
            assert choice is None
            continue
        assert choice is not None
        assert (choice.device_id, choice.slot_start) in fits
        assert choice.slot_count == eighths and choice.slot_start % eighths == 0
        mask = masks[choice.device_id]
        if kind == "slice" and policy == BINPACK:
            # Never a bigger hole than needed anywhere in the pool: a free half is not split by a
            # stray eighth while a smaller hole exists; among equal holes the fullest GPU.
            holes = {(d, s): largest_free_buddy(masks[d], s, eighths) for d, s in fits}
            smallest = min(holes.values())
            assert holes[(choice.device_id, choice.slot_start)] == smallest
            fullest = max(masks[d].bit_count() for (d, s), h in holes.items() if h == smallest)
            assert mask.bit_count() == fullest
        if kind == "slice" and policy == SPREAD:
            assert mask.bit_count() == min(masks[d].bit_count() for d, _s in fits)
            assert choice.slot_start == BEST_START[(mask, eighths)]
        if kind == "whole" and any(classes[d] == EXCLUSIVE for d, _s in fits):
            assert classes[choice.device_id] == EXCLUSIVE
        assert not mask & block_mask(choice.slot_start, choice.slot_count)
        masks[choice.device_id] |= block_mask(choice.slot_start, choice.slot_count)
        index.occupy(choice)
        held.append(choice)
        assert all(index.mask(d) == masks[d] for d in classes)
    # Held blocks never overlap: they add up to exactly the used slots.
    assert sum(c.slot_count for c in held) == sum(m.bit_count() for m in masks.values())


@settings(max_examples=200, deadline=None)
@given(mask=st.integers(0, 255), count=st.sampled_from([1, 2, 4]))
def test_the_best_block_sits_in_the_smallest_free_buddy(mask, count):
    starts = aligned_starts(mask, count)
    best = BEST_START[(mask, count)]
    if starts:
        assert largest_free_buddy(mask, best, count) == min(
            largest_free_buddy(mask, s, count) for s in starts
        )


# --- the database half -------------------------------------------------------------------------------


@pytest.fixture
def a100(db, monkeypatch, settings):
    no_start_task(monkeypatch)
    settings.QUOTA_DEFAULT_MAX_EIGHTHS = settings.QUOTA_DEFAULT_MAX_SESSIONS = 1000
    return catalog_make(A100)


def test_a_launch_takes_an_aligned_block_and_records_it(a100):
    gpu = gpu_make(node_make(), a100)
    session = launch(user_make(), profile="1/4")
    assert session.state == Session.State.PLACING
    allocation = Allocation.objects.get(session=session)
    assert (allocation.device_id, allocation.slot_start, allocation.slot_count) == (gpu.id, 0, 2)
    assert (session.device_id, session.slot_start, session.slot_count) == (gpu.id, 0, 2)
    assert session.node_id == gpu.node_id and session.sharing_policy == gpu.sharing_policy
    assert sorted(slot_pairs()) == [(gpu.id, 0), (gpu.id, 1)]


def test_slices_fill_a_gpu_without_breaking_its_free_half(a100):
    gpu = gpu_make(node_make(), a100)
    user = user_make()
    launch(user, profile="1/8")
    launch(user, profile="1/4")
    launch(user, profile="1/8")
    assert used_masks() == {gpu.id: 0b0000_1111}
    assert launch(user, profile="1/2").slot_start == 4


def test_only_healthy_devices_on_active_nodes_are_used(a100):
    for state in (Node.State.CORDONED, Node.State.DRAINING, Node.State.DOWN):
        gpu_make(node_make(state=state), a100)
    active = node_make()
    for health in (Device.Health.LOST, Device.Health.MISSING):
        gpu_make(active, a100, health=health)
    user = user_make()
    assert launch(user, profile="1/8").state == Session.State.QUEUED
    assert slot_pairs() == []
    good = gpu_make(active, a100)
    assert launch(user, profile="1/8").device_id == good.id


def test_whole_cards_only_on_fully_free_gpus(a100):
    node = node_make()
    gpus = {gpu_make(node, a100).id, gpu_make(node, a100).id}
    user = user_make()
    used = launch(user, profile="1/8").device_id
    (free,) = gpus - {used}
    whole = launch(user, profile="whole")
    assert (whole.device_id, whole.slot_start, whole.slot_count, whole.sharing_policy) == (
        free,
        0,
        8,
        "exclusive",
    )
    assert launch(user, profile="whole").state == Session.State.QUEUED
    assert used_masks() == {used: 0b1, free: 0xFF}


def test_whole_prefers_exclusive_gpus_and_slices_never_take_them(a100):
    node = node_make()
    exclusive = gpu_make(node, a100, sharing=Device.Sharing.EXCLUSIVE)
    user = user_make()
    assert launch(user, profile="1/8").state == Session.State.QUEUED
    shared = gpu_make(node, a100)
    assert launch(user, profile="whole").device_id == exclusive.id
    assert launch(user, profile="1/8").device_id == shared.id


def test_mig_profiles_only_onto_matching_free_mig_devices(a100):
    node = node_make()
    parent = gpu_make(node, a100, mig_mode=True)
    small = mig_make(parent, "1g.10gb")
    mig_make(parent, "2g.20gb")
    user = user_make()
    session = launch(user, profile="1g.10gb")
    assert (session.device_id, session.sharing_policy) == (small.id, "exclusive")
    assert launch(user, profile="1g.10gb").state == Session.State.QUEUED  # the only one is taken
    assert launch(user, profile="3g.40gb").state == Session.State.QUEUED  # no device of that profile
    # A GPU in MIG mode takes neither whole cards nor slices.
    assert launch(user, profile="1/8").state == Session.State.QUEUED
    assert set(used_masks()) == {small.id}


def test_mig_devices_under_an_unhealthy_parent_are_not_used(a100):
    parent = gpu_make(node_make(), a100, mig_mode=True)
    mig_make(parent, "1g.10gb")
    Device.objects.filter(id=parent.id).update(health=Device.Health.LOST)
    assert launch(user_make(), profile="1g.10gb").state == Session.State.QUEUED


@pytest.mark.parametrize(("policy", "same_gpu"), [("binpack", True), ("spread", False)])
def test_binpack_stacks_and_spread_spreads(a100, policy, same_gpu):
    a100.placement_policy = policy
    a100.save()
    node = node_make()
    gpu_make(node, a100)
    gpu_make(node, a100)
    user = user_make()
    first, second = launch(user), launch(user)
    assert (first.device_id == second.device_id) is same_gpu


def test_freed_slots_are_placed_again(a100):
    gpu = gpu_make(node_make(), a100)
    user = user_make()
    whole = launch(user, profile="whole")
    assert launch(user, profile="1/8").state == Session.State.QUEUED
    assert allocation_free(session_id=whole.id) is True
    assert allocation_free(session_id=whole.id) is False
    assert launch(user, profile="1/8").device_id == gpu.id


def test_a_block_taken_since_the_read_is_not_given_again(a100):
    gpu = gpu_make(node_make(), a100)
    user = user_make()
    profiles_ensure()
    first, second = session_row(user, model=a100), session_row(user, model=a100)
    eligible = placement._eligible_devices(a100, Request(A100, "slice", 1))
    assert placement._try_take(first.id, eligible, Choice(gpu.id, 3, 1), skip_locked=True) is not None
    assert placement._try_take(second.id, eligible, Choice(gpu.id, 3, 1), skip_locked=True) is None
    assert placement._try_take(second.id, eligible, Choice(gpu.id, 2, 2), skip_locked=True) is None
    assert not Allocation.objects.filter(session=second).exists()
    assert slot_pairs() == [(gpu.id, 3)]


def test_the_database_refuses_a_slot_twice(a100):
    gpu = gpu_make(node_make(), a100)
    user = user_make()
    taken = launch(user, profile="1/8")
    other = session_row(user, model=a100)
    with pytest.raises(IntegrityError), transaction.atomic():
        allocation = Allocation.objects.create(session=other, device=gpu, slot_start=0, slot_count=1)
        AllocationSlot.objects.create(allocation=allocation, device=gpu, slot=0)
    assert taken.slot_start == 0
    with pytest.raises(IntegrityError), transaction.atomic():
        Allocation.objects.create(session=other, device=gpu, slot_start=8, slot_count=1)
    with pytest.raises(IntegrityError), transaction.atomic():
        Allocation.objects.create(session=other, device=gpu, slot_start=0, slot_count=3)


ACTIONS = st.lists(
    st.one_of(
        st.sampled_from(["whole", "1/2", "1/4", "1/8", "1g.10gb"]).map(lambda p: ("launch", p)),
        st.integers(0, 100).map(lambda i: ("free", i)),
    ),
    min_size=1,
    max_size=30,
)


@pytest.mark.django_db
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(actions=ACTIONS, policy=st.sampled_from(["binpack", "spread"]))
def test_the_database_places_as_the_in_process_index_decides(monkeypatch, actions, policy):
    """Launches and frees through the service agree step by step with a FreeIndex over the same fleet,
    and the slots the database holds are exactly those of the live allocations."""
    no_start_task(monkeypatch)
    with transaction.atomic():
        model = catalog_make(A100, policy=policy)
        node = node_make()
        shared = [gpu_make(node, model) for _ in range(3)]
        exclusive = gpu_make(node, model, sharing=Device.Sharing.EXCLUSIVE)
        mig = mig_make(gpu_make(node, model, mig_mode=True), "1g.10gb")
        index = FreeIndex()
        for gpu in shared:
            index.add(gpu.id, gpu_model=A100, device_class=SHARED, mask=0)
        index.add(exclusive.id, gpu_model=A100, device_class=EXCLUSIVE, mask=0)
        index.add(mig.id, gpu_model=A100, device_class="mig:1g.10gb", mask=0)
        user = user_make()
        live: list[Session] = []
        for action, arg in actions:
            if action == "free":
                if live:
                    session = live.pop(arg % len(live))
                    allocation_free(session_id=session.id)
                    index.release(Choice(session.device_id, session.slot_start, session.slot_count))
                continue
            session = session_row(user, profile=arg, model=model)
            expected = index.choose(placement.request_for(gpu_model=model, profile=session.profile), policy)
            allocation = allocation_place(session_id=session.id, gpu_model=model, profile=session.profile)
            if expected is None:
                assert allocation is None
                continue
            # An equally good pick: a device in the same state, the same block (ties go to any of them).
            taken = Choice(allocation.device_id, allocation.slot_start, allocation.slot_count)
            assert index.mask(taken.device_id) == index.mask(expected.device_id)
            assert (taken.slot_start, taken.slot_count) == (expected.slot_start, expected.slot_count)
            index.occupy(taken)
            session.device_id, session.slot_start, session.slot_count = (
                taken.device_id,
                taken.slot_start,
                taken.slot_count,
            )
            live.append(session)
        held = sorted(
            (s.device_id, slot) for s in live for slot in range(s.slot_start, s.slot_start + s.slot_count)
        )
        assert sorted(slot_pairs()) == held
        transaction.set_rollback(True)


# --- multi-GPU: N whole GPUs of one node ----------------------------------------------------------------


def _nodes(*nodes: dict[str, int], used: frozenset[int] = frozenset(), exclusive=frozenset()) -> FreeIndex:
    """An index of nodes given as {group: GPUs}; device ids count from 1 in order; ``used`` are full."""
    index, device_id = FreeIndex(), 0
    for node, groups in enumerate(nodes, start=1):
        for group, gpus in groups.items():
            for _ in range(gpus):
                device_id += 1
                cls = EXCLUSIVE if device_id in exclusive else SHARED
                mask = 0xFF if device_id in used else 0
                index.add(device_id, gpu_model=M, device_class=cls, mask=mask, node=node, group=group)
    return index


def _gpus(n: int) -> Request:
    return Request(M, "whole", gpu_count=n)


def test_n_gpus_go_to_the_group_with_exactly_enough_free():
    index = _nodes({"a": 4, "b": 4}, {"": 2})  # devices 1-4, 5-8 on node 1; 9-10 on node 2
    assert index.choose(_gpus(2)).devices == (9, 10)
    assert index.choose(_gpus(4)).devices in ((1, 2, 3, 4), (5, 6, 7, 8))
    assert index.choose(_gpus(8)).devices == tuple(range(1, 9))


def test_n_gpus_take_the_group_with_the_fewest_spare_before_a_bigger_one():
    index = _nodes({"a": 4, "b": 3}, used=frozenset({1}))  # group a: 3 free, group b: 3 free
    index.occupy(Choice(5, 0, 8))  # group b: 2 free
    assert index.choose(_gpus(2)).devices == (6, 7)
    assert set(index.choose(_gpus(3)).devices) == {2, 3, 4}


def test_n_gpus_across_groups_use_the_fewest_groups():
    index = _nodes({"a": 4, "b": 2, "c": 2}, used=frozenset({1, 5, 7}))  # free: a 3, b 1, c 1
    choice = index.choose(_gpus(4))
    assert set(choice.devices) >= {2, 3, 4} and len(choice.devices) == 4


def test_n_gpus_never_span_nodes_and_never_take_a_used_gpu():
    index = _nodes({"": 2}, {"": 2}, {"": 4}, used=frozenset({5, 6, 7}))
    assert index.choose(_gpus(4)) is None
    assert index.choose(_gpus(2)).devices in ((1, 2), (3, 4))
    assert index.choose(_gpus(8)) is None


def test_n_gpus_take_exclusive_gpus_of_a_group_first():
    index = _nodes({"": 4}, exclusive=frozenset({3, 4}))
    assert index.choose(_gpus(2)).devices == (3, 4)


def test_n_gpus_occupy_and_release_every_device():
    index = _nodes({"": 4})
    choice = index.choose(_gpus(4))
    index.occupy(choice)
    assert [index.mask(d) for d in range(1, 5)] == [0xFF] * 4
    assert index.choose(Request(M, "whole")) is None
    index.release(choice)
    assert index.choose(_gpus(4)).devices == (1, 2, 3, 4)


NODE_SHAPES = st.lists(
    st.lists(st.integers(1, 4), min_size=1, max_size=3).filter(lambda g: sum(g) <= 8), min_size=1, max_size=4
)
MULTI_OPS = st.lists(
    st.one_of(
        st.sampled_from([1, 2, 4, 8]).map(lambda n: ("place", n)),
        st.just(("slice", 2)),
        st.integers(0, 1000).map(lambda i: ("free", i)),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(shapes=NODE_SHAPES, ops=MULTI_OPS)
def test_n_gpus_stay_on_one_node_prefer_one_group_and_never_overlap(shapes, ops):
    index, where, device_id = FreeIndex(), {}, 0
    for node, groups in enumerate(shapes, start=1):
        for group, gpus in enumerate(groups):
            for _ in range(gpus):
                device_id += 1
                where[device_id] = (node, str(group))
                index.add(device_id, gpu_model=M, device_class=SHARED, mask=0, node=node, group=str(group))
    masks, held = dict.fromkeys(where, 0), []
    for op, n in ops:
        if op == "free":
            if held:
                choice = held.pop(n % len(held))
                index.release(choice)
                for d in choice.devices:
                    masks[d] &= ~block_mask(choice.slot_start, choice.slot_count)
            continue
        request = _gpus(n) if op == "place" else _slice(n)
        free_whole = [d for d in where if masks[d] == 0]
        free_in: dict = {}
        for d in free_whole:
            free_in.setdefault(where[d], []).append(d)
        on_node: dict = {}
        for d in free_whole:
            on_node[where[d][0]] = on_node.get(where[d][0], 0) + 1
        choice = index.choose(request)
        if op == "slice":
            if choice is not None:
                held.append(choice)
                index.occupy(choice)
                masks[choice.device_id] |= block_mask(choice.slot_start, choice.slot_count)
            continue
        if max(on_node.values(), default=0) < n:
            assert choice is None
            continue
        assert choice is not None and len(set(choice.devices)) == n
        assert all(masks[d] == 0 for d in choice.devices)
        assert len({where[d][0] for d in choice.devices}) == 1  # one node
        groups_with_room = [len(ds) for ds in free_in.values() if len(ds) >= n]
        if groups_with_room and n > 1:  # one group, the one with the fewest spare (one GPU: as before)
            assert len({where[d] for d in choice.devices}) == 1
            assert len(free_in[where[choice.device_id]]) == min(groups_with_room)
        index.occupy(choice)
        for d in choice.devices:
            masks[d] = 0xFF
        held.append(choice)
        assert all(index.mask(d) == masks[d] for d in where)
    assert sum(c.slot_count * len(c.devices) for c in held) == sum(m.bit_count() for m in masks.values())


def _group_node(model, groups: dict[str, int]) -> tuple[Node, list[Device]]:
    node = node_make()
    devices = []
    for group, gpus in groups.items():
        for _ in range(gpus):
            device = gpu_make(node, model, index=len(devices))
            Device.objects.filter(id=device.id).update(topology_group=group)
            devices.append(device)
    return node, devices


def test_a_2x_launch_holds_two_gpus_of_one_group_all_of_their_slots(a100):
    _node, devices = _group_node(a100, {"nvlink-0": 4, "nvlink-1": 2})
    user = user_make()
    session = launch(user, profile="2x")
    held = session.gpu_devices()
    assert [d.id for d in held] == [devices[4].id, devices[5].id]  # the group with exactly two free
    assert session.device_id == held[0].id and session.slot_count == 8
    assert sorted(slot_pairs()) == [(d.id, s) for d in held for s in range(8)]
    assert session.price_micros_per_hour == 2 * launch(user, profile="whole").price_micros_per_hour
    assert allocation_free(session_id=session.id) is True
    assert not AllocationSlot.objects.filter(device__in=held).exists()


def test_a_multi_gpu_take_is_all_or_nothing(a100):
    _node, devices = _group_node(a100, {"": 2})
    user = user_make()
    profiles_ensure()
    taken = launch(user, profile="1/8")  # one eighth of one of the two
    other = session_row(user, model=a100, profile="2x")
    eligible = placement._eligible_devices(a100, Request(A100, "whole", gpu_count=2))
    both = Choice(devices[0].id, 0, 8, (devices[0].id, devices[1].id))
    assert placement._try_take(other.id, eligible, both, skip_locked=True) is None
    assert not Allocation.objects.filter(session=other).exists()
    assert slot_pairs() == [(taken.device_id, taken.slot_start)]


def test_n_gpus_never_on_an_excluded_node(a100):
    node, _devices = _group_node(a100, {"": 2})
    user = user_make()
    profiles_ensure()
    session = session_row(user, model=a100, profile="2x")
    two = session.profile
    assert (
        allocation_place(session_id=session.id, gpu_model=a100, profile=two, excluded_nodes=[node.id]) is None
    )
    assert allocation_place(session_id=session.id, gpu_model=a100, profile=two) is not None
