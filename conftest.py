"""Suite-wide fixtures: real PostgreSQL and Redis (embedded unless DATABASE_URL / REDIS_URL are set),
real Celery workers as subprocesses, and a real Chromium driven by Playwright."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent
pytest_plugins = ["tests.outage"]  # broker_down: the Celery app pointed at a closed port

CHROMIUM = os.environ.get("CHROMIUM_PATH") or shutil.which("chromium") or "/usr/bin/chromium"
HAVE_CHROMIUM = Path(CHROMIUM).exists()
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-quic",
    "--no-first-run",
]
ARTIFACTS = ROOT / "test-artifacts"


def pytest_report_header(config):
    if HAVE_CHROMIUM:
        return f"browser tests: Chromium at {CHROMIUM}"
    return (
        "browser tests: SKIPPED — no Chromium on this machine "
        "(install Debian's 'chromium' package, or set CHROMIUM_PATH)"
    )


def pytest_collection_modifyitems(config, items):
    if HAVE_CHROMIUM:
        return
    skip = pytest.mark.skip(reason="no Chromium on this machine: apt-get install chromium")
    for item in items:
        if "browser" in item.keywords:
            item.add_marker(skip)


def database_url_for_subprocess() -> str:
    """A libpq URL of the test database, for subprocesses (workers, web servers) started by tests."""
    from django.conf import settings
    from django.db import connection

    db = settings.DATABASES["default"]
    name = connection.settings_dict["NAME"]
    auth = db["USER"] + (f":{db['PASSWORD']}" if db["PASSWORD"] else "")
    if db["HOST"].startswith("/"):
        return f"postgresql://{auth}@/{name}?host={db['HOST']}"
    port = f":{db['PORT']}" if db["PORT"] else ""
    return f"postgresql://{auth}@{db['HOST']}{port}/{name}"


def subprocess_env(**extra: str) -> dict[str, str]:
    """The environment for a product process started by a test: same Redis, the test database."""
    from django.conf import settings

    env = dict(os.environ)
    env.update(
        DATABASE_URL=database_url_for_subprocess(),
        REDIS_URL=settings.REDIS_URL,
        DJANGO_SETTINGS_MODULE="portal.settings",
        PYTHONPATH=str(ROOT),
        PYTHONUNBUFFERED="1",
    )
    env.update(extra)
    return env


class CeleryWorker:
    def __init__(self, process: subprocess.Popen, log: Path):
        self.process = process
        self.log = log

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def start_celery(
    kind: str, tmp_path: Path, *, env: dict[str, str] | None = None, args: list[str] = ()
) -> CeleryWorker:
    """Start a real ``celery worker`` or ``celery beat`` process against the test database."""
    log = tmp_path / f"celery-{kind}-{time.monotonic_ns()}.log"
    command = [sys.executable, "-m", "celery", "-A", "portal", kind, "--loglevel", "INFO"]
    if kind == "worker":
        command += [
            "--pool",
            "threads",
            "--concurrency",
            "4",
            "--without-gossip",
            "--without-mingle",
            "--hostname",
            f"test-{os.getpid()}-{time.monotonic_ns()}@%h",
        ]
    else:
        command += ["--schedule", str(tmp_path / "celerybeat-schedule")]
    command += list(args)
    process = subprocess.Popen(
        command, cwd=ROOT, env=env or subprocess_env(), stdout=log.open("w"), stderr=subprocess.STDOUT
    )
    return CeleryWorker(process, log)


@pytest.fixture
def celery_worker_process(transactional_db, tmp_path):
    """A real Celery worker subprocess on the test database, ready to take tasks."""
    from portal.celery import app

    worker = start_celery("worker", tmp_path)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if worker.process.poll() is not None:
            pytest.fail(f"celery worker exited early:\n{worker.log.read_text()[-3000:]}")
        if app.control.ping(timeout=0.5):
            break
    else:
        worker.stop()
        pytest.fail(f"celery worker did not answer:\n{worker.log.read_text()[-3000:]}")
    yield worker
    worker.stop()


@pytest.fixture(scope="session")
def browser():
    if not HAVE_CHROMIUM:
        pytest.skip("no Chromium on this machine: apt-get install chromium")
    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"  # Playwright's sync API runs an event loop in-thread
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        instance = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        yield instance
        instance.close()


@pytest.fixture
def page(browser, live_server):
    context = browser.new_context(base_url=live_server.url, viewport={"width": 1280, "height": 900})
    context.set_default_timeout(15000)
    page = context.new_page()
    yield page
    context.close()


@pytest.fixture
def artifacts_dir() -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    return ARTIFACTS


@pytest.fixture(autouse=True)
def _catalog_cache_fresh():
    """The cached catalog outlives a test's rolled-back rows: every test starts without one."""
    from billing.services.storage import storage_price_cache_drop
    from provisioner.catalog_cache import _replace_version

    _replace_version()
    storage_price_cache_drop()  # the storage price's, too
    yield
