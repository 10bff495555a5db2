"""A heartbeat that reports nothing new takes no device lock: a launch that holds one (between its
placement and its commit) never holds up the node's heartbeat, nor does the heartbeat hold up launches.
Two real connections to PostgreSQL."""

from __future__ import annotations

import contextlib
import threading

import pytest
from django.db import connection, transaction

from provisioner.models import Device
from tests.provisioner.conftest import beat, gpu, make_node

pytestmark = pytest.mark.django_db(transaction=True)


@contextlib.contextmanager
def _held_by_a_placement(device: Device):
    """While inside: another connection holds ``device``'s row lock, as ``allocation_place`` does until
    its launch commits, and this connection gives up on any lock after 2 s (a beat that waited for the
    held device would fail)."""
    held, release = threading.Event(), threading.Event()

    def placement() -> None:
        try:
            with transaction.atomic():
                list(Device.objects.select_for_update(no_key=True).filter(id=device.id))
                held.set()
                release.wait(30)
        finally:
            connection.close()

    thread = threading.Thread(target=placement)
    thread.start()
    try:
        assert held.wait(10)
        with connection.cursor() as cursor:
            cursor.execute("SET lock_timeout = '2s'")
        yield
    finally:
        release.set()
        thread.join()
        with connection.cursor() as cursor:
            cursor.execute("RESET lock_timeout")


def test_an_unchanged_inventory_waits_on_no_device_lock():
    node, _token = make_node(gpus=[gpu(0, "GPU-LOCK-0"), gpu(1, "GPU-LOCK-1")])
    placed, free = Device.objects.filter(node=node).order_by("id")
    with _held_by_a_placement(placed):
        beat(node)
        placed.refresh_from_db()
        free.refresh_from_db()
        assert free.last_seen_at > placed.last_seen_at  # seen; the held one is marked by the next beat
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


def _figures(uuid: str, util: int) -> dict:
    return {
        "uuid": uuid,
        "gpu_util_percent": util,
        "memory_used_mib": 100,
        "temperature_c": 40,
        "power_w": 90.0,
    }


def test_a_beats_figures_wait_on_no_device_lock_so_it_closes_no_cycle_with_a_contended_placement():
    """A contended placement locks every device in id order: it holds the first and waits for the second.
    The beat had taken the second (``last_seen_at``, skipping locked ones) and then waited to write the
    first one's figures: a cycle, which PostgreSQL broke by failing launches (`make load`, 200 users).
    Now the figures skip a held device too; its sample is kept, and the next beat writes it."""
    node, _token = make_node(gpus=[gpu(0, "GPU-FIG-0"), gpu(1, "GPU-FIG-1")])
    first, second = Device.objects.filter(node=node).order_by("id")
    with _held_by_a_placement(first):  # as the lock-all round holds the first before the second
        beat(node, metrics=[_figures("GPU-FIG-0", 11), _figures("GPU-FIG-1", 22)])
        first.refresh_from_db()
        second.refresh_from_db()
        assert second.last_metrics["gpu_util_percent"] == 22
        assert first.last_metrics.get("gpu_util_percent") is None  # held: written by the next beat
        assert first.samples.count() == 1 and second.samples.count() == 1  # the history has both
    beat(node, metrics=[_figures("GPU-FIG-0", 33), _figures("GPU-FIG-1", 44)])
    first.refresh_from_db()
    assert first.last_metrics["gpu_util_percent"] == 33 and "collected_at" in first.last_metrics
