"""Placement: which device and which slots a request gets.

The decision is a pure in-process function over a ``FreeIndex`` (devices bucketed by their 8-bit
slot mask), so the service, the property tests and ``bench/placement.py`` run the same code. The
decision half imports nothing from Django's apps, so the bench runs it in a bare interpreter; the
database half imports the models where it uses them.

- ``whole`` takes a fully free physical GPU (exclusive GPUs first, so shared ones stay for slices);
- a slice of ``s`` eighths takes an aligned block (buddy allocation: a 1/4 starts at 0, 2, 4 or 6) on
  a GPU in a shared policy. ``binpack`` (the default) takes the block inside the smallest free buddy
  block anywhere in the pool, so a free half (or a free card) is never split while a smaller hole
  would do; among equal holes, the most used GPU. ``spread`` takes the least used GPU, and on it the
  block inside the smallest free buddy block;
- a MIG profile takes a free MIG device of that profile.

A decision costs at most 256 bucket look-ups, whatever the fleet size.

``allocation_place`` is the database half: it reads candidates without locks (before the caller's
transaction, where it can), then tries them in preference order, each by ``SELECT … FOR UPDATE SKIP
LOCKED`` on the device and one insert of the allocation and its slots that takes nothing when the block
is taken, in a savepoint that gives the lock back on a miss; after a few rounds it falls back to locking
every fitting candidate in id order (never a deadlock: the only device locks waited for are taken in one
order). The unique (device, slot) constraint is the final word.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

SLOTS_PER_GPU = 8  # provisioner.models.SLOTS_PER_GPU; a test holds the two equal
FULL = (1 << SLOTS_PER_GPU) - 1
SLICE_SIZES = (1, 2, 4)
EXCLUSIVE = "exclusive"
SHARED = "shared"
BINPACK = "binpack"
SPREAD = "spread"
WHOLE = "whole"
SLICE = "slice"
MIG = "mig"


def block_mask(start: int, count: int) -> int:
    return ((1 << count) - 1) << start


def largest_free_buddy(mask: int, start: int, count: int) -> int:
    """The size of the largest aligned, fully free block that contains [start, start+count)."""
    size = count
    while size < SLOTS_PER_GPU:
        bigger = size * 2
        base = start - start % bigger
        if mask & block_mask(base, bigger):
            break
        size = bigger
    return size


def aligned_starts(mask: int, count: int) -> list[int]:
    """The starts of every free aligned block of ``count`` slots in ``mask``."""
    return [s for s in range(0, SLOTS_PER_GPU, count) if not mask & block_mask(s, count)]


def _best_start(mask: int, count: int) -> int | None:
    """The free aligned block inside the smallest free buddy block (lowest start among equals)."""
    starts = aligned_starts(mask, count)
    if not starts:
        return None
    return min(starts, key=lambda s: (largest_free_buddy(mask, s, count), s))


# (mask, count) → best aligned start, or None when no block fits.
BEST_START = {(m, c): _best_start(m, c) for m in range(FULL + 1) for c in (*SLICE_SIZES, SLOTS_PER_GPU)}


def _order(count: int, policy: str) -> tuple[tuple[int, int], ...]:
    """(mask, start) pairs of every mask that fits ``count``, in the policy's preference order."""
    fitting = [m for m in range(FULL + 1) if BEST_START[(m, count)] is not None]

    def hole(m: int) -> int:
        return largest_free_buddy(m, BEST_START[(m, count)], count)

    if policy == SPREAD:
        ranked = sorted(fitting, key=lambda m: (m.bit_count(), hole(m), m))
    else:
        ranked = sorted(fitting, key=lambda m: (hole(m), -m.bit_count(), m))
    return tuple((m, BEST_START[(m, count)]) for m in ranked)


MASK_ORDER = {(c, p): _order(c, p) for c in SLICE_SIZES for p in (BINPACK, SPREAD)}


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
    if kind == MIG:
        return f"mig:{mig_profile}"
    if mig_mode:
        return None
    return EXCLUSIVE if sharing_policy == EXCLUSIVE else SHARED


