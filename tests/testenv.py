"""Loaded by pytest before Django (``-p tests.testenv`` in pyproject): the test suite gets its own
embedded PostgreSQL and Redis under ``.data/test`` so it never touches the demo's data."""

import os
from pathlib import Path

os.environ.setdefault("SUANLI_DATA_DIR", str(Path(__file__).resolve().parent.parent / ".data" / "test"))
