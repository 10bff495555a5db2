"""The one door through which the provisioner's services queue Celery tasks.

Services never import ``provisioner.tasks`` (the tasks call the services): they queue work here, by the
tasks' registered names, after the transaction that made the work commits, so a worker never reads a
row the web process has not committed yet and a rolled-back launch queues nothing.
"""

from __future__ import annotations

from celery import current_app
from django.db import transaction
from kombu.exceptions import OperationalError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from core.outage import outage

SESSION_START = "provisioner.tasks.session_start_task"
SESSION_STOP = "provisioner.tasks.session_stop_task"
QUEUE_DISPATCH = "provisioner.tasks.queue_dispatch_task"


# A broker that cannot be reached fails nothing: the change is committed, and what the task would have
# done happens anyway. The agents' heartbeats carry the desired workloads (a placed session is put and
# marked running, a stopping one deleted and marked stopped: provisioner/services/heartbeats.py) and beat
# dispatches the queue every QUEUE_DISPATCH_SECONDS. So the request answers as usual, a few seconds
# slower to take effect, and the outage is logged once.
_broker = outage("broker", what_happens="tasks not queued; agents' heartbeats and beat's sweeps converge")


def _send(task_name: str, args: tuple[str, ...]) -> None:
    if _broker.skipping():
        return
    try:
        current_app.send_task(task_name, args=args)
    except (OperationalError, RedisConnectionError, RedisTimeoutError) as exc:
        _broker.failed(exc)
    else:
        _broker.answered()


def _after_commit(task_name: str, *args: str) -> None:
    transaction.on_commit(lambda: _send(task_name, args))


def session_start(session_id) -> None:
    """Put the placed session's workload on its agent, then poll it until it runs."""
    _after_commit(SESSION_START, str(session_id))


def session_stop(session_id) -> None:
    """Delete the stopping session's workload on its agent, then end the session."""
    _after_commit(SESSION_STOP, str(session_id))


def queue_dispatch() -> None:
    """Place what waits in the queue on the slots just freed."""
    _after_commit(QUEUE_DISPATCH)