class FreeIndex:
    """Devices bucketed by (gpu model, class) and then by used-slot mask.

    A bucket is a list with O(1) removal (the last one swaps into the hole), and the pick within a
    bucket is its last device: deterministic, and a device that just changed state is reused first, so
    the others stay as they are. (An insertion-ordered dict would pick the oldest, but taking from the
    front of a dict again and again makes each look-up skip the holes left by the earlier ones.)
    """

    def __init__(self) -> None:
        self._pools: dict[tuple[str, str], dict[int, list[int]]] = {}
        self._where: dict[int, tuple[str, str, int]] = {}
        self._position: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, device_id: int) -> bool:
        return device_id in self._where

    def copy(self) -> FreeIndex:
        """An independent index with the same devices, masks and picks."""
        other = type(self)()
        other._pools = {
            pool: {m: list(b) for m, b in buckets.items()} for pool, buckets in self._pools.items()
        }
        other._where = dict(self._where)
        other._position = dict(self._position)
        return other

    def devices(self) -> Iterator[tuple[int, str, str, int]]:
        """(device id, gpu model, class, mask) of every device."""
        for device_id, (model, cls, mask) in self._where.items():
            yield device_id, model, cls, mask

    def add(self, device_id: int, *, gpu_model: str, device_class: str, mask: int) -> None:
        if device_id in self._where:
            raise ValueError(f"device {device_id} is already indexed")
        bucket = self._pools.setdefault((gpu_model, device_class), {}).setdefault(mask, [])
        self._position[device_id] = len(bucket)
        bucket.append(device_id)
        self._where[device_id] = (gpu_model, device_class, mask)

    def remove(self, device_id: int) -> None:
        model, cls, mask = self._where.pop(device_id)
        pool = self._pools[(model, cls)]
        bucket = pool[mask]
        hole = self._position.pop(device_id)
        last = bucket.pop()
        if last != device_id:
            bucket[hole] = last
            self._position[last] = hole
        if not bucket:
            del pool[mask]

    def mask(self, device_id: int) -> int:
        return self._where[device_id][2]

    def set_mask(self, device_id: int, mask: int) -> None:
        model, cls, _ = self._where[device_id]
        self.remove(device_id)
        self.add(device_id, gpu_model=model, device_class=cls, mask=mask)

    def occupy(self, choice: Choice) -> None:
        taken = block_mask(choice.slot_start, choice.slot_count)
        mask = self.mask(choice.device_id)
        if mask & taken:
            raise ValueError(f"slots {choice} are not free")
        self.set_mask(choice.device_id, mask | taken)

    def release(self, choice: Choice) -> None:
        self.set_mask(
            choice.device_id, self.mask(choice.device_id) & ~block_mask(choice.slot_start, choice.slot_count)
        )

    def _candidates(self, request: Request, policy: str) -> Iterator[tuple[list[int], int, int]]:
        """(bucket of devices, block start, block size), best first; buckets may be empty."""
        model = request.gpu_model
        if request.kind == MIG:
            pools = [self._pools.get((model, f"mig:{request.mig_profile}"))]
        elif request.kind == WHOLE:
            pools = [self._pools.get((model, EXCLUSIVE)), self._pools.get((model, SHARED))]
        else:
            pool = self._pools.get((model, SHARED))
            if pool:
                count = request.eighths
                for mask, start in MASK_ORDER[(count, policy)]:
                    bucket = pool.get(mask)
                    if bucket:
                        yield bucket, start, count
            return
        for pool in pools:
            if pool and (bucket := pool.get(0)):
                yield bucket, 0, SLOTS_PER_GPU

    def choices(self, request: Request, policy: str = BINPACK) -> Iterator[Choice]:
        """Every fitting (device, block), best first: one block per device."""
        for bucket, start, count in self._candidates(request, policy):
            for device_id in reversed(bucket):
                yield Choice(device_id, start, count)

    def choose(self, request: Request, policy: str = BINPACK) -> Choice | None:
        """The best fitting (device, block), or None when nothing fits. Pure; changes nothing."""
        for bucket, start, count in self._candidates(request, policy):
            return Choice(bucket[-1], start, count)
        return None


def request_for(*, gpu_model, profile) -> Request:
    """The request a ``Profile`` of a ``GpuModel`` makes."""
    if profile.kind == MIG:
        return Request(gpu_model.name, MIG, SLOTS_PER_GPU, profile.name)
    if profile.kind == WHOLE:
        return Request(gpu_model.name, WHOLE, SLOTS_PER_GPU)
    return Request(gpu_model.name, SLICE, profile.eighths)


