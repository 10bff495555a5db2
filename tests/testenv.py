"""Loaded by pytest before Django (``-p tests.testenv`` in pyproject): the test suite gets its own
embedded PostgreSQL and Redis under ``.data/test`` so it never touches the demo's data, started here
(importing the settings starts nothing) unless DATABASE_URL / REDIS_URL name real servers."""

import os
from pathlib import Path

os.environ.setdefault("SUANLI_DATA_DIR", str(Path(__file__).resolve().parent.parent / ".data" / "test"))


def pytest_configure(config) -> None:
    from portal import embedded

    embedded.ensure_wanted()
