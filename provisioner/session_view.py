"""The one view of a session (STYLE.md, "One view of a thing"): its state, what it costs, what it may use,
how long its funds last, how its GPU is doing and where it waits. The REST API, the session page, the
dashboard and the live fragments all render a ``SessionView``; none of them works these out again.

Reads only. ``session_views`` serves lists in a bounded number of queries, whatever their length.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime

from django.conf import settings
from django.db.models import prefetch_related_objects
from django.utils import timezone

from billing.selectors import account_funds
from billing.services.metering import MeterCost, meter_costs
from core.compiled import Lookup
from provisioner import selectors
from provisioner.models import SLOTS_PER_GPU, Device, DeviceSample, Session
from provisioner.selectors import QueuePlace

S = Session.State
LIMITS_ENFORCED = ("device", "memory", "compute")


@dataclass(frozen=True)
class DeviceRef:
    id: int
    uuid: str
    kind: str
    index: int
    name: str  # a MIG device's profile (1g.18gb), else the name NVML gives the card
    nvml_name: str
    gpu_model: str | None
    memory_mib: int


@dataclass(frozen=True)
class Enforced:
    enforced: bool  # only when the node reported it so: nothing reported reads as advisory
    by: str | None  # how, in the node's words (heartbeats.ENFORCED_BY); None until it reports


@dataclass(frozen=True)
class Limits:
    """What the workload gets, as agents/gpuplan.py sets it up: a share of ``slot_count`` eighths caps
    memory and SMs at that share (a whole card or a MIG device is all eight of its own)."""

    device: DeviceRef | None  # None: CPU only, or not placed yet
    devices: tuple[DeviceRef, ...]  # every GPU the session runs on (a multi-GPU session: all N), first first
    slot_start: int | None
    slot_count: int | None
    sharing_policy: str  # as allocated; empty until placed
    enforcement: dict | None  # the node's report as stored; None until it reports
    enforced: dict[str, Enforced]  # device, memory, compute
    memory_cap_mib: int | None
    compute_percent: int | None
    cpu_cores: float
    memory_mib: int
    max_seconds: int
    idle_seconds: int | None

    @property
    def policy(self) -> str:
        return self.sharing_policy or Device.Sharing.EXCLUSIVE

    @property
    def slot_range(self) -> str:
        """``2–3`` for the eighths of a physical card; empty for a MIG device or no allocation."""
        if not self.slot_count or self.device is None or self.device.kind != Device.Kind.PHYSICAL:
            return ""
        return f"{self.slot_start}–{self.slot_start + self.slot_count - 1}"


@dataclass(frozen=True)
class Price:
    currency: str
    price_micros_per_hour: int  # locked at launch
    card_burn_micros_per_hour: int


@dataclass(frozen=True)
class Cost:
    """What the session has cost so far."""

    value_micros: int  # the seconds billed at the locked price, whoever paid (cards or money)
    charged_micros: int  # money posted (wallet and overdraft)
    accrued_micros: int  # money for seconds billed but not posted yet
    card_micros: int  # card-hour micros its cards paid
    wallet_micros: int
    overdraft_micros: int
    billed_seconds: int

    @property
    def total_micros(self) -> int:
        return self.charged_micros + self.accrued_micros


@dataclass(frozen=True)
class Sample:
    at: datetime
    gpu_util_percent: int | None
    memory_used_mib: int | None
    temperature_c: int | None
    power_w: float | None


@dataclass(frozen=True)
class Metrics:
    """GPU samples over the session's life. A MIG session's are its MIG device's own (the agent reports
    a MIG device's memory; NVML gives it neither utilisation nor power: agents/nvml/reader.py), or its
    card's from an agent that reports cards only; a slice's are the whole card's (``device_wide``)."""

    device_uuid: str | None  # the session's own device
    device_wide: bool
    samples: tuple[Sample, ...] | None  # oldest first; None when not read (``session_views`` of a list)


@dataclass(frozen=True)
class IdleRule:
    """What the idle stop counts as idle (provisioner/services/heartbeats.py ``_in_use``): no kernel or
    terminal activity, no browser connected (when ``count_connected``), CPU under ``cpu_percent`` of
    one core and the session's GPU under ``gpu_percent`` (None: a CPU session), for ``idle_seconds``."""

    idle_seconds: int
    cpu_percent: float
    gpu_percent: int | None
    count_connected: bool