# --- the database half ---------------------------------------------------------------------------
# Its Django imports are inside the functions so that the algorithm above imports without Django set up
# (bench/placement.py runs it bare); no cycle hides behind them (import-linter counts them).


def _eligible_devices(gpu_model, request: Request | None = None):
    """Healthy devices of ``gpu_model`` on active nodes that could take ``request`` (any request when
    None): MIG devices of that profile under a healthy parent, or physical GPUs not in MIG mode (in a
    shared policy for a slice)."""
    from django.db.models import Q

    from provisioner.models import Device, Node

    devices = Device.objects.filter(
        gpu_model=gpu_model, health=Device.Health.OK, node__state=Node.State.ACTIVE
    )
    mig = Q(kind=Device.Kind.MIG, parent__health=Device.Health.OK, parent__mig_mode=True)
    physical = Q(kind=Device.Kind.PHYSICAL, mig_mode=False)
    if request is None:
        return devices.filter(mig | physical)
    if request.kind == MIG:
        return devices.filter(mig, mig_profile=request.mig_profile)
    if request.kind == SLICE:
        return devices.filter(physical, sharing_policy__in=Device.SHARED)
    return devices.filter(physical)


def _with_masks(devices):
    """``devices`` annotated with ``slot_mask``, their used slots as committed now, in the same query."""
    from django.db.models import F, IntegerField, OuterRef, Subquery, Sum, Value
    from django.db.models.functions import Coalesce

    from provisioner.models import AllocationSlot

    bits = Value(1, output_field=IntegerField()).bitleftshift(F("slot"))
    per_device = (
        AllocationSlot.objects.filter(device_id=OuterRef("id"))
        .values("device_id")
        .annotate(mask=Sum(bits, output_field=IntegerField()))
        .values("mask")
    )
    return devices.annotate(slot_mask=Coalesce(Subquery(per_device, output_field=IntegerField()), 0))


@dataclass(frozen=True)
class Slot:
    """Where an eligible device is: what a placement needs besides the device id."""

    node_id: int
    node_name: str
    kind: str
    sharing_policy: str


@dataclass(frozen=True)
class Placed:
    """The block an allocation took: the session row records these."""

    allocation_id: int
    device_id: int
    slot_start: int
    slot_count: int
    where: Slot


def _index_of(gpu_model, devices) -> tuple[FreeIndex, dict[int, Slot]]:
    rows = _with_masks(devices).values_list(
        "id", "node_id", "node__name", "kind", "sharing_policy", "mig_profile", "mig_mode", "slot_mask"
    )
    index = FreeIndex()
    meta: dict[int, Slot] = {}
    for device_id, node_id, node_name, kind, policy, mig_profile, mig_mode, mask in rows.order_by("id"):
        cls = device_class(kind=kind, sharing_policy=policy, mig_profile=mig_profile, mig_mode=mig_mode)
        if cls is None:
            continue
        index.add(device_id, gpu_model=gpu_model.name, device_class=cls, mask=mask)
        meta[device_id] = Slot(node_id, node_name, kind, policy)
    return index, meta


def free_index(*, gpu_model, devices=None) -> tuple[FreeIndex, dict[int, Slot]]:
    """The index of eligible devices of one model as the database has them now (no locks), and for each
    device where it is (``Slot``)."""
    return _index_of(gpu_model, devices if devices is not None else _eligible_devices(gpu_model))


# Insert the allocation and its slots in one statement, unless a slot of the block is taken. Run while
# holding the device's row lock: every placement takes that lock before it inserts slots, so this
# statement's snapshot (taken after the lock was granted) sees every slot committed on the device.
_TAKE = """
WITH allocation AS (
    INSERT INTO provisioner_allocation (session_id, device_id, slot_start, slot_count, created_at)
    SELECT %(session)s, %(device)s, %(start)s, %(count)s, statement_timestamp()
    WHERE NOT EXISTS (
        SELECT 1 FROM provisioner_allocationslot
        WHERE device_id = %(device)s AND slot >= %(start)s AND slot < %(start)s + %(count)s
    )
    RETURNING id
)
INSERT INTO provisioner_allocationslot (allocation_id, device_id, slot)
SELECT allocation.id, %(device)s, slot
FROM allocation, generate_series(%(start)s, %(start)s + %(count)s - 1) AS slot
RETURNING allocation_id
"""


class _Taken(Exception):
    pass


