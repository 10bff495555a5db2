"""Environments in the portal (provisioner/services/environments.py): admins publish them with a price
tier, users register their own venvs, a launch goes only to a node that has its environment, and the
surcharge is billed through the same meter and ledger as the rest of the price."""

from __future__ import annotations

import sys
from datetime import timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from billing.models import AuditEntry, Meter
from billing.services.ledger import wallet_for
from billing.services.metering import meter_close, metering_tick
from billing.services.pricing import PriceQuote, price_quote, quote_with_surcharge
from core.errors import Conflict, ValidationFailed
from provisioner import selectors
from provisioner.models import Environment, Session
from provisioner.selectors import workload_spec
from provisioner.services.environments import environment_publish, environment_remove, environment_save
from provisioner.services.sessions import session_launch
from tests.billing.conftest import assert_ledger_invariants
from tests.provisioner.conftest import (
    A100,
    ENV,
    beat,
    gpu,
    heartbeat_body,
    make_node,
    make_user,
    workload_status,
)

pytestmark = pytest.mark.django_db
TORCH = "/opt/suanli/envs/torch/bin/python"  # a prefix only some nodes have


def _launch(user, environment: str, profile: str = "whole") -> Session:
    return session_launch(
        user=user,
        account=user.account,
        gpu_model="" if profile == "cpu" else A100,
        profile=profile,
        environment=environment,
        max_hours=1,
        idle_minutes=30,
        idempotency_key=None,
    ).session


def _reports(node, pythons: list[str]) -> dict:
    """A heartbeat from ``node`` whose agent has these interpreters; the portal's answer."""
    from provisioner.serializers import HeartbeatOut
    from provisioner.services.heartbeats import heartbeat_record

    body = heartbeat_body([gpu(d.index, d.uuid) for d in node.devices.filter(kind="physical")])
    body["capabilities"] = {
        "sharing_policies": ["exclusive", "fixed-share", "best-effort"],
        "environments": pythons,
    }
    return HeartbeatOut(heartbeat_record(node=node, body=body)).data


def test_the_surcharge_is_added_exactly_and_the_card_burn_in_proportion_rounded_down():
    quote = PriceQuote(price_id=1, price_micros_per_hour=12_000_000, card_burn_micros_per_hour=2_000_000)
    tier = quote_with_surcharge(quote, surcharge_micros_per_hour=1_000_001)
    assert tier.price_micros_per_hour == 13_000_001
    assert tier.card_burn_micros_per_hour == 2_000_000 + 2_000_000 * 1_000_001 // 12_000_000  # 2,166,666
    assert quote_with_surcharge(quote, surcharge_micros_per_hour=0) == quote
    free = PriceQuote(price_id=1, price_micros_per_hour=0, card_burn_micros_per_hour=500)
    assert quote_with_surcharge(free, surcharge_micros_per_hour=3_600).price_micros_per_hour == 3_600
    assert quote_with_surcharge(free, surcharge_micros_per_hour=3_600).card_burn_micros_per_hour == 500


def test_publishing_an_environment_is_audited_and_its_interpreter_goes_to_every_agent(catalog):
    admin = make_user(staff=True)
    env = environment_publish(
        name="torch-2.5", python=TORCH, surcharge_micros_per_hour=1_800_000, actor=admin
    )
    environment_publish(name="torch-2.5", python=TORCH, surcharge_micros_per_hour=900_000, actor=admin)
    entries = list(AuditEntry.objects.filter(action="environment.publish").order_by("id"))
    assert [e.after["surcharge_micros_per_hour"] for e in entries] == [1_800_000, 900_000]
    assert entries[0].before is None and entries[1].before["surcharge_micros_per_hour"] == 1_800_000
    node, _ = make_node("node-any")
    assert TORCH in _reports(node, [])["environments"]
    env.refresh_from_db()
    assert env.surcharge_micros_per_hour == 900_000
    with pytest.raises(ValidationFailed):
        environment_publish(name="bad", python="relative/python")
    with pytest.raises(ValidationFailed):
        environment_publish(name="bad", python=TORCH, surcharge_micros_per_hour=-1)


def test_a_launch_goes_only_to_a_node_that_has_the_environment(catalog, sent_tasks):
    environment_publish(name="torch", python=TORCH)
    lacking, _ = make_node("node-lacking", [gpu(0, "GPU-lack-0")])
    having, _ = make_node("node-having", [gpu(0, "GPU-have-0")])
    user = make_user()
    _reports(lacking, [sys.executable])
    _reports(having, [sys.executable])
    with pytest.raises(ValidationFailed) as refused:  # nobody has it yet: refused, not queued forever
        _launch(user, "torch")
    assert refused.value.code == "environment_unavailable"
    assert "torch" not in [e["name"] for e in selectors.catalog()["environments"]]  # not offered either
    _reports(having, [sys.executable, TORCH])
    assert "torch" in [e["name"] for e in selectors.catalog()["environments"]]
    first = _launch(user, "torch")
    assert first.node_id == having.id
    second = _launch(make_user(), "torch")  # the free card is on the node without it: wait, not go there
    assert second.state == "queued" and second.node_id is None
    cpu = _launch(user, "torch", profile="cpu")
    assert cpu.node_id == having.id
    plain = _launch(make_user(), ENV)  # the environment every node has goes where there is room
    assert plain.node_id == lacking.id


