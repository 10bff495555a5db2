"""Sessions: launch (admission + placement in one transaction), stop, and every state transition.

States: queued → placing → starting → running → stopping → stopped, plus failed and lost. Every
transition is a conditional update on the session's current state (``_transition``), so a worker, a
heartbeat and a sweep racing on one session agree on one outcome; each leaves a SessionEvent.

Lock order everywhere: billing Account row, then the user row, then device rows (placement), then
the session row. Nothing here holds a lock across an HTTP call to an agent: tasks call agents after
commit.

Row locks are ``FOR NO KEY UPDATE`` (``select_for_update(no_key=True)``): Django's foreign keys are
checked at COMMIT, which takes ``FOR KEY SHARE`` on the referenced node, device, account or user row;
a plain ``FOR UPDATE`` there deadlocks a heartbeat against a launch committing its session row.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import IntegrityError, connection, transaction
from django.utils import timezone
from django.utils.translation import gettext as _

from billing.models import Account
from billing.rules import accounts_payable_by
from billing.services.ledger import idempotency_key_check
from billing.services.metering import account_can_launch, meter_close, meter_open
from billing.services.pricing import ON_DEMAND, PriceQuote, price_quote, quote_with_surcharge
from core.compiled import Lookup
from core.errors import ApplicationError, NotFound, RateLimited, ValidationFailed
from core.throttle import attempt_count
from provisioner import enqueue
from provisioner.messages import Message, message, message_columns
from provisioner.models import (
    Device,
    Environment,
    GpuModel,
    Node,
    Profile,
    Session,
    SessionEvent,
    StopWarning,
)
from provisioner.placement import (
    allocation_free,
    allocation_place,
    cpu_node_pick,
    free_index,
    node_gpus_most,
    nodes_reserved,
    reserve_node_pick,
)
from provisioner.quotas import quota_admit, quota_subjects, team_folders_admit
from provisioner.sealing import new_token, seal
from provisioner.selectors import home_nodes, queue_order, queue_served
from provisioner.services.environments import environment_for_launch, environment_on_some_node, nodes_lacking
from provisioner.services.events import event_fields, session_event
from provisioner.services.home_retention import home_removals_cancel
from provisioner.services.preemption import (
    HELD,
    claimers_ready,
    held_slots_free,
    held_slots_take,
    preemption_claim,
    preemption_release,
)
from provisioner.services.session_notices import session_ended_notify, session_owner_notify

log = logging.getLogger("provisioner.sessions")
S = Session.State
_TIMESTAMP = {
    S.QUEUED: "queued_at",
    S.PLACING: "placed_at",
    S.STARTING: "starting_at",
    S.RUNNING: "running_at",
    S.STOPPING: "stopping_at",
    S.STOPPED: "ended_at",
    S.FAILED: "ended_at",
    S.LOST: "ended_at",
}


def _reason_fields(reason: Message | str) -> dict:
    key, params, text = message_columns(reason)
    return {"reason_key": key, "reason_params": params, "reason": text[:300]}


# Every transition reads the state it moves from: compiled once per process.
_STATE_OF = Lookup(
    lambda session_id: Session.objects.filter(id=session_id).values_list("state", flat=True),
    key_types=(uuid.UUID,),
)


def _transition(
    session_id, *, from_states, to: str, reason: Message | str, at: datetime | None = None, **fields
) -> str | None:
    """Move a session from one of ``from_states`` to ``to`` by a conditional update; returns the state it
    left, or None when it was in none of them (someone else moved it first)."""
    at = at or timezone.now()
    for _attempt in range(3):
        current = _STATE_OF.first(session_id)
        if current is None or current not in from_states:
            return None
        stamp = {_TIMESTAMP[to]: at} if to in _TIMESTAMP else {}
        moved = Session.objects.filter(id=session_id, state=current).update(
            state=to, **_reason_fields(reason), **stamp, **fields
        )
        if moved:
            session_event(session_id=session_id, kind="state", line=reason, from_state=current, to_state=to)
            return current
    return None


# --- launch ------------------------------------------------------------------------------------------


def _admission_lock(*, account_id: int, user_id: int) -> None:
    """Lock the paying account's row, then the user's (the lock order), for an admission.

    Plain statements: the ORM's ``select_for_update().first()`` compiles and fetches whole rows nobody
    reads, a millisecond each on the launch's hot path."""
    with connection.cursor() as cursor:
        for model, pk in ((Account, account_id), (get_user_model(), user_id)):
            table, column = model._meta.db_table, model._meta.pk.column  # names from the models, not input
            cursor.execute(f"SELECT 1 FROM {table} WHERE {column} = %s FOR NO KEY UPDATE", [pk])  # noqa: S608


