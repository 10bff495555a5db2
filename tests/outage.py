"""Redis taken away from the code under test: a URL nothing listens on, and the Celery app pointed at it."""

import pytest
from celery import current_app

from provisioner import enqueue

CLOSED = "redis://127.0.0.1:1/0"  # nothing listens on port 1: every connection is refused


@pytest.fixture
def broker_down(monkeypatch):
    """The Celery app publishes to the closed port (a fresh producer pool for it)."""
    app = current_app._get_current_object()
    monkeypatch.setitem(app.conf, "broker_url", CLOSED)
    monkeypatch.setattr(app, "_pool", None)
    monkeypatch.setattr(app.amqp, "_producer_pool", None)
    yield
    enqueue._broker.answered()
