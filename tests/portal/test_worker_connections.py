"""A Celery worker keeps its PostgreSQL connections between tasks, as the web process does between
requests (``CONN_MAX_AGE``), and drops one that broke."""

from __future__ import annotations

import time

import pytest
from django.db import connection

from conftest import database_url_for_subprocess, start_celery, subprocess_env
from portal.celery import app

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

NAME = "worker-connections-test"


def _backends() -> set[int]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT pid FROM pg_stat_activity WHERE application_name = %s", [NAME])
        return {row[0] for row in cursor.fetchall()}


def _run(worker, tasks: int) -> None:
    """Queue ``tasks`` daily grants (one query each) and wait until the worker logged them done."""
    done = worker.log.read_text().count("succeeded in")
    for _ in range(tasks):
        app.send_task("portal.tasks.daily_grants_task")
    deadline = time.monotonic() + 60
    while worker.log.read_text().count("succeeded in") < done + tasks:
        assert time.monotonic() < deadline, worker.log.read_text()[-3000:]
        time.sleep(0.1)


def test_a_worker_keeps_its_connections_between_tasks_and_replaces_a_broken_one(tmp_path):
    """Celery's own Django fixup closed the connection around every task: each task started (and
    ended) a PostgreSQL backend, a tenth of the worker's CPU under `make load`."""
    url = database_url_for_subprocess()
    url += ("&" if "?" in url else "?") + f"application_name={NAME}"
    worker = start_celery(
        "worker", tmp_path, env=subprocess_env(DATABASE_URL=url, CARD_DAILY_GRANT_MICROS="1")
    )
    try:
        deadline = time.monotonic() + 60
        while not app.control.ping(timeout=0.5):
            assert worker.process.poll() is None and time.monotonic() < deadline, worker.log.read_text()[
                -3000:
            ]
        _run(worker, 8)
        first = _backends()
        assert 1 <= len(first) <= 4  # --concurrency 4: a connection per thread that ran a task
        _run(worker, 8)
        assert first <= _backends() and len(_backends()) <= 4  # the same backends, none new beyond 4

        with connection.cursor() as cursor:  # PostgreSQL ends them (a restart, an idle timeout)
            cursor.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = %s", [NAME]
            )
        _run(worker, 8)  # each thread finds its connection broken, replaces it, and the task succeeds
        assert "Task portal.tasks.daily_grants_task" in worker.log.read_text()
        assert "raised unexpected" not in worker.log.read_text()
        assert _backends() and not _backends() & first
    finally:
        worker.stop()
