"""Celery tasks: thin, take ids, idempotent by session id. They drive agents over HTTP after the
database has the desired state, and never hold a database lock across an agent call."""

from __future__ import annotations

import logging
import uuid
from collections import Counter
from datetime import datetime, timedelta

from celery import shared_task
from django.conf import settings
from django.utils import timezone

from core.compiled import Lookup
from provisioner import agent_client
from provisioner.messages import Message, message, message_load
from provisioner.models import HomeRemoval, Node, Session
from provisioner.selectors import workload_spec
from provisioner.services import home_retention, limits
from provisioner.services import sessions as lifecycle
from provisioner.services.heartbeats import nodes_liveness_sweep
from provisioner.services.home_storage import home_storage_charge

log = logging.getLogger("provisioner.tasks")
S = Session.State
POLL_SECONDS = 2.0
QUICK_POLL_SECONDS = 0.3  # the first polls after a put: a JupyterLab usually answers within seconds
QUICK_POLLS = 30


def _poll_countdown(attempt: int) -> float:
    return QUICK_POLL_SECONDS if attempt < QUICK_POLLS else POLL_SECONDS


def _backoff(retries: int) -> float:
    return min(2.0**retries, 30.0)


# The session a start or stop task works on (every launch queues one of each), compiled once.
_SESSION = Lookup(
    lambda sid: Session.objects.select_related(
        "node", "device", "environment__base", "owner", "profile"
    ).filter(id=sid),
    key_types=(uuid.UUID,),
)


def _session(session_id: str) -> Session | None:
    return _SESSION.first(session_id)


def _start_expired(session: Session) -> bool:
    since = session.placed_at or session.created_at
    return timezone.now() - since > timedelta(seconds=settings.SESSION_START_TIMEOUT_SECONDS)


def _fail_start(session: Session, reason: Message | str) -> None:
    if lifecycle.session_start_failed(session_id=session.id, reason=reason):
        workload_delete_task.delay(session.node_id, str(session.id))


def _session_to_start(session_id: str) -> Session | str:
    """The session, while it is still to be started; else what the task answers: "skip" (gone, or
    moved on meanwhile) or "timeout" (it took too long, and is failed now)."""
    session = _session(session_id)
    if session is None or session.state not in (S.PLACING, S.STARTING):
        return "skip"
    if _start_expired(session):
        _fail_start(session, message("start_timeout", seconds=settings.SESSION_START_TIMEOUT_SECONDS))
        return "timeout"
    return session


@shared_task(bind=True, max_retries=None, acks_late=True)
def session_start_task(self, session_id: str) -> str:
    """PUT the workload on its node's agent (idempotent there too), then poll until it runs."""
    session = _session_to_start(session_id)
    if isinstance(session, str):
        return session
    try:
        agent_client.workload_put(session.node, workload_spec(session))
    except agent_client.AgentRefusal as exc:
        if exc.code == "environment_unavailable":  # the user's to mend (their venv) or an operator's
            why = message(
                "environment_unavailable",
                environment=session.environment.name,
                node=session.node.name,
                why=exc.message,
            )
        else:
            why = message("node_refused", code=exc.code, why=exc.message)
        _fail_start(session, why)
        return "refused"
    except agent_client.AgentUnreachable as exc:
        log.warning("start %s: %s", session_id, exc)
        raise self.retry(countdown=_backoff(self.request.retries))
    lifecycle.session_mark_starting(session_id=session.id)
    session_poll_task.apply_async((session_id,), countdown=_poll_countdown(0))
    return "put"


@shared_task(bind=True, max_retries=None, acks_late=True)
def session_poll_task(self, session_id: str, attempt: int = 0) -> str:
    """Until the session runs (or fails, or times out): GET its workload from the agent."""
    session = _session_to_start(session_id)
    if isinstance(session, str):
        return session
    try:
        status = agent_client.workload_get(session.node, session_id)
    except (agent_client.AgentUnreachable, agent_client.AgentRefusal) as exc:
        log.warning("poll %s: %s", session_id, exc)
        raise self.retry(countdown=_backoff(self.request.retries))
    if status is None:
        session_start_task.delay(session_id)  # the agent lost it (restart): put it again
        return "re-put"
    if status.get("state") == "running":
        lifecycle.session_mark_running(session_id=session.id, upstream=status.get("upstream") or "")
        return "running"
    if status.get("state") in ("exited", "failed"):
        _fail_start(session, message("could_not_start", why=status.get("exit_reason") or status.get("state")))
        return "failed"
    self.apply_async((session_id, attempt + 1), countdown=_poll_countdown(attempt + 1))
    return "waiting"