@dataclass(frozen=True)
class SessionView:
    """What every reader of a session shows; the API's ``SessionOut``, ``SessionDetailOut`` and
    ``MetricsOut`` render it as it is."""

    session: Session  # the row, for what the readers show as stored (times, ids, max duration)
    state: str
    reason: str  # in English, as stored
    reason_code: str | None  # its key in provisioner.messages; None for free text
    reason_params: dict | None  # the key's parameters; None for free text
    live: bool
    gpu_model: str | None
    profile: str
    environment: str
    node: str | None
    price: Price
    cost: Cost | None  # None: never metered (it has not run)
    limits: Limits
    elapsed_seconds: int | None  # running time so far (or in all, once ended); None: never ran
    runway_seconds: int | None  # until the paying account's cards and money run out at what it
    # spends now (billing's Funds.runway_seconds); None unless running
    queue: QueuePlace | None  # None unless queued
    lab_url: str | None  # the way into its JupyterLab; None unless it is running and reachable
    gpu_util_percent: int | None  # of its own processes, as the agent last reported
    metrics: Metrics
    idle_rule: IdleRule | None  # None: no idle stop
    stop_notices: tuple[selectors.StopNotice, ...]  # live warnings of a stop to come, soonest first
    tier: str  # on_demand | interruptible
    resume: bool  # interruptible: re-queued when preempted
    preempted: bool  # stopped, or being stopped, for an on-demand launch
    resumed_from: uuid.UUID | None  # the preempted session this one resumes
    resumed_as: uuid.UUID | None  # the session that resumes this preempted one


def session_view(session: Session, *, now: datetime | None = None) -> SessionView:
    """One session as every reader shows it, its GPU samples included. ``session`` as the selectors
    give it (gpu_model, profile, environment, node, device and account joined)."""
    return session_views([session], now=now, samples=True)[0]


def session_views(
    sessions: Iterable[Session], *, now: datetime | None = None, samples: bool = False
) -> list[SessionView]:
    """``session_view`` of each session, in order, in a bounded number of queries: two for costs, four
    for queue places (when any is queued), one for samples (when asked), one for stop warnings, one per
    paying account and GPU model among the running (runway). Lists leave samples out unless ``samples``."""
    sessions = list(sessions)
    if not sessions:
        return []
    prefetch_related_objects([s for s in sessions if s.profile.gpu_count > 1], "devices")
    now = now or timezone.now()
    costs = meter_costs(session_refs=[s.ref for s in sessions])
    places = selectors.queue_places(sessions=sessions)
    runways = _runways(sessions)
    by_session = _samples(sessions, now=now) if samples else {}
    notices = selectors.stop_notices_of(session_ids=[s.id for s in sessions if s.state == S.RUNNING], now=now)
    resumed = selectors.resumed_as_of(session_ids=[s.id for s in sessions if s.preempted_at and s.resume])
    return [
        SessionView(
            session=s,
            state=s.state,
            reason=s.reason,
            reason_code=s.reason_key or None,
            reason_params=s.reason_params if s.reason_key else None,
            live=s.state in Session.LIVE,
            gpu_model=s.gpu_model.name if s.gpu_model_id else None,
            profile=s.profile.name,
            environment=s.environment.name,
            node=s.node.name if s.node_id else None,
            price=Price(
                currency=settings.SITE_CURRENCY,
                price_micros_per_hour=s.price_micros_per_hour,
                card_burn_micros_per_hour=s.card_burn_micros_per_hour,
            ),
            cost=_cost(s, costs.get(s.ref)),
            limits=_limits(s),
            elapsed_seconds=(
                int(((s.ended_at or now) - s.running_at).total_seconds()) if s.running_at else None
            ),
            runway_seconds=runways.get((s.account_id, s.gpu_model_id)) if s.state == S.RUNNING else None,
            queue=places.get(s.id),
            lab_url=selectors.session_lab_url(s) if s.state == S.RUNNING and s.upstream else None,
            gpu_util_percent=s.gpu_util_percent,
            metrics=_metrics(s, by_session, samples=samples),
            idle_rule=_idle_rule(s),
            stop_notices=tuple(notices.get(s.id, ())),
            tier=s.tier,
            resume=s.resume,
            preempted=s.preempted_at is not None,
            resumed_from=s.resumed_from_id,
            resumed_as=resumed.get(s.id),
        )
        for s in sessions
    ]


def _idle_rule(session: Session) -> IdleRule | None:
    if not session.idle_seconds:
        return None
    return IdleRule(
        idle_seconds=session.idle_seconds,
        cpu_percent=settings.SESSION_IDLE_CPU_PERCENT,
        gpu_percent=settings.SESSION_IDLE_GPU_PERCENT if session.gpu_model_id else None,
        count_connected=settings.SESSION_IDLE_COUNT_CONNECTED,
    )


def _cost(session: Session, cost: MeterCost | None) -> Cost | None:
    if cost is None:
        return None
    return Cost(
        value_micros=session.price_micros_per_hour * cost.billed_seconds // 3600,
        charged_micros=cost.charged_micros,
        accrued_micros=cost.accrued_micros,
        card_micros=cost.card_micros,
        wallet_micros=cost.wallet_micros,
        overdraft_micros=cost.overdraft_micros,
        billed_seconds=cost.billed_seconds,
    )


