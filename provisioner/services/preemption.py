"""Preemption: an on-demand session that finds no room takes the slots of interruptible sessions.

- **Claim** (``preemption_claim``, from a launch or the head of the queue): choose the victims
  (``provisioner.preemption.victims_choose``: one device, the fewest, then the newest), mark each
  ``preempted_for`` the waiting session by a conditional update (so no two requests claim one victim),
  and warn each through the stop warnings (kind ``preempt``, due after SESSION_PREEMPT_GRACE_SECONDS).
- **Stop**: the limits sweep stops a victim when its warning is due (``limits.sessions_preempt_due``).
- **Hand over**: an ended victim's slots stay held (its allocation is kept) while the session it was
  stopped for waits, so no other request takes them; that session's placement frees them and takes its
  block in one transaction (``sessions._place``). If it is placed elsewhere first, or ends, its claim is
  released (``preemption_release``): running victims are spared, held slots freed.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from provisioner import enqueue
from provisioner.messages import message
from provisioner.models import Allocation, Session, StopWarning
from provisioner.placement import allocation_free, free_index, request_for
from provisioner.preemption import Preemptible, victims_choose
from provisioner.selectors import preemptible_sessions
from provisioner.services.events import session_event
from provisioner.services.stop_warnings import stop_warn, stop_warnings_clear

S = Session.State
CLAIM_TRIES = 3
# The ended states whose slots a victim holds for its claimer. A lost one's slots follow the lost rule
# instead: held until its agent confirms the workload gone, then freed for anyone.
HELD = (S.STOPPED, S.FAILED)


class _Claimed(Exception):
    """A victim was claimed by another request meanwhile: choose again."""


def preemption_grace() -> timedelta:
    return timedelta(seconds=settings.SESSION_PREEMPT_GRACE_SECONDS)


def preemption_claim(*, claimer: Session, now: datetime | None = None) -> list:
    """For a queued on-demand session that found no room: choose interruptible sessions whose stop
    makes room for it on one device, claim them for it and warn them. Returns the ids of the victims it
    waits for: those just claimed, or those it had claimed already and that still run (empty: nothing
    to preempt). Call inside the caller's transaction, after placement failed.

    Each claim is a conditional update (running, interruptible, unclaimed), in session id order (no
    deadlock between two claimers); a claim lost to a concurrent request rolls the savepoint back and
    chooses again, at most CLAIM_TRIES times."""
    if claimer.tier != Session.Tier.ON_DEMAND or claimer.gpu_model_id is None:
        return []
    waiting_on = list(
        Session.objects.filter(preempted_for_id=claimer.id)
        .exclude(state__in=Session.ENDED)
        .values_list("id", flat=True)
    )
    if waiting_on:
        return waiting_on
    now = now or timezone.now()
    request = request_for(gpu_model=claimer.gpu_model, profile=claimer.profile)
    for _try in range(CLAIM_TRIES):
        index, _where = free_index(gpu_model=claimer.gpu_model)
        victims = victims_choose(
            index, request, preemptible_sessions(gpu_model_id=claimer.gpu_model_id, now=now)
        )
        if not victims:
            return []
        try:
            with transaction.atomic():
                _victims_claim(victims, claimer=claimer, now=now)
        except _Claimed:
            continue
        return [v.session_id for v in victims]
    return []


def _victims_claim(victims: tuple[Preemptible, ...], *, claimer: Session, now: datetime) -> None:
    """Mark and warn every victim, or raise _Claimed when one was taken meanwhile."""
    owners = {}
    for victim in sorted(victims, key=lambda v: str(v.session_id)):
        claimed = Session.objects.filter(
            id=victim.session_id,
            state=S.RUNNING,
            tier=Session.Tier.INTERRUPTIBLE,
            preempted_for__isnull=True,
        ).update(preempted_for=claimer.id)
        if not claimed:
            raise _Claimed
        owners[victim.session_id] = Session.objects.values_list("owner_id", flat=True).get(
            id=victim.session_id
        )
    for session_id, owner_id in owners.items():
        stop_warn(
            session_id=session_id,
            owner_id=owner_id,
            kind=StopWarning.Kind.PREEMPT,
            due_at=now + preemption_grace(),
            key="stop_warning_preempt",
            now=now,
        )
    session_event(session_id=claimer.id, kind="queue", line=message("preempting", count=len(victims)))


def preemption_release(*, claimer_id, now: datetime | None = None) -> int:
    """The waiting session ``claimer_id`` was placed elsewhere or ended: its running victims are spared
    (unmarked, warnings cleared) and the slots its ended victims hold are freed (a queue dispatch
    follows). Victims already stopping stop, and resume if they asked to. Returns how many were spared.
    Idempotent; inside the caller's transaction."""
    now = now or timezone.now()
    running = Session.objects.filter(preempted_for_id=claimer_id, state=S.RUNNING)
    spared = list(running.values_list("id", flat=True))
    # conditional: one the sweep stops meanwhile (state no longer running) keeps its claim
    running.filter(id__in=spared).update(preempted_for=None)
    if spared:
        stop_warnings_clear(session_ids=spared, kind=StopWarning.Kind.PREEMPT, now=now)
    held_slots_free(claimer_ids=[claimer_id])
    return len(spared)


def held_slots_free(*, claimer_ids=None) -> int:
    """Free the slots ended victims hold for sessions that no longer wait (all such, or those of
    ``claimer_ids``): the session was placed, ended, or its claim released. A queue dispatch follows
    when anything was freed. Returns how many allocations were freed."""
    held = Allocation.objects.filter(session__state__in=HELD, session__preempted_for__isnull=False).exclude(
        session__preempted_for__state=S.QUEUED
    )
    if claimer_ids is not None:
        held = held.filter(session__preempted_for_id__in=list(claimer_ids))
    freed = sum(
        allocation_free(session_id=session_id) for session_id in held.values_list("session_id", flat=True)
    )
    if freed:
        enqueue.queue_dispatch()
    return freed


def held_slots_take(*, claimer: Session) -> int | None:
    """The device whose slots ``claimer``'s ended victims hold, after freeing them inside the caller's
    transaction (the caller places ``claimer`` there before it commits, so nobody else sees them free);
    None when it has no victims or some still run."""
    victims = list(
        Session.objects.filter(preempted_for_id=claimer.id).values_list("id", "state", "device_id")
    )
    if not victims or any(state not in Session.ENDED for _id, state, _device in victims):
        return None
    for session_id, state, _device in victims:
        if state in HELD:
            allocation_free(session_id=session_id)
    return victims[0][2]


def claimers_ready(*, session_ids) -> set:
    """Of these queued sessions, those whose victims have all ended: their slots wait for them."""
    claimed = Session.objects.filter(preempted_for_id__in=list(session_ids))
    waiting_on = set(claimed.exclude(state__in=Session.ENDED).values_list("preempted_for_id", flat=True))
    return set(claimed.values_list("preempted_for_id", flat=True)) - waiting_on
