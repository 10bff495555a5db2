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
- a MIG profile takes a free MIG device of that profile;
- ``N`` whole GPUs (``2x``, ``4x``, ``8x``) take N fully free physical GPUs of one node: a topology group
  (NVLink domain or PCIe switch, as the agent reports it; a node without topology is one group) with
  exactly N free first, then the group with the fewest spare; where no group has N, the node with the
  fewest free that has N, taking its fullest groups first (the fewest groups). Exclusive GPUs first
  within a group.

A decision costs at most 256 bucket look-ups, whatever the fleet size (a multi-GPU one: one look-up per
free count a group or a node can have, at most the GPUs of a node).

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
from functools import cache

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
    """What is asked: ``kind`` whole | slice | mig; ``eighths`` for a slice; ``mig_profile`` for MIG;
    ``gpu_count`` whole GPUs of one node (whole only)."""

    gpu_model: str
    kind: str
    eighths: int = SLOTS_PER_GPU
    mig_profile: str = ""
    gpu_count: int = 1


@dataclass(frozen=True)
class Choice:
    """A block of one device; a multi-GPU choice lists all its devices in ``device_ids`` (the first is
    ``device_id``) and takes every slot of each."""

    device_id: int
    slot_start: int
    slot_count: int
    device_ids: tuple[int, ...] = ()

    @property
    def devices(self) -> tuple[int, ...]:
        return self.device_ids or (self.device_id,)


def device_class(*, kind: str, sharing_policy: str, mig_profile: str, mig_mode: bool) -> str | None:
    """The bucket a device belongs to, or None when it takes no allocation (a GPU in MIG mode)."""
    if kind == MIG:
        return f"mig:{mig_profile}"
    if mig_mode:
        return None
    return EXCLUSIVE if sharing_policy == EXCLUSIVE else SHARED


Place = tuple[int, str]  # (node, topology group)


def _move(buckets: dict[int, dict], key, before: int, after: int) -> None:
    """Move ``key`` from the ``before`` bucket to the ``after`` bucket (0: none) of ``buckets``."""
    if before:
        bucket = buckets[before]
        del bucket[key]
        if not bucket:
            del buckets[before]
    if after:
        bucket = buckets.get(after)
        if bucket is None:
            buckets[after] = {key: None}
        else:
            bucket[key] = None


