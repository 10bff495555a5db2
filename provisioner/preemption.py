"""Preemption: which interruptible sessions an on-demand request stops when nothing fits.

Beside the placement decision and as pure as it (imports nothing from Django's apps): given the
``FreeIndex`` of a GPU model and the allocations that may be preempted, pick the block an on-demand
request would get by stopping them: on one device, the fewest sessions, and among equal counts the
newest (the least running time lost in all); then the lowest device id and block start, so the choice
is deterministic. An allocation the caller did not list (an on-demand session, an interruptible one
already being stopped for another request, slots held for a waiting request) blocks every block it
touches: it is never chosen.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from provisioner.placement import (
    EXCLUSIVE,
    MIG,
    SHARED,
    SLICE,
    SLOTS_PER_GPU,
    WHOLE,
    FreeIndex,
    Request,
    block_mask,
)


@dataclass(frozen=True)
class Preemptible:
    """An allocation an on-demand request may take by stopping its session."""

    session_id: object
    device_id: int
    slot_start: int
    slot_count: int
    running_seconds: float  # how long the session has run: the newest lose the least

    @property
    def mask(self) -> int:
        return block_mask(self.slot_start, self.slot_count)


def _fits_class(request: Request, device_class: str) -> bool:
    if request.kind == WHOLE:
        return device_class in (EXCLUSIVE, SHARED)
    if request.kind == SLICE:
        return device_class == SHARED
    return request.kind == MIG and device_class == f"mig:{request.mig_profile}"


def _block_size(request: Request) -> int:
    return request.eighths if request.kind == SLICE else SLOTS_PER_GPU


def victims_choose(
    index: FreeIndex, request: Request, preemptible: Iterable[Preemptible]
) -> tuple[Preemptible, ...] | None:
    """The sessions to stop so that ``request`` fits on one device of ``index``, or None when stopping
    any of ``preemptible`` would not make room (or room is free already: place, do not preempt).
    Changes nothing."""
    by_device: dict[int, list[Preemptible]] = defaultdict(list)
    for held in preemptible:
        by_device[held.device_id].append(held)
    where = {
        device_id: (model, cls, mask)
        for device_id, model, cls, mask in index.devices()
        if device_id in by_device
    }
    best: tuple | None = None
    for device_id, held in by_device.items():
        if device_id not in where:
            continue
        model, cls, mask = where[device_id]
        if model != request.gpu_model or not _fits_class(request, cls):
            continue
        size = _block_size(request)
        for start in range(0, SLOTS_PER_GPU, size):
            block = block_mask(start, size)
            victims = tuple(sorted((h for h in held if h.mask & block), key=lambda h: str(h.session_id)))
            freed = 0
            for victim in victims:
                freed |= victim.mask
            if not victims or mask & block & ~freed:
                continue  # free already, or a slot nobody may preempt
            key = (len(victims), sum(v.running_seconds for v in victims), device_id, start)
            if best is None or key < best[0]:
                best = (key, victims)
    return best[1] if best else None