def _vscode_served() -> bool:
    """Whether an active node's agent reported code-server (the heartbeat's capabilities)."""
    return Node.objects.filter(state=Node.State.ACTIVE, interfaces__contains=["vscode"]).exists()


# What every launch reads by the names it was given: compiled once (core.compiled).
_PROFILE_NAMED = Lookup(lambda name: Profile.objects.filter(name=name), key_types=(str,))
_GPU_MODEL_OFFERED = Lookup(lambda name: GpuModel.objects.filter(name=name, enabled=True), key_types=(str,))


def _catalog(
    *, user, gpu_model: str, profile: str, environment: str
) -> tuple[GpuModel | None, Profile, Environment]:
    profile_obj = _PROFILE_NAMED.first(profile)
    if profile_obj is None:
        raise ValidationFailed(
            _("Unknown profile %(profile)s.") % {"profile": repr(profile)}, fields={"profile": "unknown"}
        )
    env = environment_for_launch(user=user, environment=environment)
    if not environment_on_some_node(env):
        raise ValidationFailed(
            _("No node has the environment %(environment)s installed yet.") % {"environment": env.name},
            code="environment_unavailable",
            fields={"environment": "on no node"},
        )
    if env.interface == Environment.Interface.VSCODE and not _vscode_served():
        raise ValidationFailed(
            _("No node serves VS Code now; choose a JupyterLab environment."),
            fields={"environment": "no active node serves vscode"},
        )
    if profile_obj.kind == Profile.Kind.CPU:
        return None, profile_obj, env
    model = _GPU_MODEL_OFFERED.first(gpu_model)
    if model is None:
        raise ValidationFailed(
            _("Unknown GPU model %(gpu_model)s.") % {"gpu_model": repr(gpu_model)},
            fields={"gpu_model": "unknown"},
        )
    if profile not in model.profiles:
        raise ValidationFailed(
            _("%(gpu_model)s is not offered as %(profile)s.") % {"gpu_model": model.name, "profile": profile},
            fields={"profile": f"not offered on {model.name}"},
        )
    if profile_obj.gpu_count > 1 and profile_obj.gpu_count > node_gpus_most(gpu_model=model):
        raise ValidationFailed(
            _("No node has %(count)s %(gpu_model)s GPUs.")
            % {"count": profile_obj.gpu_count, "gpu_model": model.name},
            fields={"profile": f"no node has {profile_obj.gpu_count} GPUs of {model.name}"},
        )
    return model, profile_obj, env


def _seconds(value, *, field: str, default: float, unit: int) -> int:
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ValidationFailed(
            _("%(field)s must be a positive number.") % {"field": field}, fields={field: "must be > 0"}
        )
    return max(1, int(value * unit))


@dataclass(frozen=True)
class Launched:
    """What ``session_launch`` did: the session, and whether it was there already (a replay of the same
    idempotency key) rather than launched by this call."""

    session: Session
    replayed: bool


@dataclass(frozen=True)
class _LaunchSpec:
    """A launch checked against the catalog, the payer and the limits, and priced; read before the
    admission transaction so that the locks are held for the writes only."""

    model: GpuModel | None  # None: a CPU session
    profile: Profile
    environment: Environment
    max_seconds: int
    idle_seconds: int
    quote: PriceQuote
    tier: str = ON_DEMAND

    @property
    def model_name(self) -> str:
        return self.model.name if self.model else ""


