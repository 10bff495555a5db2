"""The retention rule for homes (docs/STORAGE.md, "Retention"): plan, warn, remove, cancel.

- **Plan.** A home whose user has launched no session for ``HOMES_RETENTION_IDLE_DAYS`` (the clock is
  the user's last launched session) is planned for removal once it is due within
  ``HOMES_RETENTION_WARN_DAYS``, never sooner than that from now; a deactivated user's home
  ``HOMES_RETENTION_DELETED_DAYS`` after it is first seen so, a deleted user's that long after the
  deletion. One ``HomeRemoval`` per home: on the ``shared`` root one per user, on ``local`` homes one per
  node the user's sessions ran on.
- **Warn.** The user is told (a notice, and an email in their language) ``HOMES_RETENTION_WARN_DAYS``
  before and again a day before; each warning is claimed by a conditional update, so it goes out once,
  and it pushes the removal back if it went out late, so the promise holds. A deactivated or deleted
  user cannot sign in and is not told.
- **Remove.** Shared: the worker moves the folder away and empties it, as an agent does (agents/homes.py).
  Local: the node's agent does (``DELETE /v1/homes/<name>``); a node that is down or refuses
  (``home_in_use``) is tried again at the next run. Removal is recorded once; a repeat finds nothing due.
- **Cancel.** The user's next launch cancels their pending removals (``home_removals_cancel``, in the
  launch's transaction); a reactivated user's are cancelled by the next run.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from datetime import datetime, timedelta
from pathlib import Path

from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import IntegrityError, transaction
from django.db.models import Exists, F, Max, OuterRef, Q, Value
from django.db.models.functions import Coalesce, Greatest
from django.utils import timezone

from agents import homes as agent_homes
from notices.services import notify
from provisioner.models import HomeRemoval, HomeUsage, Session
from provisioner.selectors import workload_user

R = HomeRemoval.Reason
S = Session.State
LIVE = (S.PLACING, S.STARTING, S.RUNNING, S.STOPPING)
FINAL_WARNING = timedelta(days=1)
# The task runs hourly: a warning is owed up to a run early, so that it comes on time and the date it
# names stands (a late one moves the removal back to keep the promise).
WARNING_SLACK = timedelta(hours=1)


def _pending():
    return HomeRemoval.objects.filter(HomeRemoval.PENDING)


def _warn_ahead() -> timedelta:
    return timedelta(days=settings.HOMES_RETENTION_WARN_DAYS)


def _shared() -> bool:
    return settings.HOMES_BACKEND == "shared"


def _homes_of(users: list) -> dict[int, list[int | None]]:
    """Where each user's home lives: the shared root (None) where their folder is there, or every node
    their sessions ran on."""
    if _shared():
        root = Path(settings.HOMES_SHARED_ROOT)
        return {user.pk: [None] for user in users if (root / workload_user(user)).is_dir()}
    homes: dict[int, list[int | None]] = defaultdict(list)
    pairs = (
        Session.objects.filter(owner_id__in=[user.pk for user in users], node__isnull=False)
        .values_list("owner_id", "node_id")
        .distinct()
    )
    for user_id, node_id in pairs:
        homes[user_id].append(node_id)
    return homes


def _planned(*, user, node_id: int | None, reason: str, due_at: datetime, last_launch_at, now) -> bool:
    """One pending removal of this home; False where one is pending already (the constraint's word)."""
    try:
        with transaction.atomic():
            HomeRemoval.objects.create(
                user=user,
                name=workload_user(user),
                node_id=node_id,
                reason=reason,
                last_launch_at=last_launch_at,
                planned_at=now,
                due_at=due_at,
            )
    except IntegrityError:
        return False
    return True


def home_removals_plan(*, now: datetime) -> int:
    """Plan the removals the rule calls for now (module docstring). Idempotent: a home with a pending
    removal, or one removed since the user's last launch, is not planned again. Cancels the pending idle
    removals of users who launched since (a launch that bypassed ``home_removals_cancel``) and the
    pending removals of reactivated users. Returns removals planned."""
    _pending().filter(reason=R.IDLE).filter(
        Exists(Session.objects.filter(owner=OuterRef("user"), created_at__gt=OuterRef("last_launch_at")))
    ).update(cancelled_at=now)
    _pending().filter(reason=R.INACTIVE, user__is_active=True).update(cancelled_at=now)
    idle_days = settings.HOMES_RETENTION_IDLE_DAYS
    users = get_user_model().objects.annotate(last_launch=Max("gpu_sessions__created_at"))
    wanted = Q(is_active=False)
    if idle_days > 0:
        wanted |= Q(is_active=True, last_launch__lte=now - timedelta(days=idle_days) + _warn_ahead())
    users = list(users.filter(wanted, last_launch__isnull=False))
    homes = _homes_of(users)
    planned_last: dict[tuple[int, int | None], datetime] = {}  # pending or carried out, by home
    for user_id, node_id, planned_at in (
        HomeRemoval.objects.filter(user__in=users)
        .filter(HomeRemoval.PENDING | Q(removed_at__isnull=False))
        .values_list("user_id", "node_id", "planned_at")
    ):
        planned_last[user_id, node_id] = max(planned_at, planned_last.get((user_id, node_id), planned_at))
    made = 0
    for user in users:
        if user.is_active:
            reason, due_at = R.IDLE, max(user.last_launch + timedelta(days=idle_days), now + _warn_ahead())
        else:
            reason, due_at = R.INACTIVE, now + timedelta(days=settings.HOMES_RETENTION_DELETED_DAYS)
        for node_id in homes.get(user.pk, []):
            if planned_last.get((user.pk, node_id), user.last_launch) > user.last_launch:
                continue  # planned since the last launch: pending, or removed
            made += _planned(
                user=user,
                node_id=node_id,
                reason=reason,
                due_at=due_at,
                last_launch_at=user.last_launch,
                now=now,
            )
    return made


def home_removals_plan_deleted(*, user, now: datetime | None = None) -> int:
    """A user is being deleted (pre_delete): plan their homes' removal ``HOMES_RETENTION_DELETED_DAYS``
    from now, by name (the row outlives the user). Their pending removals come forward to that date if
    later. Homes: the shared root, or the node that last measured their home (a user with sessions
    cannot be deleted: their sessions protect them). Returns removals planned."""
    now = now or timezone.now()
    due_at = now + timedelta(days=settings.HOMES_RETENTION_DELETED_DAYS)
    pending = _pending().filter(user=user)
    pending.update(reason=R.DELETED)
    pending.filter(due_at__gt=due_at).update(due_at=due_at)
    nodes = set(_homes_of([user]).get(user.pk, []))
    if not _shared():
        nodes |= set(
            HomeUsage.objects.filter(user=user, node__isnull=False).values_list("node_id", flat=True)
        )
    made = 0
    for node_id in nodes:
        made += _planned(
            user=user, node_id=node_id, reason=R.DELETED, due_at=due_at, last_launch_at=None, now=now
        )
    return made


def home_removals_cancel(*, user_id: int, now: datetime | None = None) -> int:
    """The user launched: their pending removals are off. Returns how many were cancelled."""
    return _pending().filter(user_id=user_id).update(cancelled_at=now or timezone.now())


def home_removals_warn(*, now: datetime) -> int:
    """Tell each active user whose home is due within the warning time, then again within a day.
    Each row's warning is claimed by a conditional update (once, however many workers run this), and
    the claim moves ``due_at`` to at least the warning's lead from now. One notice per user and stage,
    whichever of their homes it is about. Returns notices made."""
    told = 0
    for stage, field, ahead in (
        ("final", "warned_final_at", FINAL_WARNING),
        ("first", "warned_at", _warn_ahead()),
    ):
        rows = _pending().filter(
            user__isnull=False,
            user__is_active=True,
            due_at__lte=now + ahead + WARNING_SLACK,
            **{f"{field}__isnull": True},
        )
        claimed: dict[int, list[HomeRemoval]] = defaultdict(list)
        for row in rows:
            marks = {field: now}
            if stage == "final":  # it stands for the first too, where both are owed at once
                marks["warned_at"] = Coalesce(F("warned_at"), Value(now))
            if HomeRemoval.objects.filter(
                HomeRemoval.PENDING, id=row.id, **{f"{field}__isnull": True}
            ).update(due_at=Greatest(F("due_at"), Value(now + ahead)), **marks):
                row.refresh_from_db(fields=["due_at"])
                claimed[row.user_id].append(row)
        for user_id, removals in claimed.items():
            first = min(removals, key=lambda r: (r.due_at, r.id))
            told += notify(
                users=[user_id],
                kind="home_removal",
                key="home_removal",
                params={
                    "date": first.due_at.strftime("%Y-%m-%d %H:%M"),
                    "days": settings.HOMES_RETENTION_IDLE_DAYS,
                },
                dedupe_key=f"home-removal:{first.id}:{stage}",
                url="/files/",
            )
    return told


def home_removals_due(*, now: datetime) -> list[HomeRemoval]:
    """Pending removals whose time has come: for an active user only once told a day before."""
    told = Q(user__isnull=True) | Q(user__is_active=False) | Q(warned_final_at__isnull=False)
    return list(_pending().filter(told, due_at__lte=now).select_related("node").order_by("due_at", "id"))


def home_removal_failed(*, removal_id: int, error: str) -> None:
    """Record a try that did not remove the home (a node down, ``home_in_use``): the next run tries again."""
    HomeRemoval.objects.filter(id=removal_id).update(attempts=F("attempts") + 1, last_error=error[:300])


def home_removal_done(*, removal_id: int, now: datetime) -> bool:
    """Record the home removed (even where a launch cancelled it while the agent was removing it: the
    record says what happened). Its last measured figures go with it, where they were this home's."""
    removal = HomeRemoval.objects.filter(id=removal_id, removed_at__isnull=True).first()
    if removal is None:
        return False
    HomeRemoval.objects.filter(id=removal_id, removed_at__isnull=True).update(
        removed_at=now, cancelled_at=None, attempts=F("attempts") + 1, last_error=""
    )
    if removal.user_id is not None:
        usage = HomeUsage.objects.filter(user_id=removal.user_id)
        if removal.node_id is not None:
            usage = usage.filter(node_id=removal.node_id)
        usage.delete()
    return True


def home_remove_shared(*, removal_id: int, now: datetime) -> str:
    """Remove a home on the shared root. Under the lock of the user's row (the one each launch of theirs
    takes, so a launch waits, or this finds its session and its cancellation), then the removal's row:
    the removal still pending and no session of theirs placing, starting, running or stopping, the
    folder is moved away in one rename and the removal recorded. The folder is emptied after commit.
    Returns "removed", "gone" (no folder was there), "in_use" or "skip" (no longer pending)."""
    root = Path(settings.HOMES_SHARED_ROOT)
    user_id = HomeRemoval.objects.filter(id=removal_id).values_list("user_id", flat=True).first()
    with transaction.atomic():
        if user_id is not None:  # the user's row first, then the removal's: the launch's order
            get_user_model().objects.select_for_update(no_key=True).filter(pk=user_id).first()
        removal = _pending().select_for_update().filter(id=removal_id, node__isnull=True).first()
        if removal is None:
            return "skip"
        if Session.objects.filter(owner_id=removal.user_id, state__in=LIVE).exists():
            home_removal_failed(removal_id=removal_id, error="a session of the user is live")
            return "in_use"
        try:
            detached = agent_homes.home_detach(root, removal.name)
        except FileNotFoundError:
            detached = None
        home_removal_done(removal_id=removal_id, now=now)
    if detached is None:
        return "gone"
    with contextlib.suppress(FileNotFoundError):
        agent_homes.detached_remove(root, detached)
    return "removed"


def home_removals_finish_shared() -> int:
    """Finish the shared root's removals that a killed worker cut short (``agents.homes.removing_sweep``);
    how many went."""
    return agent_homes.removing_sweep(Path(settings.HOMES_SHARED_ROOT))
