"""Preemption end to end: the portal under uvicorn, a Celery worker and beat (the limits sweep stops the
victim, the queue dispatch hands its slots over), and a node agent on a fake A100 fleet running real
JupyterLab processes. An interruptible session is preempted by an on-demand launch: warned (by email
too), stopped after its grace, billed to its stop at its own price, re-queued, and resumed on a second
host's agent when that host joins. The test only launches and stops through the API and watches."""

from __future__ import annotations

import pytest

from billing.models import Meter
from billing.services.pricing import price_set
from provisioner.models import Node, Session, StopWarning
from provisioner.services.nodes import node_enroll
from tests.browser.steps import (
    a100_offer,
    api_for,
    api_launch,
    mail_text,
    product_stack,
    stack_env,
    wait_for_free_gpu,
)
from tests.provisioner.conftest import A100, make_user
from tests.stack import agent_get, delete_workloads, start_agent, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.django_db(transaction=True)]
UNIT = 1_000_000
CHEAP_MICROS = 900_000_000  # 0.25 a second; on demand costs 1.00 (steps.a100_offer)


def _state_is(session_id, state: str, timeout: float = 90) -> Session:
    wait_for(lambda: Session.objects.get(id=session_id).state == state, timeout, 0.3, f"{session_id} {state}")
    return Session.objects.get(id=session_id)


def test_an_interruptible_session_is_preempted_warned_stopped_billed_requeued_and_resumed(tmp_path):
    env = stack_env(
        EMAIL_URL=f"file://{tmp_path / 'mail'}",
        SESSION_LIMITS_SWEEP_SECONDS="1",
        SESSION_PREEMPT_GRACE_SECONDS="4",
        BILLING_ADMISSION_MINUTES="0",
    )
    with product_stack(tmp_path, env=env) as stack:
        a100_offer()
        price_set(
            gpu_model=A100,
            profile="whole",
            price_micros_per_hour=3_600_000_000,
            interruptible_price_micros_per_hour=CHEAP_MICROS,
        )
        wait_for_free_gpu(stack, profile="whole")
        cheap = api_for(stack["web"].url, make_user("cheap", funds=10_000 * UNIT))
        urgent = api_for(stack["web"].url, make_user("urgent", funds=10_000 * UNIT))

        victim_id = api_launch(cheap, profile="whole", tier="interruptible", resume=True)
        _state_is(victim_id, "running")
        on_demand_id = api_launch(urgent, profile="whole")
        assert Session.objects.get(id=on_demand_id).state == "queued"
        warning = StopWarning.objects.get(session_id=victim_id, kind="preempt")
        wait_for(
            lambda: "An on-demand launch needs this GPU" in mail_text(tmp_path),
            30,
            0.3,
            "the warning by mail",
        )

        victim = _state_is(victim_id, "stopped", timeout=60)
        assert victim.ended_at >= warning.due_at
        _state_is(on_demand_id, "running")
        assert Session.objects.get(id=on_demand_id).device_id == victim.device_id

        meter = Meter.objects.get(session_ref=victim_id)
        assert meter.state == Meter.State.CLOSED and meter.price_micros_per_hour == CHEAP_MICROS
        # billed by the second up to the last time the agent saw it alive, never past its stop
        assert meter.billed_until <= meter.ended_at <= victim.ended_at
        assert (meter.ended_at - meter.billed_until).total_seconds() < 3
        assert meter.charged_micros + meter.card_charged_micros == meter.billed_seconds * CHEAP_MICROS // 3600

        resumed = Session.objects.get(resumed_from_id=victim_id)
        assert resumed.state == "queued" and resumed.tier == "interruptible"
        assert cheap.get(f"/api/v1/sessions/{victim_id}").json()["resumed_as"] == str(resumed.id)

        # a second host joins: capacity frees there, and the resumed session runs on it
        enrolment = node_enroll(name="node-e2e-b", address="http://127.0.0.1:1")
        second = start_agent(  # another fleet file: its GPUs are other GPUs
            tmp_path, node="node-e2e-b", token=enrolment.token, portal=stack["web"].url, fleet="node-a.yaml"
        )
        try:
            Node.objects.filter(pk=enrolment.node.pk).update(address=second.url)
            resumed = _state_is(resumed.id, "running")
            assert resumed.node_id == enrolment.node.pk
            assert Session.objects.get(id=on_demand_id).state == "running"  # untouched on the first host
            assert [w["session_id"] for w in agent_get(second, "/v1/workloads").json()["workloads"]] == [
                str(resumed.id)
            ]
            cheap.post(f"/api/v1/sessions/{resumed.id}/stop", json={})
            _state_is(resumed.id, "stopped", timeout=60)
        finally:
            delete_workloads(second)
            second.stop()
