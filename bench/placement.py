"""Benchmark: placement decisions on a large fleet, and a launch's whole database transaction.

Part 1, in process (no Django): a fleet of 1,000 nodes × 8 GPUs (most shared, some exclusive, some in
MIG mode as seven 1g.10gb devices each; every node's GPUs in two NVLink groups of four) and 20,000 mixed
requests with departures, in two mixes: one-device requests (whole, 1/2, 1/4, 1/8, 1g.10gb), and the
same with multi-GPU requests among them (2x, 4x, 8x: whole GPUs of one node). Each is replayed
identically against three placers: ours (``FreeIndex``, binpack), first-fit (the lowest-numbered device
with a free aligned block, or the lowest-numbered node with N free GPUs: a linear scan) and spread
(``FreeIndex``, emptiest GPU first). Prints the time per decision (choose + record, p50 / p99) and the
packing efficiency: the share of the fleet's capacity in use when the first request is refused, and the
mean share in use after it.

Part 2, Django + the embedded PostgreSQL (its own, under ``.data/bench-placement``): ~500 launches
through ``session_launch`` on a fleet of ~100 GPUs, with departures, timing each launch's whole
transaction (locks, quota and funds admission, session row, placement, commit). The start task and the
queue dispatch queued after commit are left out (no broker round trip is timed).

Figures only: a benchmark never fails on a time.

    .venv/bin/python bench/placement.py [--quick] [--no-db] [--seed 1]
"""

from __future__ import annotations

import argparse
import heapq
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from provisioner.placement import (  # noqa: E402
    BINPACK,
    EXCLUSIVE,
    SHARED,
    SLOTS_PER_GPU,
    SPREAD,
    Choice,
    FreeIndex,
    Request,
    aligned_starts,
    block_mask,
)

MODEL = "A100-SXM4-80GB"
MIG_PROFILE = "1g.10gb"
MIG_PER_GPU = 7
GROUP_SIZE = 4  # GPUs per NVLink group: two groups per 8-GPU node
# (kind, eighths, GPUs, weight): whole cards dominate the demand in eighths, as on a training fleet.
MIX = [("whole", 8, 1, 45), ("slice", 4, 1, 20), ("slice", 2, 1, 12), ("slice", 1, 1, 15), ("mig", 8, 1, 8)]
# With multi-GPU requests among them: 2x, 4x, 8x take a tenth of the requests from the whole cards.
MULTI_MIX = [("whole", 8, 1, 35), ("whole", 8, 2, 5), ("whole", 8, 4, 3), ("whole", 8, 8, 2), *MIX[1:]]
LIFETIME_PER_REQUEST = 2  # mean lifetime (exponential) = 2 × the run's arrivals: about a fifth of the
# requests leave before the fleet fills, and the fleet fills about four fifths of the way through