def test_the_quote_and_the_meter_bill_exactly_base_plus_surcharge(catalog, sent_tasks):
    node, _ = make_node("node-a", [gpu(0, "GPU-a-0")])
    environment_publish(name="torch", python=TORCH, surcharge_micros_per_hour=1_800_000)
    _reports(node, [sys.executable, TORCH])
    user = make_user(funds=100_000_000)
    base = price_quote(gpu_model=A100, profile="whole")
    session = _launch(user, "torch")
    assert session.price_micros_per_hour == base.price_micros_per_hour + 1_800_000 == 13_800_000
    beat(node, [workload_status(session, "running")])
    session.refresh_from_db()
    start = Meter.objects.get(session_ref=str(session.id)).started_at
    Meter.objects.filter(session_ref=str(session.id)).update(alive_until=start + timedelta(seconds=100))
    metering_tick(now=start + timedelta(seconds=100))
    meter = meter_close(session_ref=str(session.id), ended_at=start + timedelta(seconds=100))
    assert meter.billed_seconds == 100
    # 12 / h base + 1.8 / h surcharge for 100 s: 333,333 + 50,000 = 383,333 (the sum, rounded down once)
    assert meter.charged_micros == 13_800_000 * 100 // 3600 == 383_333
    assert wallet_for(account=user.account).balance_micros == 100_000_000 - 383_333
    assert_ledger_invariants()


def test_a_users_venv_is_registered_checked_for_shape_and_launched_on_its_base(catalog, sent_tasks):
    node, _ = make_node("node-a", [gpu(0, "GPU-a-0")])
    environment_publish(name="torch", python=TORCH, surcharge_micros_per_hour=360_000)
    _reports(node, [sys.executable, TORCH])
    user, other = make_user(), make_user()
    for bad in ("/etc", "../bob/.venvs/x", ".venvs/../../x", ""):
        with pytest.raises(ValidationFailed):
            environment_save(user=user, name="mine", home_path=bad, base="torch")
    mine = environment_save(user=user, name="mine", home_path="~/.venvs/mine", base="torch")
    assert mine.home_path == ".venvs/mine"
    with pytest.raises(Conflict):
        environment_save(user=user, name="mine", home_path=".venvs/again", base="torch")
    environment_save(user=other, name="mine", home_path=".venvs/theirs", base=ENV)  # names are per user
    session = _launch(user, "mine:mine")
    assert session.environment_id == mine.id
    assert session.price_micros_per_hour == 12_000_000 + 360_000  # its base's tier
    spec = workload_spec(Session.objects.select_related("environment__base").get(id=session.id))
    assert spec["environment"] == {
        "name": "mine",
        "python": TORCH,
        "image": None,
        "home_prefix": ".venvs/mine",
    }
    with pytest.raises(ValidationFailed):
        _launch(other, "mine:nothing")
    environment_remove(user=user, environment_id=mine.id)  # a session names it: kept for it, hidden
    assert not Environment.objects.filter(owner=user, enabled=True).exists()
    assert Session.objects.get(id=session.id).environment_id == mine.id
    environment_save(user=user, name="mine", home_path=".venvs/mine", base="torch")  # the name is free again


def test_an_admin_publishes_an_environment_with_its_tier_on_the_admin_site_audited(catalog, client):
    admin = make_user(staff=True)
    admin.is_superuser = True
    admin.save(update_fields=["is_superuser"])
    client.force_login(admin)
    form = {
        "name": "torch",
        "interface": "jupyterlab",
        "python": TORCH,
        "image": "",
        "surcharge_micros_per_hour": "1200000",
        "cpu_cores": "4",
        "memory_mib": "16384",
        "enabled": "on",
    }
    assert client.post("/admin/provisioner/environment/add/", form).status_code == 302
    env = Environment.objects.get(name="torch", owner__isnull=True)
    assert env.surcharge_micros_per_hour == 1_200_000 and env.python == TORCH
    entry = AuditEntry.objects.get(action="environment.publish")
    assert entry.actor_id == admin.id and entry.after["surcharge_micros_per_hour"] == 1_200_000
    mine = environment_save(user=make_user(), name="mine", home_path=".venvs/mine", base="torch")
    page = client.get(f"/admin/provisioner/environment/{mine.id}/change/")
    assert page.status_code == 200 and b'name="home_path"' not in page.content  # a user's own: read-only


@given(
    price=st.integers(min_value=0, max_value=10**12),
    burn=st.integers(min_value=0, max_value=10**12),
    surcharge=st.integers(min_value=0, max_value=10**12),
)
def test_the_tier_adds_exactly_to_the_price_and_scales_the_burn_rounded_down(price, burn, surcharge):
    tier = quote_with_surcharge(PriceQuote(1, price, burn), surcharge_micros_per_hour=surcharge)
    assert tier.price_micros_per_hour == price + surcharge
    if price and surcharge:  # burn × (price + surcharge) / price, rounded down to a whole micro-unit
        assert tier.card_burn_micros_per_hour * price <= burn * (price + surcharge)
        assert burn * (price + surcharge) < (tier.card_burn_micros_per_hour + 1) * price
    else:
        assert tier.card_burn_micros_per_hour == burn
