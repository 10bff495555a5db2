"""The portal's /metrics reads the fleet and the ledger from the database at scrape time."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from provisioner.models import Session
from tests.provisioner.factories import catalog_make, node_make, profiles_ensure, session_row, user_make

pytestmark = pytest.mark.django_db


def _scrape() -> dict[str, list]:
    text = Client().get("/metrics").content.decode()
    return {family.name: family.samples for family in text_string_to_metric_families(text)}


def test_running_sessions_queue_and_heartbeats_come_from_the_database():
    profiles_ensure()
    model = catalog_make()
    user = user_make()
    node = node_make("gpu-host-1")
    for profile in ("1/8", "1/8", "whole"):
        Session.objects.filter(pk=session_row(user, profile=profile, model=model).pk).update(
            state=Session.State.RUNNING, node=node
        )
    waiting = session_row(user, profile="1/4", model=model)
    Session.objects.filter(pk=waiting.pk).update(queued_at=timezone.now() - timedelta(seconds=90))
    node.last_heartbeat_at = timezone.now() - timedelta(seconds=30)
    node.save(update_fields=["last_heartbeat_at"])
    node_make("never-seen")

    samples = _scrape()
    running = {
        (s.labels["gpu_model"], s.labels["profile"]): s.value for s in samples["suanli_sessions_running"]
    }
    assert running == {(model.name, "1/8"): 2, (model.name, "whole"): 1}
    assert [s.value for s in samples["suanli_queue_length"]] == [1]
    (oldest,) = samples["suanli_queue_oldest_wait_seconds"]
    assert 89 <= oldest.value < 150
    (age,) = samples["suanli_node_heartbeat_age_seconds"]
    assert age.labels["node"] == "gpu-host-1" and 29 <= age.value < 90