class _Groups:
    """Fully free physical GPUs by node and topology group, for multi-GPU requests: each group and each
    node bucketed by how many free GPUs it has, so a decision looks up free counts, not devices."""

    def __init__(self) -> None:
        self._home: dict[int, tuple[str, int, str]] = {}  # device → (model, node, group)
        self._free: dict[tuple[str, int, str], dict[int, bool]] = {}  # free device → exclusive
        self._groups_at: dict[str, dict[int, dict[Place, None]]] = {}  # model → free count → groups
        self._nodes_at: dict[str, dict[int, dict[int, None]]] = {}  # model → free count → nodes
        self._node_free: dict[tuple[str, int], int] = {}
        self._node_groups: dict[tuple[str, int], dict[str, None]] = {}

    def copy(self) -> _Groups:
        other = _Groups()
        other._home = dict(self._home)
        other._free = {k: dict(v) for k, v in self._free.items()}
        other._groups_at = {m: {n: dict(b) for n, b in at.items()} for m, at in self._groups_at.items()}
        other._nodes_at = {m: {n: dict(b) for n, b in at.items()} for m, at in self._nodes_at.items()}
        other._node_free = dict(self._node_free)
        other._node_groups = {k: dict(v) for k, v in self._node_groups.items()}
        return other

    def place(self, device_id: int, *, gpu_model: str, node: int, group: str) -> None:
        self._home[device_id] = (gpu_model, node, group)
        self._node_groups.setdefault((gpu_model, node), {})[group] = None

    def unplace(self, device_id: int) -> None:
        if device_id in self._home:
            self.busy(device_id)
            del self._home[device_id]

    def busy(self, device_id: int) -> None:
        """The device is no longer fully free (nothing when it was not)."""
        home = self._home[device_id]
        if device_id in self._free.get(home, ()):
            self._count(home, -1)
            del self._free[home][device_id]

    def free(self, device_id: int, *, exclusive: bool) -> None:
        home = self._home[device_id]
        self._count(home, +1)
        self._free.setdefault(home, {})[device_id] = exclusive

    def _count(self, home: tuple[str, int, str], change: int) -> None:
        """Move the device's group and node to their new free counts (before the device's own entry in
        ``_free`` changes)."""
        model, node, group = home
        in_group = len(self._free.get(home, ()))
        _move(self._groups_at.setdefault(model, {}), (node, group), in_group, in_group + change)
        on_node = self._node_free.get((model, node), 0)
        _move(self._nodes_at.setdefault(model, {}), node, on_node, on_node + change)
        self._node_free[(model, node)] = on_node + change

    def _take(self, model: str, node: int, groups: list[str], count: int) -> Choice:
        """``count`` free GPUs of ``node`` from ``groups`` in that order, exclusive ones first."""
        taken: list[int] = []
        for group in groups:
            free = self._free.get((model, node, group), {})
            taken += sorted(free, key=lambda d: (not free[d], d))[: count - len(taken)]
            if len(taken) == count:
                break
        ids = tuple(sorted(taken))
        return Choice(ids[0], 0, SLOTS_PER_GPU, ids)

    def choices(self, model: str, count: int) -> Iterator[Choice]:
        """Sets of ``count`` free GPUs of one node, best first: inside one group (the fewest spare
        first), then across the groups of the node with the fewest spare (its fullest groups first)."""
        groups_at = self._groups_at.get(model, {})
        for free in sorted(n for n in groups_at if n >= count):
            for node, group in reversed(groups_at[free]):
                yield self._take(model, node, [group], count)
        nodes_at = self._nodes_at.get(model, {})
        for free in sorted(n for n in nodes_at if n >= count):
            for node in reversed(nodes_at[free]):
                groups = sorted(
                    self._node_groups[(model, node)], key=lambda g: -len(self._free.get((model, node, g), ()))
                )
                if len(self._free.get((model, node, groups[0]), ())) < count:  # else offered above
                    yield self._take(model, node, groups, count)


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
        self._groups = _Groups()

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
        other._groups = self._groups.copy()
        return other

    def devices(self) -> Iterator[tuple[int, str, str, int]]:
        """(device id, gpu model, class, mask) of every device."""
        for device_id, (model, cls, mask) in self._where.items():
            yield device_id, model, cls, mask

    def add(
        self, device_id: int, *, gpu_model: str, device_class: str, mask: int, node: int = 0, group: str = ""
    ) -> None:
        """Index a device; ``node`` and ``group`` (its topology group there) place a physical GPU for
        multi-GPU requests."""
        if device_id in self._where:
            raise ValueError(f"device {device_id} is already indexed")
        self._bucket_add(device_id, gpu_model, device_class, mask)
        if device_class in (EXCLUSIVE, SHARED):
            self._groups.place(device_id, gpu_model=gpu_model, node=node, group=group)
            if mask == 0:
                self._groups.free(device_id, exclusive=device_class == EXCLUSIVE)

    def remove(self, device_id: int) -> None:
        self._groups.unplace(device_id)
        self._bucket_remove(device_id)

    def _bucket_add(self, device_id: int, model: str, cls: str, mask: int) -> None:
        bucket = self._pools.setdefault((model, cls), {}).setdefault(mask, [])
        self._position[device_id] = len(bucket)
        bucket.append(device_id)
        self._where[device_id] = (model, cls, mask)

    def _bucket_remove(self, device_id: int) -> tuple[str, str, int]:
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
        return model, cls, mask

    def mask(self, device_id: int) -> int:
        return self._where[device_id][2]

    def set_mask(self, device_id: int, mask: int) -> None:
        model, cls, before = self._bucket_remove(device_id)
        self._bucket_add(device_id, model, cls, mask)
        if cls in (EXCLUSIVE, SHARED) and (before == 0) != (mask == 0):  # became fully free, or stopped
            if mask == 0:
                self._groups.free(device_id, exclusive=cls == EXCLUSIVE)
            else:
                self._groups.busy(device_id)

    def occupy(self, choice: Choice) -> None:
        taken = block_mask(choice.slot_start, choice.slot_count)
        if any(self.mask(d) & taken for d in choice.devices):
            raise ValueError(f"slots {choice} are not free")
        for device_id in choice.devices:
            self.set_mask(device_id, self.mask(device_id) | taken)

    def release(self, choice: Choice) -> None:
        freed = ~block_mask(choice.slot_start, choice.slot_count)
        for device_id in choice.devices:
            self.set_mask(device_id, self.mask(device_id) & freed)

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
        """Every fitting (device, block), best first: one block per device (a multi-GPU request: sets of
        devices, best first; a device may be in several)."""
        if request.gpu_count > 1:
            yield from self._groups.choices(request.gpu_model, request.gpu_count)
            return
        for bucket, start, count in self._candidates(request, policy):
            for device_id in reversed(bucket):
                yield Choice(device_id, start, count)

    def choose(self, request: Request, policy: str = BINPACK) -> Choice | None:
        """The best fitting (device, block), or None when nothing fits. Pure; changes nothing."""
        if request.gpu_count > 1:
            return next(self._groups.choices(request.gpu_model, request.gpu_count), None)
        for bucket, start, count in self._candidates(request, policy):
            return Choice(bucket[-1], start, count)
        return None