def session_launch(
    *,
    user,
    account: Account,
    gpu_model: str,
    profile: str,
    environment: str,
    max_hours: float | None,
    idle_minutes: int | None,
    idempotency_key: str | None,
    priority: int = 0,
    tier: str = ON_DEMAND,
    resume: bool = False,
) -> Launched:
    """Admit and place one session, or queue it when nothing fits right now.

    ``tier``: ``on_demand`` (the default) or ``interruptible`` (its lower price; placed only on free
    capacity, and an on-demand launch may preempt it: ``provisioner.services.preemption``); ``resume``
    re-queues an interruptible session when it is preempted. An on-demand launch that finds no room,
    when every other on-demand session waiting for its GPU model is provided for, claims interruptible
    sessions to stop for it (``preemption_claim``) and waits first in line for their slots.

    Every launch counts against the user's launch rate (``SESSION_LAUNCH_RATE``; replays too), whoever
    calls: the API, the pages. One transaction: lock the paying Account row, then the user row (so one
    user's and one account's concurrent launches are admitted one at a time), check quotas and funds,
    create the session and place it (see ``allocation_place`` for the device locks). The start task is
    queued after commit.

    Idempotent by ``idempotency_key`` per user: the same key returns the same session, ``replayed``,
    found by the one lookup made under the locks (so two concurrent launches with one key make one).
    Raises ValidationFailed (unknown or unoffered model/profile/environment, bad limits, unpriced),
    NotFound (an account the user may not pay with), RateLimited ``throttled``, QuotaExceeded,
    InsufficientFunds.
    """
    idempotency_key_check(idempotency_key)
    _launch_throttle(user=user)
    spec = _launch_spec(
        user=user,
        account=account,
        gpu_model=gpu_model,
        profile=profile,
        environment=environment,
        max_hours=max_hours,
        idle_minutes=idle_minutes,
        tier=tier,
    )
    subjects = quota_subjects(user=user, account=account)
    candidates = free_index(gpu_model=spec.model) if spec.model is not None else None
    session_id = uuid.uuid4()
    with transaction.atomic():
        _admission_lock(account_id=account.id, user_id=user.pk)
        if idempotency_key:
            existing = Session.objects.filter(owner=user, idempotency_key=idempotency_key).first()
            if existing is not None:
                return Launched(existing, replayed=True)
        quota_admit(
            user=user,
            account=account,
            gpu_model=spec.model_name,
            profile=spec.profile,
            max_seconds=spec.max_seconds,
            subjects=subjects,
        )
        account_can_launch(account=account, quote=spec.quote, gpu_model=spec.model_name)
        team_folders, folder_warnings = team_folders_admit(user=user)
        # Placed before the session row is written (its foreign keys are checked at commit), so a
        # launch that finds room writes the session once, already placing.
        placed = _placement(
            session_id,
            user_id=user.pk,
            model=spec.model,
            profile=spec.profile,
            environment=spec.environment,
            candidates=candidates,
        )
        session = _launched_session_create(
            session_id,
            spec=spec,
            user=user,
            account=account,
            idempotency_key=idempotency_key,
            priority=priority,
            placed=placed,
            resume=resume,
            team_folders=team_folders,
            warnings=folder_warnings,
        )
        home_removals_cancel(user_id=user.pk)  # a launch is use: the home stays (docs/STORAGE.md)
        if placed:
            _devices_record(session.id, placed["device_ids"])
            enqueue.session_start(session.id)
        elif _on_demand_unprovided_first(session):
            preemption_claim(claimer=session)
    return Launched(session, replayed=False)


def _on_demand_unprovided_first(session: Session) -> bool:
    """Whether ``session`` is on demand and every other on-demand session waiting for its GPU model is
    provided for (it has interruptible sessions stopping for it): the first unprovided one preempts,
    those behind it wait their turn in the queue."""
    return (
        session.tier == Session.Tier.ON_DEMAND
        and session.gpu_model_id is not None
        and not Session.objects.filter(
            state=S.QUEUED,
            gpu_model_id=session.gpu_model_id,
            tier=Session.Tier.ON_DEMAND,
            preempting__isnull=True,
        )
        .exclude(id=session.id)
        .exists()
    )


def _launch_throttle(*, user) -> None:
    """Count one launch by ``user``; past ``SESSION_LAUNCH_RATE`` (launches, window seconds) raise
    RateLimited ``throttled``: a runaway script or a stuck button cannot flood the queue with launches
    that the quota then refuses one by one. Fails open, logged, when the cache is down."""
    launches, window_seconds = settings.SESSION_LAUNCH_RATE
    count = attempt_count(f"launch:user:{user.pk}", window_seconds=window_seconds)
    if count is not None and count > launches:
        raise RateLimited(
            _("Too many attempts; wait a minute and try again."),
            code="throttled",
            retry_after_seconds=window_seconds,
        )


