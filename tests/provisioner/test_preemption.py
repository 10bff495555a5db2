"""Preemption's decision (provisioner/preemption.py): which interruptible sessions an on-demand request
stops. Pure: no database."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from provisioner.placement import EXCLUSIVE, FULL, SHARED, FreeIndex, Request, block_mask
from provisioner.preemption import Preemptible, victims_choose

M = "m"
WHOLE = Request(M, "whole")


def _index(*devices: tuple[int, str, int]) -> FreeIndex:
    index = FreeIndex()
    for device_id, cls, mask in devices:
        index.add(device_id, gpu_model=M, device_class=cls, mask=mask)
    return index


def _held(name: str, device_id: int, start: int, count: int, running_seconds: float) -> Preemptible:
    return Preemptible(name, device_id, start, count, running_seconds)


def _names(victims) -> list[str]:
    return sorted(v.session_id for v in victims) if victims else []


def test_fewest_sessions_win_over_newer_ones():
    # device 1: one old whole-card session; device 2: two brand-new halves
    index = _index((1, EXCLUSIVE, FULL), (2, SHARED, FULL))
    held = [
        _held("old", 1, 0, 8, 9_000),
        _held("new-a", 2, 0, 4, 5),
        _held("new-b", 2, 4, 4, 5),
    ]
    assert _names(victims_choose(index, WHOLE, held)) == ["old"]


def test_among_equal_counts_the_newest_are_stopped():
    index = _index((1, EXCLUSIVE, FULL), (2, EXCLUSIVE, FULL), (3, EXCLUSIVE, FULL))
    held = [_held("a", 1, 0, 8, 600), _held("b", 2, 0, 8, 60), _held("c", 3, 0, 8, 6_000)]
    assert _names(victims_choose(index, WHOLE, held)) == ["b"]


def test_a_slice_takes_the_block_of_the_fewest_newest_sessions():
    # a 1/2 on one GPU: the low half holds two eighths and a quarter, the high half one old quarter
    # and one new quarter: the high half costs two sessions, the low three
    mask = FULL
    index = _index((1, SHARED, mask))
    held = [
        _held("e0", 1, 0, 1, 10),
        _held("e1", 1, 1, 1, 10),
        _held("q2", 1, 2, 2, 10),
        _held("q4", 1, 4, 2, 5_000),
        _held("q6", 1, 6, 2, 1),
    ]
    assert _names(victims_choose(index, Request(M, "slice", 4), held)) == ["q4", "q6"]
    assert _names(victims_choose(index, Request(M, "slice", 2), held)) == ["q6"]


def test_never_an_on_demand_session():
    # the only occupant of device 2 is on demand (not listed): device 1's two sessions go instead
    index = _index((1, EXCLUSIVE, FULL), (2, SHARED, FULL))
    held = [_held("a", 1, 0, 4, 1), _held("b", 1, 4, 4, 1)]
    assert _names(victims_choose(index, WHOLE, held)) == ["a", "b"]
    # an on-demand quarter beside an interruptible half: the card cannot be freed whole
    index = _index((1, SHARED, FULL))
    assert victims_choose(index, WHOLE, [_held("half", 1, 0, 4, 1)]) is None


def test_never_a_session_already_being_preempted():
    # "taken" is being stopped for another request: the caller leaves it out, and its slots block
    index = _index((1, SHARED, FULL), (2, SHARED, FULL))
    held = [_held("free-1", 1, 4, 4, 1), _held("other", 2, 0, 8, 9_000)]
    assert _names(victims_choose(index, WHOLE, held)) == ["other"]
    assert victims_choose(index, WHOLE, [_held("free-1", 1, 4, 4, 1)]) is None


def test_nothing_to_preempt_when_room_is_free_or_the_class_does_not_fit():
    held = [_held("a", 1, 0, 8, 1)]
    assert victims_choose(_index((1, EXCLUSIVE, FULL), (2, EXCLUSIVE, 0)), WHOLE, []) is None
    # a slice never goes to an exclusive GPU, nor a request to another model or MIG profile
    assert victims_choose(_index((1, EXCLUSIVE, FULL)), Request(M, "slice", 2), held) is None
    assert victims_choose(_index((1, EXCLUSIVE, FULL)), Request("other", "whole"), held) is None
    assert victims_choose(_index((1, "mig:1g.10gb", FULL)), Request(M, "mig", 8, "2g.20gb"), held) is None
    assert _names(
        victims_choose(_index((1, "mig:1g.10gb", FULL)), Request(M, "mig", 8, "1g.10gb"), held)
    ) == ["a"]


@st.composite
def _fleets(draw):
    """Shared GPUs filled with aligned blocks, each on demand or interruptible."""
    index, held, fixed = FreeIndex(), [], {}
    for device_id in range(draw(st.integers(1, 4))):
        mask, start = 0, 0
        while start < 8:
            size = draw(st.sampled_from([s for s in (1, 2, 4, 8) if start % s == 0 and start + s <= 8]))
            if draw(st.booleans()):
                mask |= block_mask(start, size)
                if draw(st.booleans()):
                    held.append(
                        _held(f"{device_id}:{start}", device_id, start, size, draw(st.integers(0, 99)))
                    )
                else:
                    fixed[device_id] = fixed.get(device_id, 0) | block_mask(start, size)
            start += size
        index.add(device_id, gpu_model=M, device_class=SHARED, mask=mask)
    return index, held, fixed


@given(_fleets(), st.sampled_from([1, 2, 4, 8]))
def test_the_chosen_victims_free_a_fitting_block_and_no_smaller_set_would(fleet, eighths):
    index, held, fixed = fleet
    request = Request(M, "slice", eighths) if eighths < 8 else WHOLE
    victims = victims_choose(index, request, held)
    best = None
    for device_id, _model, _cls, mask in index.devices():
        for start in range(0, 8, eighths):
            block = block_mask(start, eighths)
            if not mask & block or fixed.get(device_id, 0) & block:
                continue
            count = sum(1 for h in held if h.device_id == device_id and h.mask & block)
            best = count if best is None else min(best, count)
    if best is None:
        assert victims is None
        return
    assert victims is not None and len(victims) == best
    device_id = victims[0].device_id
    freed = index.mask(device_id)
    for victim in victims:
        assert victim.device_id == device_id
        freed &= ~victim.mask
    assert freed & fixed.get(device_id, 0) == fixed.get(device_id, 0)  # on-demand slots untouched
    assert any(not freed & block_mask(s, eighths) for s in range(0, 8, eighths))
