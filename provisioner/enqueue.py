"""The one door through which the provisioner's services queue Celery tasks.

Services never import ``provisioner.tasks`` (the tasks call the services): they queue work here, by the
tasks' registered names, after the transaction that made the work commits, so a worker never reads a
row the web process has not committed yet and a rolled-back launch queues nothing.
"""

from __future__ import annotations

from celery import current_app
from django.db import transaction

SESSION_START = "provisioner.tasks.session_start_task"
SESSION_STOP = "provisioner.tasks.session_stop_task"
QUEUE_DISPATCH = "provisioner.tasks.queue_dispatch_task"


def _after_commit(task_name: str, *args: str) -> None:
    transaction.on_commit(lambda: current_app.send_task(task_name, args=args))


def session_start(session_id) -> None:
    """Put the placed session's workload on its agent, then poll it until it runs."""
    _after_commit(SESSION_START, str(session_id))


def session_stop(session_id) -> None:
    """Delete the stopping session's workload on its agent, then end the session."""
    _after_commit(SESSION_STOP, str(session_id))


def queue_dispatch() -> None:
    """Place what waits in the queue on the slots just freed."""
    _after_commit(QUEUE_DISPATCH)
