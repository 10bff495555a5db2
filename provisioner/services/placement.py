"""Placement: which device and which slots a request gets.

The decision is a pure in-process function over a ``FreeIndex`` (devices bucketed by their 8-bit
slot mask), so the service, the property tests and ``bench/placement.py`` run the same code:

- ``whole`` takes a fully free physical GPU (exclusive GPUs first, so shared ones stay for slices);
- a slice of ``s`` eighths takes an aligned block (buddy allocation: a 1/4 starts at 0, 2, 4 or 6) on
  a GPU in a shared policy; of the free blocks it prefers the one inside the smallest free buddy
  block, so a free half is never split while a stray quarter would do;
- a MIG profile takes a free MIG device of that profile;
- ``binpack`` (default) fills the most-used shared GPU first; ``spread`` the least used.

A decision costs at most 256 bucket look-ups, whatever the fleet size.

``allocation_place`` is the database half: it reads candidates without locks, then tries them in
preference order, each under ``SELECT … FOR UPDATE SKIP LOCKED`` in a savepoint, re-reading that
device's slots under the lock; after a few rounds it falls back to locking every fitting candidate in
id order (never a deadlock: the only device locks held are taken in one order). The unique
(device, slot) constraint is the final word.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from django.db import IntegrityError, transaction
from django.db.models import Q

from provisioner.models import (
    SLOTS_PER_GPU,
    Allocation,
    AllocationSlot,
    Device,
    GpuModel,
    Node,
    Profile,
    Session,
)

FULL = (1 << SLOTS_PER_GPU) - 1
EXCLUSIVE = "exclusive"
SHARED = "shared"
BINPACK = "binpack"
SPREAD = "spread"
FIRST_FIT = "first-fit"  # a baseline for the bench only


def block_mask(start: int, count: int) -> int:
    return ((1 << count) - 1) << start


def _largest_free_buddy(mask: int, start: int, count: int) -> int:
    """The size of the largest aligned, fully free block that contains [start, start+count)."""
    size = count
    while size < SLOTS_PER_GPU:
        bigger = size * 2
        base = start - start % bigger
        if mask & block_mask(base, bigger):
            break
        size = bigger
    return size


def _best_start(mask: int, count: int) -> int | None:
    best: tuple[int, int] | None = None
    for start in range(0, SLOTS_PER_GPU, count):
        if mask & block_mask(start, count):
            continue
        key = (_largest_free_buddy(mask, start, count), start)
        if best is None or key < best:
            best = key
    return None if best is None else best[1]


def _first_start(mask: int, count: int) -> int | None:
    for start in range(0, SLOTS_PER_GPU, count):
        if not mask & block_mask(start, count):
            return start
    return None


# (mask, count) → best aligned start, or None when no block fits; and masks by preference per policy.
BEST_START = {(m, c): _best_start(m, c) for m in range(FULL + 1) for c in (1, 2, 4, 8)}
FIRST_START = {(m, c): _first_start(m, c) for m in range(FULL + 1) for c in (1, 2, 4, 8)}


def _order(count: int, policy: str) -> tuple[int, ...]:
    fitting = [m for m in range(FULL + 1) if BEST_START[(m, count)] is not None]
    if policy == SPREAD:
        return tuple(sorted(fitting, key=lambda m: (m.bit_count(), m)))
    # binpack: most used first; among equals, the one whose best block sits in the smallest free buddy
    return tuple(
        sorted(
            fitting,
            key=lambda m: (-m.bit_count(), _largest_free_buddy(m, BEST_START[(m, count)], count), m),
        )
    )


MASK_ORDER = {(c, p): _order(c, p) for c in (1, 2, 4) for p in (BINPACK, SPREAD)}


@dataclass(frozen=True)
class Request:
    """What is asked: ``kind`` whole | slice | mig; ``eighths`` for a slice; ``mig_profile`` for MIG."""

    gpu_model: str
    kind: str
    eighths: int = SLOTS_PER_GPU
    mig_profile: str = ""


@dataclass(frozen=True)
class Choice:
    device_id: int
    slot_start: int
    slot_count: int


def device_class(*, kind: str, sharing_policy: str, mig_profile: str, mig_mode: bool) -> str | None:
    """The bucket a device belongs to, or None when it takes no allocation (a GPU in MIG mode)."""
    if kind == Device.Kind.MIG:
        return f"mig:{mig_profile}"
    if mig_mode:
        return None
    return EXCLUSIVE if sharing_policy == Device.Sharing.EXCLUSIVE else SHARED


class FreeIndex:
    """Devices bucketed by (gpu model, class, used-slot mask). Insertion-ordered buckets make the pick
    within a bucket deterministic (the first added, e.g. the lowest id)."""

    def __init__(self) -> None:
        self._buckets: dict[tuple[str, str, int], dict[int, None]] = {}
        self._where: dict[int, tuple[str, str, int]] = {}

    def __len__(self) -> int:
        return len(self._where)

    def add(self, device_id: int, *, gpu_model: str, device_class: str, mask: int) -> None:
        key = (gpu_model, device_class, mask)
        self._buckets.setdefault(key, {})[device_id] = None
        self._where[device_id] = key

    def remove(self, device_id: int) -> None:
        key = self._where.pop(device_id)
        bucket = self._buckets[key]
        del bucket[device_id]
        if not bucket:
            del self._buckets[key]

    def mask(self, device_id: int) -> int:
        return self._where[device_id][2]

    def set_mask(self, device_id: int, mask: int) -> None:
        model, cls, _ = self._where[device_id]
        self.remove(device_id)
        self.add(device_id, gpu_model=model, device_class=cls, mask=mask)

    def occupy(self, choice: Choice) -> None:
        self.set_mask(
            choice.device_id, self.mask(choice.device_id) | block_mask(choice.slot_start, choice.slot_count)
        )

    def release(self, choice: Choice) -> None:
        self.set_mask(
            choice.device_id, self.mask(choice.device_id) & ~block_mask(choice.slot_start, choice.slot_count)
        )

    def _keys(self, request: Request, policy: str) -> Iterator[tuple[tuple[str, str, int], int, int]]:
        model = request.gpu_model
        if request.kind == "mig":
            yield (model, f"mig:{request.mig_profile}", 0), 0, SLOTS_PER_GPU
        elif request.kind == "whole":
            yield (model, EXCLUSIVE, 0), 0, SLOTS_PER_GPU
            yield (model, SHARED, 0), 0, SLOTS_PER_GPU
        elif policy == FIRST_FIT:
            for mask in range(FULL + 1):
                start = FIRST_START[(mask, request.eighths)]
                if start is not None:
                    yield (model, SHARED, mask), start, request.eighths
        else:
            for mask in MASK_ORDER[(request.eighths, policy)]:
                yield (model, SHARED, mask), BEST_START[(mask, request.eighths)], request.eighths

    def choices(self, request: Request, policy: str = BINPACK) -> Iterator[Choice]:
        """Every fitting (device, block), best first."""
        for key, start, count in self._keys(request, policy):
            for device_id in self._buckets.get(key, ()):
                yield Choice(device_id, start, count)

    def choose(self, request: Request, policy: str = BINPACK) -> Choice | None:
        """The best fitting (device, block), or None when nothing fits. Pure; changes nothing."""
        return next(self.choices(request, policy), None)


class FirstFitIndex(FreeIndex):
    """Baseline for the bench: the lowest-numbered device with any aligned free block (a linear scan)."""

    def __init__(self) -> None:
        super().__init__()
        self._order: dict[int, None] = {}

    def add(self, device_id: int, *, gpu_model: str, device_class: str, mask: int) -> None:
        super().add(device_id, gpu_model=gpu_model, device_class=device_class, mask=mask)
        self._order[device_id] = None

    def choose(self, request: Request, policy: str = FIRST_FIT) -> Choice | None:
        for device_id in self._order:
            model, cls, mask = self._where[device_id]
            if model != request.gpu_model:
                continue
            if request.kind == "whole" and cls in (EXCLUSIVE, SHARED) and mask == 0:
                return Choice(device_id, 0, SLOTS_PER_GPU)
            if request.kind == "slice" and cls == SHARED:
                start = FIRST_START[(mask, request.eighths)]
                if start is not None:
                    return Choice(device_id, start, request.eighths)
            if request.kind == "mig" and cls == f"mig:{request.mig_profile}" and mask == 0:
                return Choice(device_id, 0, SLOTS_PER_GPU)
        return None


def request_for(*, gpu_model: GpuModel, profile: Profile) -> Request:
    if profile.kind == Profile.Kind.MIG:
        return Request(gpu_model.name, "mig", SLOTS_PER_GPU, profile.name)
    if profile.kind == Profile.Kind.WHOLE:
        return Request(gpu_model.name, "whole", SLOTS_PER_GPU)
    return Request(gpu_model.name, "slice", profile.eighths)


# --- the database half ---------------------------------------------------------------------------


def _eligible_devices(gpu_model: GpuModel):
    return Device.objects.filter(
        gpu_model=gpu_model, health=Device.Health.OK, node__state=Node.State.ACTIVE
    ).filter(
        Q(kind=Device.Kind.MIG, parent__health=Device.Health.OK)
        | Q(kind=Device.Kind.PHYSICAL, mig_mode=False)
    )


def _masks(device_ids: Iterable[int]) -> dict[int, int]:
    masks: dict[int, int] = {}
    for device_id, slot in AllocationSlot.objects.filter(device_id__in=list(device_ids)).values_list(
        "device_id", "slot"
    ):
        masks[device_id] = masks.get(device_id, 0) | (1 << slot)
    return masks


def free_index(*, gpu_model: GpuModel, devices=None) -> tuple[FreeIndex, dict[int, tuple[int, str]]]:
    """The index of eligible devices of one model as the database has them now (no locks), and for each
    device its node id and sharing policy."""
    rows = list(
        (devices if devices is not None else _eligible_devices(gpu_model))
        .order_by("id")
        .values_list("id", "node_id", "kind", "sharing_policy", "mig_profile", "mig_mode")
    )
    masks = _masks(r[0] for r in rows)
    index = FreeIndex()
    meta: dict[int, tuple[int, str]] = {}
    for device_id, node_id, kind, policy, mig_profile, mig_mode in rows:
        cls = device_class(kind=kind, sharing_policy=policy, mig_profile=mig_profile, mig_mode=mig_mode)
        if cls is None:
            continue
        index.add(device_id, gpu_model=gpu_model.name, device_class=cls, mask=masks.get(device_id, 0))
        meta[device_id] = (node_id, policy)
    return index, meta


class _Taken(Exception):
    pass


def _try_take(session: Session, choice: Choice, *, skip_locked: bool) -> Allocation | None:
    """In a savepoint: lock the device, re-read its slots, insert the allocation if the block is free."""
    try:
        with transaction.atomic():
            locked = Device.objects.select_for_update(skip_locked=skip_locked, of=("self",)).filter(
                id=choice.device_id, health=Device.Health.OK, node__state=Node.State.ACTIVE
            )
            device = locked.first()
            if device is None:
                return None
            mask = _masks([device.id]).get(device.id, 0)
            if mask & block_mask(choice.slot_start, choice.slot_count):
                raise _Taken
            allocation = Allocation.objects.create(
                session=session, device=device, slot_start=choice.slot_start, slot_count=choice.slot_count
            )
            AllocationSlot.objects.bulk_create(
                AllocationSlot(allocation=allocation, device=device, slot=slot)
                for slot in range(choice.slot_start, choice.slot_start + choice.slot_count)
            )
            return allocation
    except (_Taken, IntegrityError):
        return None


SKIP_LOCKED_ROUNDS = 4


def allocation_place(*, session: Session, gpu_model: GpuModel, profile: Profile) -> Allocation | None:
    """Give ``session`` the best free block for ``profile`` on ``gpu_model``, or None when nothing fits
    (the database's committed state has no fitting block). Call inside the caller's transaction.

    Locks: at most one device row at a time with SKIP LOCKED (each in a savepoint that releases it on a
    miss); in the last round, every fitting device in id order. Never deadlocks with another placement.
    """
    request = request_for(gpu_model=gpu_model, profile=profile)
    policy = gpu_model.placement_policy
    for _round in range(SKIP_LOCKED_ROUNDS):
        index, _meta = free_index(gpu_model=gpu_model)
        tried = 0
        for choice in index.choices(request, policy):
            tried += 1
            allocation = _try_take(session, choice, skip_locked=True)
            if allocation is not None:
                return allocation
            if tried >= 16:  # the rest are re-read next round
                break
        if tried == 0:
            return None
    # Contended: lock every eligible device of the model in id order, then decide on what is locked.
    locked = list(
        _eligible_devices(gpu_model)
        .select_for_update(of=("self",))
        .order_by("id")
        .values_list("id", flat=True)
    )
    index, _meta = free_index(gpu_model=gpu_model, devices=Device.objects.filter(id__in=locked))
    choice = index.choose(request, policy)
    if choice is None:
        return None
    return _try_take(session, choice, skip_locked=False)


def cpu_node_pick() -> Node | None:
    """A cpu session goes to the active node running the fewest sessions."""
    from django.db.models import Count

    return (
        Node.objects.filter(state=Node.State.ACTIVE)
        .annotate(live=Count("sessions", filter=Q(sessions__state__in=Session.ON_NODE)))
        .order_by("live", "id")
        .first()
    )


def allocation_free(*, session_id) -> bool:
    """Free the session's slots (idempotent). Returns whether anything was freed."""
    deleted, _ = Allocation.objects.filter(session_id=session_id).delete()
    return bool(deleted)