def _launch_spec(
    *,
    user,
    account: Account,
    gpu_model: str,
    profile: str,
    environment: str,
    max_hours: float | None,
    idle_minutes: int | None,
    tier: str = ON_DEMAND,
) -> _LaunchSpec:
    """Check a launch's choices, its payer and its limits, and price it in its tier. Reads only."""
    model, profile_obj, env = _catalog(
        user=user, gpu_model=gpu_model, profile=profile, environment=environment
    )
    if account.id not in {a.id for a in accounts_payable_by(user=user)}:
        raise NotFound(_("No such account."), fields={"account": "not one you may pay with"})
    max_seconds = _seconds(
        max_hours, field="max_hours", default=settings.SESSION_DEFAULT_MAX_HOURS, unit=3600
    )
    idle_seconds = _seconds(
        idle_minutes, field="idle_minutes", default=settings.SESSION_DEFAULT_IDLE_MINUTES, unit=60
    )
    model_name = model.name if model else ""
    if tier not in Session.Tier.values:
        raise ValidationFailed(
            _("Unknown tier %(tier)s.") % {"tier": repr(tier)}, fields={"tier": "on_demand or interruptible"}
        )
    try:
        quote = price_quote(gpu_model=model_name, profile=profile_obj.name, tier=tier)
    except NotFound:
        if tier != ON_DEMAND:
            raise ValidationFailed(
                _("%(gpu_model)s %(profile)s is not offered as interruptible.")
                % {"gpu_model": model_name or "cpu", "profile": profile},
                code="unpriced",
                fields={"tier": "not offered"},
            )
        raise ValidationFailed(
            _("%(gpu_model)s %(profile)s has no price yet.")
            % {"gpu_model": model_name or "cpu", "profile": profile},
            code="unpriced",
        )
    quote = quote_with_surcharge(quote, surcharge_micros_per_hour=env.runs_on.surcharge_micros_per_hour)
    return _LaunchSpec(model, profile_obj, env, max_seconds, idle_seconds, quote, tier)


def _launched_session_create(
    session_id,
    *,
    spec: _LaunchSpec,
    user,
    account: Account,
    idempotency_key: str | None,
    priority: int,
    placed: dict | None,
    resume: bool = False,
    team_folders: list[dict] | None = None,
    warnings: list[Message] = (),
) -> Session:
    """Write an admitted session, placing or queued as ``placed`` says, with its first events (and a
    ``storage`` event for each of ``warnings``); inside the launch's transaction. ``resume`` holds only
    for an interruptible session; ``team_folders`` are the folders it mounts (``team_folders_admit``)."""
    now = timezone.now()
    session = Session.objects.create(
        id=session_id,
        owner=user,
        account=account,
        gpu_model=spec.model,
        profile=spec.profile,
        environment=spec.environment,
        state=S.PLACING if placed else S.QUEUED,
        **(_reason_fields(placed["reason"]) if placed else {}),
        idempotency_key=idempotency_key or None,
        jupyter_token_sealed=seal(new_token()),
        price_id=spec.quote.price_id,
        price_micros_per_hour=spec.quote.price_micros_per_hour,
        card_burn_micros_per_hour=spec.quote.card_burn_micros_per_hour,
        max_seconds=spec.max_seconds,
        idle_seconds=spec.idle_seconds,
        queue_priority=priority,
        queue_max_wait_seconds=settings.QUEUE_MAX_WAIT_SECONDS,
        tier=spec.tier,
        resume=resume and spec.tier == Session.Tier.INTERRUPTIBLE,
        queued_at=now,
        placed_at=now if placed else None,
        team_folders=team_folders or [],
        **(placed["fields"] if placed else {}),
    )
    launched = SessionEvent(
        session=session,
        kind="launch",
        to_state=S.QUEUED,
        **event_fields(message("launched_by", user=str(user))),
    )
    if placed:
        then = SessionEvent(
            session=session,
            kind="state",
            from_state=S.QUEUED,
            to_state=S.PLACING,
            **event_fields(placed["reason"]),
        )
    else:
        then = SessionEvent(
            session=session,
            kind="queue",
            **event_fields(message("no_room", gpu_model=spec.model_name, profile=spec.profile.name)),
        )
    storage = [SessionEvent(session=session, kind="storage", **event_fields(line)) for line in warnings]
    SessionEvent.objects.bulk_create([launched, *storage, then])
    return session