@shared_task(bind=True, max_retries=None, acks_late=True)
def session_stop_task(self, session_id: str) -> str:
    """DELETE the workload; once the agent confirms it gone, the session is stopped and its slots freed.
    While the agent cannot be reached, retry with backoff (a down node's sessions end as lost)."""
    session = _session(session_id)
    if session is None or session.state != S.STOPPING:
        return "skip"
    if session.node is None or session.node.state == Node.State.DOWN:
        return "node-down"
    try:
        agent_client.workload_delete(session.node, session_id)
    except (agent_client.AgentUnreachable, agent_client.AgentRefusal) as exc:
        log.warning("stop %s: %s", session_id, exc)
        raise self.retry(countdown=_backoff(self.request.retries))
    # Stopped for the reason it was asked to stop for.
    reason = (
        message_load(session.reason_key, session.reason_params, session.reason)
        if session.reason
        else message("stopped")
    )
    lifecycle.session_end(session_id=session.id, to=S.STOPPED, reason=reason, from_states=[S.STOPPING])
    return "stopped"


@shared_task(bind=True, max_retries=8, acks_late=True)
def workload_delete_task(self, node_id: int, session_id: str) -> str:
    """Best effort: remove a failed session's workload from its agent (the heartbeat heals the rest)."""
    node = Node.objects.filter(id=node_id).first()
    if node is None:
        return "skip"
    try:
        agent_client.workload_delete(node, session_id)
    except (agent_client.AgentUnreachable, agent_client.AgentRefusal):
        raise self.retry(countdown=_backoff(self.request.retries))
    return "deleted"


@shared_task
def nodes_liveness_task() -> list[str]:
    return nodes_liveness_sweep()


@shared_task(ignore_result=True)
def home_storage_charge_task() -> int:
    """Hourly: charge today's home storage (once per user and UTC day, whichever run gets there)."""
    return home_storage_charge()


@shared_task
def queue_dispatch_task() -> int:
    return lifecycle.queue_dispatch()


@shared_task
def sessions_enforce_limits_task() -> dict:
    counts = {**limits.sessions_enforce_limits(), "preempted": limits.sessions_preempt_due()}
    cutoff = timezone.now() - timedelta(seconds=settings.SESSION_START_TIMEOUT_SECONDS)
    for session in Session.objects.filter(state__in=[S.PLACING, S.STARTING], placed_at__lt=cutoff):
        _fail_start(session, message("start_timeout", seconds=settings.SESSION_START_TIMEOUT_SECONDS))
    return counts


@shared_task
def homes_retention_task() -> dict:
    """Hourly: plan, warn and carry out the removal of unused homes (docs/STORAGE.md, "Retention").
    Idempotent: what was planned, told and removed is recorded and never done twice; a node that is down
    or refuses (``home_in_use``) is tried again at the next run."""
    now = timezone.now()
    counts = Counter(
        planned=home_retention.home_removals_plan(now=now), warned=home_retention.home_removals_warn(now=now)
    )
    for removal in home_retention.home_removals_due(now=now):
        counts[_home_remove(removal, now)] += 1
    if settings.HOMES_BACKEND == "shared" and (finished := home_retention.home_removals_finish_shared()):
        counts["leftovers_removed"] = finished
    return dict(counts)


def _home_remove(removal: HomeRemoval, now: datetime) -> str:
    """One due removal: by this worker on the shared root, else by the home's node's agent."""
    if removal.node is None:
        if settings.HOMES_BACKEND != "shared":
            home_retention.home_removal_failed(removal_id=removal.id, error="HOMES_BACKEND is not shared")
            return "no_shared_root"
        try:
            return home_retention.home_remove_shared(removal_id=removal.id, now=now)
        except OSError as exc:
            log.warning("removing home %s: %s", removal.name, exc)
            home_retention.home_removal_failed(
                removal_id=removal.id, error=f"{exc.__class__.__name__}: {exc}"
            )
            return "failed"
    if removal.node.state == Node.State.DOWN:
        home_retention.home_removal_failed(removal_id=removal.id, error="the node is down")
        return "node_down"
    if not HomeRemoval.objects.filter(HomeRemoval.PENDING, id=removal.id).exists():
        return "skip"  # the user launched meanwhile
    try:
        agent_client.home_delete(removal.node, removal.name)
    except agent_client.AgentUnreachable as exc:
        home_retention.home_removal_failed(removal_id=removal.id, error=str(exc))
        return "unreachable"
    except agent_client.AgentRefusal as exc:
        home_retention.home_removal_failed(removal_id=removal.id, error=str(exc))
        return exc.code
    home_retention.home_removal_done(removal_id=removal.id, now=now)
    return "removed"
