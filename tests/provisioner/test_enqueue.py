"""Tasks queued after commit, with the broker (Redis) unreachable: the request is answered as usual, the
database holds the change, and the agents' heartbeats carry it out without any task."""

import logging

import pytest
from rest_framework.test import APIClient

from provisioner.models import Allocation, Session
from tests.provisioner.conftest import A100, ENV, beat, gpu, make_node, make_user, workload_status


@pytest.mark.django_db(transaction=True)  # on_commit runs for real: the publish is attempted
def test_launch_and_stop_with_the_broker_down_are_accepted_and_heartbeats_carry_them_out(
    catalog, broker_down, caplog
):
    caplog.set_level(logging.WARNING, logger="core.outage")
    node, _token = make_node("node-a", [gpu(0, "GPU-a-0")], sharing_policy="best-effort")
    client = APIClient()
    client.force_authenticate(make_user())
    body = {"gpu_model": A100, "profile": "whole", "environment": ENV}
    response = client.post("/api/v1/sessions", body, format="json")
    assert response.status_code == 201, response.content
    session_id = response.json()["id"]
    session = Session.objects.get(id=session_id)
    assert session.state == Session.State.PLACING
    assert Allocation.objects.filter(session_id=session_id).exists()

    beat(node, [workload_status(session, "running")])  # the agent put it from its desired set
    assert client.get(f"/api/v1/sessions/{session_id}").json()["state"] == "running"

    stopped = client.post(f"/api/v1/sessions/{session_id}/stop", {}, format="json")
    assert stopped.status_code == 200, stopped.content
    assert stopped.json()["state"] == "stopping"
    beat(node, [])  # the agent dropped it: no longer desired
    assert client.get(f"/api/v1/sessions/{session_id}").json()["state"] == "stopped"
    assert not Allocation.objects.filter(session_id=session_id).exists()
    outages = [r for r in caplog.records if r.getMessage().startswith("broker unreachable")]
    assert len(outages) == 1, [r.getMessage() for r in caplog.records]
