"""The cached catalog (provisioner.catalog_cache): a change that alters what it shows drops it at once;
the heartbeats every node sends do not."""

from __future__ import annotations

import pytest

from provisioner.catalog_cache import catalog_version
from provisioner.models import Node
from provisioner.selectors import catalog
from provisioner.services.heartbeats import heartbeat_record
from tests.provisioner.conftest import A100, gpu, heartbeat_body, make_catalog, make_node

pytestmark = pytest.mark.django_db


def _free_quarters() -> int:
    found = catalog()["gpu_models"]
    return sum(
        p["available"] for m in found if m["name"] == A100 for p in m["profiles"] if p["profile"] == "1/4"
    )


def test_an_admins_edit_of_a_node_reaches_the_catalog_at_once():
    make_catalog()
    node, _token = make_node("node-cat")
    before = _free_quarters()
    assert before > 0
    node = Node.objects.get(pk=node.pk)
    node.state = Node.State.DRAINING
    node.save()  # what the admin's change form does: every field
    assert _free_quarters() == 0


def test_a_heartbeat_that_changes_nothing_shown_keeps_the_cached_catalog():
    make_catalog()
    node, _token = make_node("node-beat")
    catalog()
    version = catalog_version()
    heartbeat_record(node=Node.objects.get(pk=node.pk), body=heartbeat_body([gpu(0, "GPU-node-beat-0")]))
    assert catalog_version() == version