def _placement(
    session_id,
    *,
    user_id,
    model: GpuModel | None,
    profile: Profile,
    environment: Environment,
    candidates=None,
) -> dict | None:
    """Take room for a session inside the caller's transaction, off the nodes that waiting multi-GPU
    sessions reserved for themselves, and where the user's home is when there is room there: the session
    fields that record where it runs, the reason to show and its devices when it has several
    (``device_ids``), or None when nothing fits now; only on a node that has ``environment``.
    ``candidates``: a ``free_index`` read before the transaction."""
    home = home_nodes(user_id=user_id)
    lacking = nodes_lacking(environment)
    if model is None:
        node = cpu_node_pick(preferred_nodes=home, excluded_nodes=lacking)
        if node is None:
            return None
        reason = _placed_reason(node.id, node.name, home)
        return {"fields": {"node": node}, "reason": reason, "device_ids": ()}
    placed = allocation_place(
        session_id=session_id,
        gpu_model=model,
        profile=profile,
        index=candidates,
        excluded_nodes=[*nodes_reserved(gpu_model=model, besides=session_id), *lacking],
        preferred_nodes=home,
    )
    if placed is None:
        return None
    policy = (
        "exclusive"
        if profile.kind in (Profile.Kind.WHOLE, Profile.Kind.MIG) or placed.where.kind == "mig"
        else placed.where.sharing_policy
    )
    fields = {
        "node_id": placed.where.node_id,
        "device_id": placed.device_id,
        "slot_start": placed.slot_start,
        "slot_count": placed.slot_count,
        "sharing_policy": policy,
    }
    return {
        "fields": fields,
        "reason": _placed_reason(placed.where.node_id, placed.where.node_name, home),
        "device_ids": placed.device_ids,
    }


def _placed_reason(node_id: int, node_name: str, home: frozenset[int]) -> Message:
    """Where the session went; said plainly when that is away from the user's files."""
    if home and node_id not in home:
        return message("placed_away_from_home", node=node_name)
    return message("placed_on", node=node_name)


def _devices_record(session_id, device_ids) -> None:
    """Record every device of a multi-GPU session (``Session.devices``); nothing for one device."""
    through = Session.devices.through
    through.objects.bulk_create([through(session_id=session_id, device_id=d) for d in device_ids])


def _place(session: Session, *, model: GpuModel | None, profile: Profile) -> bool:
    """Place a queued session inside the caller's transaction; True when it moved to placing. A
    session whose preempted victims have all ended takes the slots they held (freed and taken in this
    transaction, so no other request sees them free); any other claim of it is released once placed."""
    held_on = held_slots_take(claimer=session) if model is not None else None
    candidates = free_index(gpu_model=model, devices=Device.objects.filter(id=held_on)) if held_on else None
    placed = _placement(
        session.id,
        user_id=session.owner_id,
        model=model,
        profile=profile,
        environment=session.environment,
        candidates=candidates,
    )
    if placed is None:
        return False
    moved = _transition(
        session.id,
        from_states=[S.QUEUED],
        to=S.PLACING,
        reason=placed["reason"],
        reserved_node=None,
        **placed["fields"],
    )
    if moved is None:
        allocation_free(session_id=session.id)  # stopped or cancelled meanwhile: give the slots back
        return False
    _devices_record(session.id, placed["device_ids"])
    preemption_release(claimer_id=session.id)
    enqueue.session_start(session.id)
    return True


# --- stop and end ------------------------------------------------------------------------------------