# --- part 1: in process ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fleet:
    classes: list[str]  # device class by device id (0-based)
    homes: list[tuple[int, str]]  # (node, topology group) by device id
    capacity_eighths: float

    @staticmethod
    def build(nodes: int, gpus_per_node: int = 8) -> Fleet:
        """2.5 % of the nodes in MIG mode (7 × 1g.10gb per GPU), 10 % exclusive, the rest shared."""
        mig_nodes, exclusive_nodes = max(1, nodes // 40), max(1, nodes // 10)
        classes: list[str] = []
        homes: list[tuple[int, str]] = []
        for node in range(nodes):
            for gpu in range(gpus_per_node):
                home = (node, f"nvlink-{gpu // GROUP_SIZE}")
                if node < mig_nodes:
                    classes += [f"mig:{MIG_PROFILE}"] * MIG_PER_GPU
                    homes += [home] * MIG_PER_GPU
                    continue
                classes.append(EXCLUSIVE if node < mig_nodes + exclusive_nodes else SHARED)
                homes.append(home)
        return Fleet(classes, homes, float(nodes * gpus_per_node * SLOTS_PER_GPU))

    def eighths(self, choice: Choice) -> float:
        """Capacity a choice uses: its slots on each of its devices, or a seventh of a card for a 1g MIG
        device."""
        if self.classes[choice.device_id].startswith("mig:"):
            return SLOTS_PER_GPU / MIG_PER_GPU
        return choice.slot_count * len(choice.devices)


class IndexPlacer:
    """Ours (binpack) or spread: the production ``FreeIndex``."""

    def __init__(self, fleet: Fleet, policy: str) -> None:
        self.policy = policy
        self.index = FreeIndex()
        for device_id, (cls, (node, group)) in enumerate(zip(fleet.classes, fleet.homes, strict=True)):
            self.index.add(device_id, gpu_model=MODEL, device_class=cls, mask=0, node=node, group=group)

    def place(self, request: Request) -> Choice | None:
        choice = self.index.choose(request, self.policy)
        if choice is not None:
            self.index.occupy(choice)
        return choice

    def release(self, choice: Choice) -> None:
        self.index.release(choice)


FIRST_START = {c: [next(iter(aligned_starts(m, c)), None) for m in range(256)] for c in (1, 2, 4, 8)}


class FirstFitPlacer:
    """The baseline: scan devices in id order, take the first with a free aligned block (still buddy
    aligned; whole cards on the first fully free GPU, exclusive or shared; N GPUs on the first node with N
    fully free, its lowest-numbered ones)."""

    def __init__(self, fleet: Fleet) -> None:
        self.classes = fleet.classes
        self.masks = [0] * len(fleet.classes)
        self.nodes: dict[int, list[int]] = {}
        for device_id, (node, _group) in enumerate(fleet.homes):
            if fleet.classes[device_id] in (EXCLUSIVE, SHARED):
                self.nodes.setdefault(node, []).append(device_id)

    def _place_gpus(self, count: int) -> Choice | None:
        masks = self.masks
        for devices in self.nodes.values():
            free = [d for d in devices if masks[d] == 0][:count]
            if len(free) == count:
                for device_id in free:
                    masks[device_id] = 0xFF
                return Choice(free[0], 0, SLOTS_PER_GPU, tuple(free))
        return None

    def place(self, request: Request) -> Choice | None:
        classes, masks = self.classes, self.masks
        if request.gpu_count > 1:
            return self._place_gpus(request.gpu_count)
        if request.kind == "slice":
            starts = FIRST_START[request.eighths]
            for device_id, mask in enumerate(masks):
                if classes[device_id] == SHARED and (start := starts[mask]) is not None:
                    masks[device_id] = mask | block_mask(start, request.eighths)
                    return Choice(device_id, start, request.eighths)
            return None
        wanted = (f"mig:{request.mig_profile}",) if request.kind == "mig" else (EXCLUSIVE, SHARED)
        for device_id, mask in enumerate(masks):
            if mask == 0 and classes[device_id] in wanted:
                masks[device_id] = 0xFF
                return Choice(device_id, 0, SLOTS_PER_GPU)
        return None

    def release(self, choice: Choice) -> None:
        for device_id in choice.devices:
            self.masks[device_id] &= ~block_mask(choice.slot_start, choice.slot_count)


def workload(count: int, seed: int, mix: list[tuple[str, int, int, int]]) -> list[tuple[Request, int]]:
    """Requests with their lifetime, in arrivals."""
    rng = random.Random(seed)
    mean_lifetime = LIFETIME_PER_REQUEST * count
    kinds = [(kind, eighths, gpus) for kind, eighths, gpus, _w in mix]
    weights = [w for *_k, w in mix]
    requests = []
    for kind, eighths, gpus in rng.choices(kinds, weights=weights, k=count):
        request = Request(MODEL, kind, eighths, MIG_PROFILE if kind == "mig" else "", gpu_count=gpus)
        requests.append((request, 1 + int(rng.expovariate(1 / mean_lifetime))))
    return requests


def _mix_name(mix: list[tuple[str, int, int, int]]) -> str:
    names = {("slice", 4): "half", ("slice", 2): "quarter", ("slice", 1): "eighth", ("mig", 8): MIG_PROFILE}
    return "/".join(f"{gpus}x" if gpus > 1 else names.get((kind, e), kind) for kind, e, gpus, _w in mix)


@dataclass
class Outcome:
    name: str
    p50_us: float
    p99_us: float
    efficiency: float | None  # in use / capacity at the first refusal; None: nothing was refused
    first_refusal_at: int | None
    refused: int
    departures: int
    mean_use_after: float | None  # mean share in use over the arrivals after the first refusal


def simulate(name: str, placer, fleet: Fleet, requests: list[tuple[Request, int]]) -> Outcome:
    leaving: list[tuple[int, int, Choice]] = []
    used = 0.0
    samples: list[int] = []
    efficiency = first_refusal = None
    refused = departures = 0
    after: list[float] = []
    clock = time.perf_counter_ns
    for arrival, (request, lifetime) in enumerate(requests):
        while leaving and leaving[0][0] <= arrival:
            _at, _seq, gone = heapq.heappop(leaving)
            placer.release(gone)
            used -= fleet.eighths(gone)
            departures += 1
        started = clock()
        choice = placer.place(request)
        samples.append(clock() - started)
        if choice is None:
            refused += 1
            if first_refusal is None:
                first_refusal, efficiency = arrival, used / fleet.capacity_eighths
        else:
            used += fleet.eighths(choice)
            heapq.heappush(leaving, (arrival + lifetime, arrival, choice))
        if first_refusal is not None:
            after.append(used / fleet.capacity_eighths)
    samples.sort()
    return Outcome(
        name,
        samples[len(samples) // 2] / 1000,
        samples[min(len(samples) - 1, int(len(samples) * 0.99))] / 1000,
        efficiency,
        first_refusal,
        refused,
        departures,
        statistics.fmean(after) if after else None,
    )


def in_process(*, nodes: int, count: int, seed: int, mix: list[tuple[str, int, int, int]], part: str) -> None:
    fleet = Fleet.build(nodes)
    requests = workload(count, seed, mix)
    gpus = nodes * 8
    print(
        f"part {part} — in process: {nodes} nodes × 8 GPUs ({gpus} GPUs, {len(fleet.classes)} devices, "
        f"NVLink groups of {GROUP_SIZE}), {count} requests ({_mix_name(mix)} = "
        f"{'/'.join(str(w) for *_x, w in mix)} %), mean lifetime {LIFETIME_PER_REQUEST * count} arrivals"
    )
    outcomes = [
        simulate("ours (binpack)", IndexPlacer(fleet, BINPACK), fleet, requests),
        simulate("first-fit", FirstFitPlacer(fleet), fleet, requests),
        simulate("spread", IndexPlacer(fleet, SPREAD), fleet, requests),
    ]
    print(f"  {'placer':<16}{'p50 µs':>9}{'p99 µs':>9}{'packing':>9}{'1st refusal':>13}{'refused':>9}"
          f"{'departed':>10}{'use after':>11}")  # fmt: skip
    for o in outcomes:
        packing = f"{o.efficiency:.3f}" if o.efficiency is not None else "never full"
        after = f"{o.mean_use_after:.3f}" if o.mean_use_after is not None else "-"
        print(f"  {o.name:<16}{o.p50_us:>9.1f}{o.p99_us:>9.1f}{packing:>9}{o.first_refusal_at or '-':>13}"
              f"{o.refused:>9}{o.departures:>10}{after:>11}")  # fmt: skip
    ours, first_fit, spread = outcomes
    if all(o.efficiency for o in outcomes):
        print(
            f"  ratio: packing ours/first-fit {ours.efficiency / first_fit.efficiency:.3f}×, "
            f"ours/spread {ours.efficiency / spread.efficiency:.3f}×; "
            f"p99 ours/first-fit {ours.p99_us / first_fit.p99_us:.3f}×, "
            f"ours/spread {ours.p99_us / spread.p99_us:.3f}×"
        )
    if ours.mean_use_after and first_fit.mean_use_after:
        ratio = ours.mean_use_after / first_fit.mean_use_after
        print(f"  use after the first refusal, ours/first-fit {ratio:.3f}×")
    print(
        f"  targets: packing ≥ 0.95 (ours {ours.efficiency or 0:.3f}), p99 ≤ 100 µs per decision "
        f"(ours {ours.p99_us:.1f} µs)"
    )


# --- part 2: the database transaction -----------------------------------------------------------------


def _django() -> None:
    os.environ.setdefault("SUANLI_DATA_DIR", str(ROOT / ".data" / "bench-placement"))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
    import django

    from portal import embedded

    embedded.ensure_wanted()
    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)


def _wipe() -> None:
    """Empty the bench database's product tables (this data directory belongs to the bench alone)."""
    from django.apps import apps
    from django.db import connection

    tables = [
        model._meta.db_table
        for label in ("provisioner", "billing", "portal")
        for model in apps.get_app_config(label).get_models()
    ]
    with connection.cursor() as cursor:
        cursor.execute(f"TRUNCATE {', '.join(tables)} RESTART IDENTITY CASCADE")


def database(*, launches: int, seed: int) -> None:
    _django()
    from django.conf import settings
    from django.db import connection

    from provisioner import enqueue
    from provisioner.models import Device, Session
    from provisioner.services import sessions
    from provisioner.services.sessions import session_end
    from tests.provisioner.factories import (
        A100,
        catalog_make,
        fleet_make,
        gpu_make,
        mig_make,
        node_make,
        user_make,
    )

    enqueue.session_start = lambda session_id: None
    enqueue.queue_dispatch = lambda: None
    settings.QUOTA_DEFAULT_MAX_SESSIONS = 50
    settings.QUOTA_DEFAULT_MAX_EIGHTHS = 400
    _wipe()
    model = catalog_make(A100)
    fleet_make(model, nodes=11, gpus_per_node=8)
    fleet_make(model, nodes=1, gpus_per_node=8, sharing=Device.Sharing.EXCLUSIVE)
    mig_node = node_make()
    for index in range(4):
        parent = gpu_make(mig_node, model, index=index, mig_mode=True)
        for _ in range(MIG_PER_GPU):
            mig_make(parent, MIG_PROFILE)
    gpus = Device.objects.filter(kind="physical").count()
    users = [user_make() for _ in range(50)]
    rng = random.Random(seed)
    profiles = rng.choices(
        ["whole", "2x", "4x", "1/2", "1/4", "1/8", MIG_PROFILE], weights=[16, 3, 1, 20, 25, 30, 5], k=launches
    )
    print(
        f"part 2 — database: {launches} launches through session_launch by {len(users)} users on "
        f"{gpus} GPUs (4 of them as {Device.objects.filter(kind='mig').count()} MIG devices), "
        f"PostgreSQL {connection.cursor().connection.info.server_version // 10000}"
    )
    calls: list[float] = []  # the whole session_launch call, ms
    spans: list[float] = []  # its transaction: from the account lock to the commit, ms
    cpu: list[float] = []  # this process's CPU in the call (Django and psycopg, not the server), ms
    queries: list[int] = []
    statements: list[tuple[float, str]] = []

    def record(execute, sql, params, many, context):
        statements.append((time.perf_counter(), sql))
        return execute(sql, params, many, context)

    placed: list = []
    queued = 0
    for i, profile in enumerate(profiles):
        user = users[i % len(users)]
        statements.clear()
        with connection.execute_wrapper(record):
            cpu_started = time.process_time()
            started = time.perf_counter()
            session = sessions.session_launch(
                user=user,
                account=user.account,
                gpu_model=A100,
                profile=profile,
                environment="python-3.11",
                max_hours=1,
                idle_minutes=None,
                idempotency_key=None,
            ).session
            calls.append((time.perf_counter() - started) * 1000)
            cpu.append((time.process_time() - cpu_started) * 1000)
        # The first locking read opens the transaction; the last statement (refresh_from_db) follows the
        # commit.
        opened = next(at for at, sql in statements if "FOR NO KEY UPDATE" in sql or "FOR UPDATE" in sql)
        spans.append((statements[-1][0] - opened) * 1000)
        queries.append(len(statements))
        if session.state == Session.State.PLACING:
            placed.append(session.id)
        else:
            queued += 1
            session_end(
                session_id=session.id, to=Session.State.STOPPED, reason="bench", from_states=["queued"]
            )
        if placed and rng.random() < 0.45:  # departures keep the fleet busy but not full
            gone = placed.pop(rng.randrange(len(placed)))
            session_end(session_id=gone, to=Session.State.STOPPED, reason="bench")

    def pct(samples: list[float], p: float) -> float:
        ordered = sorted(samples)
        return ordered[min(len(ordered) - 1, int(len(ordered) * p))]

    round_trips = []
    with connection.cursor() as cursor:
        for _ in range(300):
            started = time.perf_counter()
            cursor.execute("SELECT 1")
            cursor.fetchone()
            round_trips.append((time.perf_counter() - started) * 1000)
    for name, samples in (
        ("transaction", spans),
        ("whole call", calls),
        ("client CPU", cpu),
        ("SELECT 1", round_trips),
    ):
        print(
            f"  {name:<12} ms: p50 {pct(samples, 0.5):6.2f}  p95 {pct(samples, 0.95):6.2f}  "
            f"p99 {pct(samples, 0.99):6.2f}  max {max(samples):6.2f}"
        )
    print(
        f"  statements per launch: median {statistics.median(queries):.0f}; placed {launches - queued}, "
        f"queued {queued}; target: transaction p95 ≤ 20 ms (ours {pct(spans, 0.95):.2f} ms)"
    )
    print(
        f"  baseline: the transaction's p50 is {pct(spans, 0.5) / pct(round_trips, 0.5):.0f}× one bare round "
        "trip to this server now (a loaded machine slows both alike)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller fleet and fewer requests")
    parser.add_argument("--no-db", action="store_true", help="part 1 only")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    nodes, count, launches = (200, 4_000, 150) if args.quick else (1_000, 20_000, 500)
    in_process(nodes=nodes, count=count, seed=args.seed, mix=MIX, part="1a")
    in_process(nodes=nodes, count=count, seed=args.seed, mix=MULTI_MIX, part="1b")
    if not args.no_db:
        database(launches=launches, seed=args.seed)


if __name__ == "__main__":
    main()