def request_for(*, gpu_model, profile) -> Request:
    """The request a ``Profile`` of a ``GpuModel`` makes."""
    if profile.kind == MIG:
        return Request(gpu_model.name, MIG, SLOTS_PER_GPU, profile.name)
    if profile.kind == WHOLE:
        return Request(gpu_model.name, WHOLE, SLOTS_PER_GPU, gpu_count=profile.gpu_count)
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
    """The block an allocation took: the session row records these. ``device_ids``: every device of a
    multi-GPU allocation (empty for one device)."""

    allocation_id: int
    device_id: int
    slot_start: int
    slot_count: int
    where: Slot
    device_ids: tuple[int, ...] = ()


_INDEX_COLUMNS = (
    "id",
    "node_id",
    "node__name",
    "kind",
    "sharing_policy",
    "mig_profile",
    "mig_mode",
    "topology_group",
    "slot_mask",
)


def _index_rows(devices):
    return _with_masks(devices).values_list(*_INDEX_COLUMNS).order_by("id")


@cache
def _eligible_rows():
    """Every launch reads the index of its model's eligible devices before its transaction: compiled
    once per process (made on first use: this module imports no Django app at import)."""
    from core.compiled import Lookup

    return Lookup(lambda model_id: _index_rows(_eligible_devices(model_id)), key_types=(int,), many=True)


def _index_of(gpu_model, devices) -> tuple[FreeIndex, dict[int, Slot]]:
    return _index_from(gpu_model, _index_rows(devices))


def _index_from(gpu_model, rows) -> tuple[FreeIndex, dict[int, Slot]]:
    index = FreeIndex()
    meta: dict[int, Slot] = {}
    for row in rows:
        device_id, node_id, node_name, kind, policy, mig_profile, mig_mode, group, mask = row
        cls = device_class(kind=kind, sharing_policy=policy, mig_profile=mig_profile, mig_mode=mig_mode)
        if cls is None:
            continue
        index.add(device_id, gpu_model=gpu_model.name, device_class=cls, mask=mask, node=node_id, group=group)
        meta[device_id] = Slot(node_id, node_name, kind, policy)
    return index, meta


def free_index(*, gpu_model, devices=None) -> tuple[FreeIndex, dict[int, Slot]]:
    """The index of eligible devices of one model as the database has them now (no locks), and for each
    device where it is (``Slot``)."""
    if devices is None:
        return _index_from(gpu_model, _eligible_rows().all(gpu_model.pk))
    return _index_of(gpu_model, devices)


# Insert the allocation and its slots (on every device of the choice) in one statement, unless a slot of
# the block is taken on any of them. Run while holding the devices' row locks: every placement takes the
# lock of a device before it inserts slots there, so this statement's snapshot (taken after the locks were
# granted) sees every slot committed on them. The allocation row names the first device.
_TAKE = """
WITH allocation AS (
    INSERT INTO provisioner_allocation (session_id, device_id, slot_start, slot_count, created_at)
    SELECT %(session)s, %(device)s, %(start)s, %(count)s, statement_timestamp()
    WHERE NOT EXISTS (
        SELECT 1 FROM provisioner_allocationslot
        WHERE device_id = ANY(%(devices)s) AND slot >= %(start)s AND slot < %(start)s + %(count)s
    )
    RETURNING id
)
INSERT INTO provisioner_allocationslot (allocation_id, device_id, slot)
SELECT allocation.id, device, slot
FROM allocation, unnest(%(devices)s::bigint[]) AS device,
    generate_series(%(start)s, %(start)s + %(count)s - 1) AS slot
RETURNING allocation_id
"""