def session_stop(*, session: Session, actor, reason: Message | str) -> None:
    """Ask a session to stop. Queued: cancelled at once (→ stopped; the interruptible sessions it
    claimed are spared). On a node: → stopping, and the stop task deletes the workload on the agent
    after commit. Already stopping or ended: unchanged.
    ``reason``: a message, or someone's own words (shown as they are). Idempotent; a conditional update
    on the state, no locks held across the agent call. ``session`` is not refreshed: read it again for
    what the stop made of it."""
    if getattr(actor, "pk", None):
        cancelled = message("cancelled_by", actor=str(actor), why=reason)
        stopping = message("stop_by", actor=str(actor), why=reason)
    else:
        cancelled, stopping = message("cancelled", why=reason), message("stop", why=reason)
    with transaction.atomic():
        if _transition(session.id, from_states=[S.QUEUED], to=S.STOPPED, reason=cancelled):
            preemption_release(claimer_id=session.id)
            session_ended_notify(session.id, reason=cancelled)
        elif _transition(session.id, from_states=list(Session.ON_NODE), to=S.STOPPING, reason=stopping):
            enqueue.session_stop(session.id)


def session_end(
    *,
    session_id,
    to: str,
    reason: Message | str,
    from_states=None,
    ended_at: datetime | None = None,
    free: bool = True,
) -> bool:
    """End a session (stopped, failed or lost): close its meter at the earlier of ``ended_at`` and the
    last time it was seen alive, free its slots unless ``free`` is False (lost: freed only when the
    agent confirms the workload gone). Idempotent; one transaction. Queues a queue dispatch after commit
    when slots were freed.

    Preemption: a preempted session's slots stay held for the on-demand session it was stopped for
    (the queue dispatch hands them over, or frees them if that one no longer waits), and a preempted
    session that asked to resume is queued again (``_resumed_session_create``); a queued session that
    ends releases the interruptible sessions it claimed (``preemption_release``)."""
    from_states = from_states or [s for s in Session.State.values if s not in Session.ENDED]
    ended_at = ended_at or timezone.now()
    with transaction.atomic():
        left = _transition(session_id, from_states=from_states, to=to, reason=reason, at=ended_at)
        if left is None:
            return False
        StopWarning.objects.filter(session_id=session_id, cleared_at__isnull=True).update(cleared_at=ended_at)
        session_ended_notify(session_id, reason=reason)
        row = Session.objects.filter(id=session_id).values(
            "last_alive_at", "preempted_for_id", "preempted_at", "resume"
        )[0]
        last_alive = row["last_alive_at"]
        with contextlib.suppress(NotFound):  # never ran: nothing was metered
            meter_close(
                session_ref=str(session_id), ended_at=min(ended_at, last_alive) if last_alive else ended_at
            )
        if left == S.QUEUED:
            preemption_release(claimer_id=session_id, now=ended_at)
        if row["preempted_for_id"] is not None and to in HELD:
            enqueue.queue_dispatch()  # its slots wait for the session it was stopped for
        elif free and allocation_free(session_id=session_id):
            enqueue.queue_dispatch()
        if to == S.STOPPED and row["preempted_at"] and row["resume"]:
            _resumed_session_create(preempted_id=session_id)
    return True


def _resumed_session_create(*, preempted_id) -> Session:
    """Queue a preempted interruptible session again, as its owner asked: a new session of the same
    owner, account, GPU model, profile, environment, limits and locked price, linked to the preempted
    one (``resumed_from``), placed by the queue when free capacity allows. A new row rather than the
    old one back to queued: states only move forward, the meter of a session is closed at its stop, and
    each run keeps its own history and bill. Its team folders are decided again, as at a launch (the
    owner's teams, and the folders' quotas, may have changed). Inside ``session_end``'s transaction."""
    old = Session.objects.select_related("owner").get(id=preempted_id)
    team_folders, folder_warnings = team_folders_admit(user=old.owner)
    now = timezone.now()
    new = Session.objects.create(
        owner_id=old.owner_id,
        account_id=old.account_id,
        gpu_model_id=old.gpu_model_id,
        profile_id=old.profile_id,
        environment_id=old.environment_id,
        state=S.QUEUED,
        jupyter_token_sealed=seal(new_token()),
        price_id=old.price_id,
        price_micros_per_hour=old.price_micros_per_hour,
        card_burn_micros_per_hour=old.card_burn_micros_per_hour,
        max_seconds=old.max_seconds,
        idle_seconds=old.idle_seconds,
        queue_priority=old.queue_priority,
        queue_max_wait_seconds=settings.QUEUE_MAX_WAIT_SECONDS,
        tier=Session.Tier.INTERRUPTIBLE,
        resume=True,
        resumed_from=old,
        queued_at=now,
        team_folders=team_folders,
    )
    SessionEvent.objects.bulk_create(
        [
            SessionEvent(
                session=new,
                kind="launch",
                to_state=S.QUEUED,
                **event_fields(message("resumed_from", session=str(old.id)[:8])),
            ),
            *(SessionEvent(session=new, kind="storage", **event_fields(line)) for line in folder_warnings),
            SessionEvent(
                session=old, kind="resume", **event_fields(message("resumed_as", session=str(new.id)[:8]))
            ),
        ]
    )
    enqueue.queue_dispatch()
    return new