def _try_take(session_id, gpu_model, request: Request, choice: Choice, *, skip_locked: bool) -> int | None:
    """In a savepoint: lock the device (if still eligible), then insert the allocation if the block is
    free; the allocation's id, or None when the device is locked by another placement (with
    ``skip_locked``), no longer eligible, or the block was taken meanwhile. A miss rolls the savepoint
    back, which releases the device's lock: a placement holds no device lock while it tries another.

    The insert runs after the lock is granted, so its snapshot sees every slot committed on the device
    (see ``_TAKE``); the unique (device, slot) constraint is the last word.
    """
    from django.db import IntegrityError, connection, transaction

    try:
        with transaction.atomic():
            locked = (
                _eligible_devices(gpu_model, request)
                .filter(id=choice.device_id)
                .select_for_update(skip_locked=skip_locked, of=("self",), no_key=True)
                .values_list("id", flat=True)
            )
            if not locked:
                return None
            with connection.cursor() as cursor:
                cursor.execute(
                    _TAKE,
                    {
                        "session": session_id,
                        "device": choice.device_id,
                        "start": choice.slot_start,
                        "count": choice.slot_count,
                    },
                )
                rows = cursor.fetchall()
            if not rows:
                raise _Taken
            return rows[0][0]
    except (_Taken, IntegrityError):
        return None


SKIP_LOCKED_ROUNDS = 4
TRIES_PER_ROUND = 16


def allocation_place(*, session_id, gpu_model, profile, index=None) -> Placed | None:
    """Give session ``session_id`` the best free block for ``profile`` on ``gpu_model``, or None when
    nothing fits (the database's committed state has no fitting block, or every fitting one was taken by
    placements that committed first). Call inside the caller's transaction; the session row may be
    inserted later in it (foreign keys are checked at commit). ``index`` is a ``free_index`` read before
    the transaction, used for the first round.

    Locks (``FOR NO KEY UPDATE``, as everywhere in the provisioner: foreign keys are checked at commit
    with ``FOR KEY SHARE`` on the referenced device, which must not wait on a placement): one device row
    at a time with SKIP LOCKED; in the last round, every fitting device in id order, waiting. Never
    deadlocks with another placement or a heartbeat (which locks its node's devices in id order too):
    the only device locks waited for are taken in id order, and a placement that holds a device lock
    waits for no other.
    """
    from provisioner.models import Device

    request = request_for(gpu_model=gpu_model, profile=profile)
    policy = gpu_model.placement_policy
    eligible = _eligible_devices(gpu_model, request)
    for _round in range(SKIP_LOCKED_ROUNDS):
        free, meta = index if index is not None and _round == 0 else _index_of(gpu_model, eligible)
        tried = 0
        for choice in free.choices(request, policy):
            tried += 1
            allocation_id = _try_take(session_id, gpu_model, request, choice, skip_locked=True)
            if allocation_id is not None:
                return Placed(
                    allocation_id,
                    choice.device_id,
                    choice.slot_start,
                    choice.slot_count,
                    meta[choice.device_id],
                )
            if tried >= TRIES_PER_ROUND:  # the rest are re-read next round
                break
        if tried == 0:
            return None
    # Contended: lock every eligible device of the request in id order, then decide on what is locked.
    locked = list(
        eligible.select_for_update(of=("self",), no_key=True).order_by("id").values_list("id", flat=True)
    )
    free, meta = _index_of(gpu_model, Device.objects.filter(id__in=locked))
    choice = free.choose(request, policy)
    if choice is None:
        return None
    allocation_id = _try_take(session_id, gpu_model, request, choice, skip_locked=False)
    if allocation_id is None:
        return None
    return Placed(
        allocation_id, choice.device_id, choice.slot_start, choice.slot_count, meta[choice.device_id]
    )


def cpu_node_pick():
    """A cpu session goes to the active node running the fewest sessions."""
    from django.db.models import Count, Q

    from provisioner.models import Node, Session

    return (
        Node.objects.filter(state=Node.State.ACTIVE)
        .annotate(live=Count("sessions", filter=Q(sessions__state__in=Session.ON_NODE)))
        .order_by("live", "id")
        .first()
    )


def allocation_free(*, session_id) -> bool:
    """Free the session's slots (idempotent). Returns whether anything was freed."""
    from provisioner.models import Allocation

    deleted, _ = Allocation.objects.filter(session_id=session_id).delete()
    return bool(deleted)