class _Taken(Exception):
    pass


def _try_take(session_id, eligible, choice: Choice, *, skip_locked: bool) -> int | None:
    """In a savepoint: lock the choice's devices (if still eligible), then insert the allocation if the
    block is free on all of them; the allocation's id, or None when a device is locked by another
    placement (with ``skip_locked``), no longer eligible, or the block was taken meanwhile (all or
    nothing). A miss rolls the savepoint back, which releases the devices' locks: a placement holds no
    device lock while it tries another. Without ``skip_locked`` the caller holds the locks already.

    The insert runs after the lock is granted, so its snapshot sees every slot committed on the device
    (see ``_TAKE``); the unique (device, slot) constraint is the last word.
    """
    from django.db import IntegrityError, connection, transaction

    from provisioner.catalog_cache import catalog_changed

    try:
        with transaction.atomic():
            locked = (
                eligible.filter(id__in=choice.devices)
                .order_by("id")
                .select_for_update(skip_locked=skip_locked, of=("self",), no_key=True)
                .values_list("id", flat=True)
            )
            if len(locked) != len(choice.devices):
                raise _Taken
            with connection.cursor() as cursor:
                cursor.execute(
                    _TAKE,
                    {
                        "session": session_id,
                        "device": choice.device_id,
                        "devices": list(choice.devices),
                        "start": choice.slot_start,
                        "count": choice.slot_count,
                    },
                )
                rows = cursor.fetchall()
            if not rows:
                raise _Taken
            catalog_changed()  # what is free now
            return rows[0][0]
    except (_Taken, IntegrityError):
        return None


SKIP_LOCKED_ROUNDS = 4
TRIES_PER_ROUND = 16


def allocation_place(
    *, session_id, gpu_model, profile, index=None, excluded_nodes=(), preferred_nodes=()
) -> Placed | None:
    """Give session ``session_id`` the best free block for ``profile`` on ``gpu_model`` (a multi-GPU
    profile: every slot of N GPUs of one node, all or nothing), or None when nothing fits (the database's
    committed state has no fitting block, or every fitting one was taken by placements that committed
    first). Nothing on ``excluded_nodes`` (nodes reserved for others). With ``preferred_nodes`` (where the
    user's home is) a block there comes first, however the policy ranks it; elsewhere only when none of
    them has one. Call inside the caller's transaction; the session row may be inserted later in it
    (foreign keys are checked at commit). ``index`` is a ``free_index`` read before the transaction,
    used for the first round when no node is excluded or preferred.

    Locks (``FOR NO KEY UPDATE``, as everywhere in the provisioner: foreign keys are checked at commit
    with ``FOR KEY SHARE`` on the referenced device, which must not wait on a placement): one device row
    at a time with SKIP LOCKED; in the last round, every fitting device in id order, waiting. Never
    deadlocks with another placement or a heartbeat (which waits for its node's devices in id order too, or
    skips those held: provisioner/services/heartbeats.py):
    the only device locks waited for are taken in id order, and a placement that holds a device lock
    waits for no other. The preferred nodes are tried with SKIP LOCKED only, so a placement that goes on
    to the others holds no device lock yet.
    """
    request = request_for(gpu_model=gpu_model, profile=profile)
    eligible = _eligible_devices(gpu_model, request).exclude(node_id__in=list(excluded_nodes))
    if excluded_nodes or preferred_nodes:
        index = None
    if preferred_nodes:
        home = eligible.filter(node_id__in=list(preferred_nodes))
        placed = _place_among(session_id, gpu_model, request, home, index=None, wait=False)
        if placed is not None:
            return placed
    return _place_among(session_id, gpu_model, request, eligible, index=index, wait=True)


