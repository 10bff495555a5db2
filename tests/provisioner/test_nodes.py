"""Node and device services an admin uses: forcing a device's ended allocations free."""

from __future__ import annotations

import pytest

from provisioner.models import AllocationSlot, Session
from provisioner.services.nodes import device_force_free
from tests.provisioner.factories import catalog_make, fleet_make, launch, no_start_task, user_make

pytestmark = pytest.mark.django_db


def test_force_free_on_any_gpu_of_an_ended_2x_frees_all_of_its_gpus_and_never_a_live_one(monkeypatch):
    no_start_task(monkeypatch)
    first, second = fleet_make(catalog_make(), nodes=1, gpus_per_node=2)
    user = user_make()
    session = launch(user, profile="2x")
    assert device_force_free(device_id=second.id) == 0  # live: untouched
    assert AllocationSlot.objects.count() == 16
    Session.objects.filter(id=session.id).update(state=Session.State.LOST)
    assert device_force_free(device_id=max(first.id, second.id)) == 1
    assert not AllocationSlot.objects.exists()