def session_freed_after_gone(*, session_ids) -> int:
    """The agent no longer lists these ended sessions: free what they still hold, except the slots a
    preempted session holds for the on-demand session that waits for them (the queue dispatch hands
    those over). Returns how many."""
    freed = 0
    with transaction.atomic():
        held = set(
            Session.objects.filter(
                id__in=list(session_ids), state__in=HELD, preempted_for__state=S.QUEUED
            ).values_list("id", flat=True)
        )
        for session_id in session_ids:
            if session_id not in held:
                freed += allocation_free(session_id=session_id)
        if freed:
            enqueue.queue_dispatch()
    return freed


def session_mark_starting(*, session_id) -> bool:
    """The agent accepted the workload spec."""
    return (
        _transition(session_id, from_states=[S.PLACING], to=S.STARTING, reason=message("starting"))
        is not None
    )


def session_mark_running(*, session_id, upstream: str, at: datetime | None = None) -> bool:
    """The agent reported the workload running: → running and the meter opens at ``at``. Idempotent."""
    at = at or timezone.now()
    with transaction.atomic():
        left = _transition(
            session_id,
            from_states=[S.PLACING, S.STARTING],
            to=S.RUNNING,
            reason=message("running"),
            at=at,
            upstream=upstream or "",
            last_alive_at=at,
            last_active_at=at,
        )
        if left is None:
            return False
        session = Session.objects.select_related("account", "gpu_model", "profile").get(id=session_id)
        meter_open(
            account=session.account,
            session_ref=session.ref,
            gpu_model=session.gpu_model.name if session.gpu_model else "",
            profile=session.profile.name,
            quote=PriceQuote(
                session.price_id, session.price_micros_per_hour, session.card_burn_micros_per_hour
            ),
            started_at=at,
        )
        session_owner_notify(session_id, kind="session_started", key="session_started")
    return True


def session_start_failed(*, session_id, reason: Message | str) -> bool:
    """The agent refused the spec or Jupyter never came up: → failed, slots freed."""
    return session_end(
        session_id=session_id, to=S.FAILED, reason=reason, from_states=[S.PLACING, S.STARTING, S.RUNNING]
    )


# --- the queue ---------------------------------------------------------------------------------------


