"""The ASGI web process under many concurrent requests: a bounded pool of PostgreSQL connections."""

from __future__ import annotations

import subprocess
import sys
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
    web process kept one per thread it ever ran, until PostgreSQL refused more (`make load` at 50 users).
    The pool's size comes from portal/asgi.py, as `make run` and compose get it: the settings must not be
    read before that (uvicorn imports the WebSocket relay before the application; a relay that read
    them brought the unpooled connections back)."""
    url = database_url_for_subprocess()
    url += ("&" if "?" in url else "?") + "application_name=web-pool-test"
    env = subprocess_env(DATABASE_URL=url, WEB_CONCURRENCY="1", WEB_DATABASE_CONNECTIONS="4")
    env.pop("DATABASE_POOL_SIZE", None)
    web = start_web(tmp_path, env=env)
    try:
        with httpx.Client(base_url=web.url, timeout=60) as client, ThreadPoolExecutor(32) as pool:
            statuses = list(pool.map(lambda _: client.get("/").status_code, range(160)))
        assert set(statuses) == {200}
        assert 1 <= _connections_of("web-pool-test") <= 4
    finally:
        web.stop()


def test_the_web_process_as_served_takes_its_pool_size_from_the_asgi_module():
    """uvicorn loads the ``--ws`` class before the application: loaded as the Procfile serves the portal,
    the settings must still see the pool size that portal/asgi.py sets (a relay that read the settings
    on import left every web process unpooled, and `make load` ran PostgreSQL out of connections)."""
    script = (
        "import uvicorn\n"
        "config = uvicorn.Config('portal.asgi:application', ws='portal.ws_relay:WebSocketRelay')\n"
        "config.load()\n"
        "from django.conf import settings\n"
        "print(settings.DATABASES['default']['OPTIONS'].get('pool', {}).get('max_size'))\n"
    )
    env = subprocess_env(WEB_CONCURRENCY="2", WEB_DATABASE_CONNECTIONS="40")
    env.pop("DATABASE_POOL_SIZE", None)
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.stdout.strip().splitlines()[-1:] == ["20"], done.stderr[-2000:]


def test_django_runs_a_request_in_one_thread_with_no_hop_to_the_event_loop():
    """Every middleware is synchronous: the chain is built for sync mode and run whole in the request's
    thread (portal/asgi.py), not handed to the event loop and back between the middleware and the view
    (which, under load, waits for the loop's turn twice per request)."""
    import asyncio

    from asgiref.sync import iscoroutinefunction

    from portal.asgi import application, django_application

    assert not iscoroutinefunction(django_application._middleware_chain)

    async def get() -> httpx.Response:
        transport = httpx.ASGITransport(app=application)
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
            return await client.get("/login/")

    with ThreadPoolExecutor(1) as pool:  # a loop of its own, whatever the test run has running
        answer = pool.submit(asyncio.run, get()).result()
    assert answer.status_code == 200 and answer.headers["Server-Timing"].startswith("app;dur=")