def _place_among(session_id, gpu_model, request: Request, eligible, *, index, wait: bool) -> Placed | None:
    """``allocation_place`` over the devices ``eligible``: SKIP LOCKED rounds, then (``wait``) the
    contended round that locks them all in id order."""
    from provisioner.models import Device

    policy = gpu_model.placement_policy
    for _round in range(SKIP_LOCKED_ROUNDS):
        free, meta = index if index is not None and _round == 0 else _index_of(gpu_model, eligible)
        tried = 0
        for choice in free.choices(request, policy):
            tried += 1
            allocation_id = _try_take(session_id, eligible, choice, skip_locked=True)
            if allocation_id is not None:
                return _placed(allocation_id, choice, meta)
            if tried >= TRIES_PER_ROUND:  # the rest are re-read next round
                break
        if tried == 0:
            return None
    if not wait:
        return None
    # Contended: lock every eligible device of the request in id order, then decide on what is locked.
    locked = list(
        eligible.select_for_update(of=("self",), no_key=True).order_by("id").values_list("id", flat=True)
    )
    free, meta = _index_of(gpu_model, Device.objects.filter(id__in=locked))
    choice = free.choose(request, policy)
    if choice is None:
        return None
    allocation_id = _try_take(session_id, eligible, choice, skip_locked=False)
    if allocation_id is None:
        return None
    return _placed(allocation_id, choice, meta)


def _placed(allocation_id: int, choice: Choice, meta: dict[int, Slot]) -> Placed:
    return Placed(
        allocation_id,
        choice.device_id,
        choice.slot_start,
        choice.slot_count,
        meta[choice.device_id],
        choice.device_ids,
    )


def nodes_reserved(*, gpu_model, besides=None) -> list[int]:
    """Nodes that queued multi-GPU sessions of ``gpu_model`` (other than ``besides``) hold: no other
    session of the model is placed there (the queue's reservation, provisioner/services/sessions.py)."""
    from provisioner.models import Session

    return list(
        Session.objects.filter(state=Session.State.QUEUED, gpu_model=gpu_model, reserved_node__isnull=False)
        .exclude(id=besides)
        .values_list("reserved_node_id", flat=True)
    )


def _gpus_by_node(gpu_model):
    """Per active node: its eligible whole GPUs of ``gpu_model`` (``gpus``) and how many of them are
    fully free now (``free``)."""
    from django.db.models import Count, Q

    from provisioner.models import Device

    physical = _eligible_devices(gpu_model, Request(gpu_model.name, WHOLE)).filter(kind=Device.Kind.PHYSICAL)
    return (
        _with_masks(physical)
        .values("node_id")
        .annotate(gpus=Count("id"), free=Count("id", filter=Q(slot_mask=0)))
        .order_by()
    )


def node_gpus_most(*, gpu_model) -> int:
    """The most whole GPUs of ``gpu_model`` one active node has: the largest multi-GPU profile that can
    ever be placed (0 when none)."""
    return max(_gpus_by_node(gpu_model).values_list("gpus", flat=True), default=0)


def reserve_node_pick(*, gpu_model, gpu_count: int, taken=()) -> int | None:
    """The node a waiting request for ``gpu_count`` whole GPUs of ``gpu_model`` fits best on: of the
    active nodes with at least that many eligible GPUs and not in ``taken``, the one with the most of them
    fully free now (the fewest sessions to wait for); None when no node has that many."""
    return (
        _gpus_by_node(gpu_model)
        .exclude(node_id__in=list(taken))
        .filter(gpus__gte=gpu_count)
        .order_by("-free", "node_id")
        .values_list("node_id", flat=True)
        .first()
    )


def cpu_node_pick(*, preferred_nodes=(), excluded_nodes=()):
    """A cpu session goes to the active node running the fewest sessions, one of ``preferred_nodes``
    (where the user's home is) first, none of ``excluded_nodes`` (those without its environment)."""
    from django.db.models import Case, Count, Q, Value, When

    from provisioner.models import Node, Session

    home = Value(False)
    if preferred_nodes:
        home = Case(When(id__in=list(preferred_nodes), then=Value(True)), default=home)
    return (
        Node.objects.filter(state=Node.State.ACTIVE)
        .exclude(id__in=list(excluded_nodes))
        .annotate(live=Count("sessions", filter=Q(sessions__state__in=Session.ON_NODE)), home=home)
        .order_by("-home", "live", "id")
        .first()
    )


def allocation_free(*, session_id) -> bool:
    """Free the session's slots (idempotent). Returns whether anything was freed."""
    from provisioner.catalog_cache import catalog_changed
    from provisioner.models import Allocation

    deleted, _ = Allocation.objects.filter(session_id=session_id).delete()
    if deleted:
        catalog_changed()
    return bool(deleted)