def queue_dispatch(*, now: datetime | None = None) -> int:
    """Place waiting sessions while capacity allows; fail those that waited longer than their longest
    wait. Per GPU model and tier, in queue order, by the rule of docs/PLACEMENT.md (the queue):

    - a one-device request that does not fit blocks the ones behind it of that model (none passes it);
      an interruptible one blocks only interruptible ones, and an on-demand one that does not fit
      preempts (``_blocked_by``); a session whose preempted victims have all ended takes their held
      slots whatever blocks;
    - a multi-GPU request that does not fit lets the ones behind it pass, until it has waited
      ``QUEUE_LARGE_RESERVE_SECONDS``: then it reserves the node it fits best on (``reserve_node_pick``),
      and no other session of its model is placed there until it is.

    One short transaction per session (account, user, devices locks, as in launch). Returns how many
    were placed."""
    now = now or timezone.now()
    held_slots_free()  # slots preempted sessions hold for sessions that no longer wait
    waiting = list(
        Session.objects.filter(state=S.QUEUED).select_related(
            "gpu_model", "profile", "account", "environment__base"
        )
    )
    for session in waiting:
        if session.queued_at and now - session.queued_at > timedelta(seconds=session.queue_max_wait_seconds):
            session_end(
                session_id=session.id,
                to=S.FAILED,
                from_states=[S.QUEUED],
                reason=message("queue_timeout", minutes=session.queue_max_wait_seconds // 60),
            )
    waiting = [s for s in waiting if Session.objects.filter(id=s.id, state=S.QUEUED).exists()]
    placed = 0
    blocked: set = set()
    ready = claimers_ready(session_ids=[s.id for s in waiting])
    for session in queue_order(waiting, served=queue_served(account_ids=[s.account_id for s in waiting])):
        key = (session.gpu_model_id, session.tier)
        if key in blocked and session.id not in ready:  # slots held for it are no one else's
            continue
        try:
            outcome = _dispatch_one(session)
            if outcome is None:
                continue
            if outcome:
                placed += 1
            elif session.profile.gpu_count > 1:
                _queue_reserve(session, now=now)
            else:
                blocked |= _blocked_by(session)
        except ApplicationError as exc:
            session_end(session_id=session.id, to=S.FAILED, from_states=[S.QUEUED], reason=exc.message)
        except IntegrityError:
            log.exception("queue dispatch of %s", session.id)
    return placed


def _blocked_by(session: Session) -> set:
    """The queue keys a session that did not fit blocks. An interruptible one blocks only the
    interruptible sessions behind it (it never holds back an on-demand one). An on-demand one (the
    first of its GPU model still unplaced) claims interruptible sessions to stop for it: provided for so,
    it blocks only the interruptible ones, and the on-demand ones behind it may preempt in turn;
    otherwise it blocks both tiers (no starvation of a large request)."""
    interruptible = {(session.gpu_model_id, Session.Tier.INTERRUPTIBLE)}
    if session.tier == Session.Tier.INTERRUPTIBLE or preemption_claim(claimer=session):
        return interruptible
    return interruptible | {(session.gpu_model_id, Session.Tier.ON_DEMAND)}


def _dispatch_one(session: Session) -> bool | None:
    """Admit and place one queued session in its own transaction: True when it was placed, False when
    nothing fits, None when it left the queue meanwhile."""
    with transaction.atomic():
        _admission_lock(account_id=session.account_id, user_id=session.owner_id)
        if not Session.objects.filter(id=session.id, state=S.QUEUED).exists():
            return None
        quote = PriceQuote(session.price_id, session.price_micros_per_hour, session.card_burn_micros_per_hour)
        account_can_launch(
            account=session.account,
            quote=quote,
            gpu_model=session.gpu_model.name if session.gpu_model else "",
        )
        if not _place(session, model=session.gpu_model, profile=session.profile):
            return False
        session_owner_notify(session.id, kind="session_placed", key="session_placed")
    return True


def _queue_reserve(session: Session, *, now: datetime) -> None:
    """A multi-GPU session that waited ``QUEUE_LARGE_RESERVE_SECONDS`` and holds no node yet reserves
    the node it fits best on (one no other waiting session holds). A conditional update: a session that
    left the queue meanwhile reserves nothing."""
    waited = now - (session.queued_at or session.created_at)
    if session.reserved_node_id or waited < timedelta(seconds=settings.QUEUE_LARGE_RESERVE_SECONDS):
        return
    node_id = reserve_node_pick(
        gpu_model=session.gpu_model,
        gpu_count=session.profile.gpu_count,
        taken=[
            *nodes_reserved(gpu_model=session.gpu_model, besides=session.id),
            *nodes_lacking(session.environment),
        ],
    )
    if node_id is None:
        return
    with transaction.atomic():
        if Session.objects.filter(id=session.id, state=S.QUEUED, reserved_node__isnull=True).update(
            reserved_node_id=node_id
        ):
            node = Node.objects.only("name").get(id=node_id)
            session_event(session_id=session.id, kind="queue", line=message("reserved_node", node=node.name))


def node_sessions_lost(*, node: Node, reason: Message | str) -> int:
    """A node went down: its sessions on the node become lost, billed to their last alive time; their
    slots stay held until the agent confirms the workloads gone (or an admin force-frees)."""
    lost = 0
    for session_id, last_alive in Session.objects.filter(
        node=node, state__in=[S.PLACING, S.STARTING, S.RUNNING, S.STOPPING]
    ).values_list("id", "last_alive_at"):
        lost += session_end(
            session_id=session_id,
            to=S.LOST,
            reason=reason,
            ended_at=last_alive or timezone.now(),
            free=False,
            from_states=[S.PLACING, S.STARTING, S.RUNNING, S.STOPPING],
        )
    return lost
