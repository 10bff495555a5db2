"""The ASGI web process under many concurrent requests: a bounded pool of PostgreSQL connections."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from django.db import connection

from conftest import database_url_for_subprocess, subprocess_env
from tests.stack import start_web

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def _connections_of(application_name: str) -> int:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s", [application_name]
        )
        return cursor.fetchone()[0]


def test_the_web_process_holds_no_more_connections_than_its_pool(tmp_path):
    """Each request's sync code runs in a thread of its own under ASGI: with persistent connections the
    web process kept one per thread it ever ran, until PostgreSQL refused more (`make load` at 50 users)."""
    url = database_url_for_subprocess()
    url += ("&" if "?" in url else "?") + "application_name=web-pool-test"
    web = start_web(tmp_path, env=subprocess_env(DATABASE_URL=url, DATABASE_POOL_SIZE="4"))
    try:
        with httpx.Client(base_url=web.url, timeout=60) as client, ThreadPoolExecutor(32) as pool:
            statuses = list(pool.map(lambda _: client.get("/").status_code, range(160)))
        assert set(statuses) == {200}
        assert 1 <= _connections_of("web-pool-test") <= 4
    finally:
        web.stop()
