"""A heartbeat that reports nothing new takes no device lock: a launch that holds one (between its
placement and its commit) never holds up the node's heartbeat, nor does the heartbeat hold up launches.
Two real connections to PostgreSQL."""

from __future__ import annotations

import threading

import pytest
from django.db import connection, transaction

from provisioner.models import Device
from tests.provisioner.conftest import beat, gpu, make_node

pytestmark = pytest.mark.django_db(transaction=True)


def test_an_unchanged_inventory_waits_on_no_device_lock():
    node, _token = make_node(gpus=[gpu(0, "GPU-LOCK-0"), gpu(1, "GPU-LOCK-1")])
    placed, free = Device.objects.filter(node=node).order_by("id")
    held, release = threading.Event(), threading.Event()

    def placement() -> None:  # as allocation_place holds a device until its launch commits
        try:
            with transaction.atomic():
                list(Device.objects.select_for_update(no_key=True).filter(id=placed.id))
                held.set()
                release.wait(30)
        finally:
            connection.close()

    thread = threading.Thread(target=placement)
    thread.start()
    try:
        assert held.wait(10)
        with connection.cursor() as cursor:
            cursor.execute("SET lock_timeout = '2s'")  # a beat that waited for the lock would fail here
        beat(node)
        placed.refresh_from_db()
        free.refresh_from_db()
        assert free.last_seen_at > placed.last_seen_at  # seen; the held one is marked by the next beat
    finally:
        release.set()
        thread.join()
        with connection.cursor() as cursor:
            cursor.execute("RESET lock_timeout")
    beat(node)
    placed.refresh_from_db()
    assert placed.last_seen_at == Device.objects.get(id=free.id).last_seen_at


def test_a_changed_inventory_is_written_under_the_device_locks():
    node, _token = make_node(gpus=[gpu(0, "GPU-CHANGE-0")])
    beat(node, gpus=[gpu(0, "GPU-CHANGE-0", health="lost"), gpu(1, "GPU-CHANGE-1")])
    assert dict(Device.objects.filter(node=node).values_list("uuid", "health")) == {
        "GPU-CHANGE-0": "lost",
        "GPU-CHANGE-1": "ok",
    }
    beat(node, gpus=[gpu(1, "GPU-CHANGE-1")])
    assert Device.objects.get(uuid="GPU-CHANGE-0").health == Device.Health.MISSING