def _device_ref(session: Session, device: Device) -> DeviceRef:
    return DeviceRef(
        id=device.id,
        uuid=device.uuid,
        kind=device.kind,
        index=device.index,
        name=device.mig_profile or device.nvml_name,
        nvml_name=device.nvml_name,
        gpu_model=session.gpu_model.name if session.gpu_model_id else None,
        memory_mib=device.memory_mib,
    )


def _limits(session: Session) -> Limits:
    device = session.device if session.device_id else None
    memory_cap = percent = None
    if device is not None and session.slot_count:
        # As agents/gpuplan.py sets them: every policy caps at the share (whole = 8 of 8).
        memory_cap = device.memory_mib * session.slot_count // SLOTS_PER_GPU
        percent = 100 * session.slot_count // SLOTS_PER_GPU
    reported = session.enforcement or None
    enforced = {}
    for key in LIMITS_ENFORCED:
        part = (reported or {}).get(key) or {}
        enforced[key] = Enforced(enforced=part.get("enforced") is True, by=part.get("by"))
    return Limits(
        device=_device_ref(session, device) if device is not None else None,
        devices=tuple(_device_ref(session, d) for d in session.gpu_devices()),
        slot_start=session.slot_start,
        slot_count=session.slot_count,
        sharing_policy=session.sharing_policy,
        enforcement=reported,
        enforced=enforced,
        memory_cap_mib=memory_cap,
        compute_percent=percent,
        cpu_cores=float(session.environment.cpu_cores),
        memory_mib=session.environment.memory_mib,
        max_seconds=session.max_seconds,
        idle_seconds=session.idle_seconds,
    )


def _runways(sessions: list[Session]) -> dict[tuple[int, int | None], int | None]:
    """Funds runway per (account, GPU model) of the running sessions: cards count for their model."""
    running = {(s.account_id, s.gpu_model_id): s for s in sessions if s.state == S.RUNNING}
    return {
        key: account_funds(
            account=s.account, gpu_model=s.gpu_model.name if s.gpu_model_id else None
        ).runway_seconds
        for key, s in running.items()
    }


def _metrics(s: Session, by_session: dict, *, samples: bool) -> Metrics:
    """A MIG session's samples are its MIG device's own where the agent reports them (its memory), else
    its card's; a slice's are always the whole card's (``device_wide``)."""
    found = by_session.get(s.id) or ((), True)
    return Metrics(
        device_uuid=s.device.uuid if s.device_id else None,
        device_wide=found[1],
        samples=tuple(found[0]) if samples else None,
    )


def _measured_device_ids(session: Session) -> tuple[int, ...]:
    """The devices whose samples may be the session's, preferred first: its own, then for a MIG device
    the card it is cut from (an agent reporting physical cards only)."""
    if not session.device_id:
        return ()
    parent = session.device.parent_id
    return (session.device_id, parent) if parent else (session.device_id,)


# Every look at a session's page and the sessions API's answers: compiled once per process.
_SAMPLES_SINCE = Lookup(
    lambda device_ids, since: DeviceSample.objects.filter(
        device_id__any=device_ids, collected_at__gte=since
    ).order_by("collected_at", "id"),
    key_types=(list, datetime),
    many=True,
)


def _samples(sessions: list[Session], *, now: datetime) -> dict[uuid.UUID, tuple[list[Sample], bool]]:
    """Each session's samples over its life, oldest first, and whether they are the whole card's: its
    first measured device that has any, in one query (the heartbeat keeps DEVICE_SAMPLES_KEPT per
    device)."""
    windows: dict[int, list[tuple[uuid.UUID, datetime, datetime]]] = {}
    for s in sessions:
        if s.running_at is None:
            continue
        for device_id in _measured_device_ids(s):
            windows.setdefault(device_id, []).append((s.id, s.running_at, s.ended_at or now))
    if not windows:
        return {}
    since = min(start for spans in windows.values() for _id, start, _end in spans)
    rows = _SAMPLES_SINCE.all(sorted(windows), since)
    found: dict[tuple[uuid.UUID, int], list[Sample]] = {}
    for row in rows:
        for session_id, start, end in windows[row.device_id]:
            if start <= row.collected_at <= end:
                found.setdefault((session_id, row.device_id), []).append(
                    Sample(
                        at=row.collected_at,
                        gpu_util_percent=row.gpu_util_percent,
                        memory_used_mib=row.memory_used_mib,
                        temperature_c=row.temperature_c,
                        power_w=row.power_w,
                    )
                )
    chosen: dict[uuid.UUID, tuple[list[Sample], bool]] = {}
    for s in sessions:
        for device_id in _measured_device_ids(s):
            if (s.id, device_id) in found:
                own_mig = device_id == s.device_id and s.device.kind == Device.Kind.MIG
                chosen[s.id] = (found[(s.id, device_id)], not own_mig)
                break
    return chosen
