"""The environment choice on the launch page (published ones some node has, then the user's own venvs, each
with its surcharge, the quote with the surcharge in it, an empty state) and the "My environments" page."""

from __future__ import annotations

import pytest
from django.core.cache import cache
from django.test import Client

from billing.services.pricing import burn_rate_set, price_set
from billing.services.topups import wallet_credit_promotion
from portal.services import user_create
from provisioner.models import Device, Environment, GpuModel, Node, Profile, Session
from provisioner.services.environments import environment_publish, environment_save
from provisioner.services.nodes import node_enroll

pytestmark = pytest.mark.django_db
TORCH = "/opt/suanli/envs/torch/bin/python"


@pytest.fixture(autouse=True)
def _fresh_cache():
    cache.clear()


@pytest.fixture
def fleet():
    GpuModel.objects.create(name="T4", memory_mib=15360, peak_tflops=65.0, profiles=["whole"])
    Profile.objects.get_or_create(name="whole", defaults={"kind": "whole", "eighths": 8, "quota_eighths": 8})
    node = node_enroll(name="node-t", address="http://127.0.0.1:9").node
    Node.objects.filter(id=node.id).update(environments=["/usr/bin/python3", TORCH])
    Device.objects.create(
        node=node, uuid="GPU-t4-0", index=0, gpu_model=GpuModel.objects.get(name="T4"), nvml_name="Tesla T4",
        memory_mib=15360,
    )  # fmt: skip
    price_set(gpu_model="T4", profile="whole", price_micros_per_hour=2_000_000)
    burn_rate_set(gpu_model="T4", multiplier_milli=500)
    environment_publish(name="python-3.11", python="/usr/bin/python3")
    environment_publish(name="torch", python=TORCH, surcharge_micros_per_hour=500_000)
    environment_publish(name="elsewhere", python="/opt/nowhere/bin/python")  # on no node: not offered
    return node


def _client(name: str, *, funded: int = 10_000_000):
    user = user_create(username=name, email=f"{name}@example.com", password="pw-123456789")
    wallet_credit_promotion(account=user.account, amount_micros=funded, idempotency_key=f"fund-{name}")
    client = Client()
    client.force_login(user)
    return user, client


def test_the_launch_page_offers_what_some_node_has_with_the_surcharge_in_the_quote(fleet):
    user, client = _client("ada")
    environment_save(user=user, name="mine", home_path=".venvs/mine", base="torch")
    page = client.get("/launch/?gpu_model=T4&profile=whole").content.decode()
    assert 'value="python-3.11"' in page and 'value="torch"' in page and 'value="mine:mine"' in page
    assert "elsewhere" not in page
    assert "+¥0.50/" in page or "+0.50/" in page.replace("¥", "")  # the torch option's difference
    assert 'data-testid="surcharge"' not in page  # the first environment has none
    priced = client.get("/launch/?gpu_model=T4&profile=whole&environment=torch").content.decode()
    assert 'data-testid="surcharge"' in priced
    assert "2.50" in priced  # 2.00 / h base + 0.50 / h surcharge
    assert "0.625" in priced or "0.62" in priced  # card burn 0.5 / h × 2.5 / 2.0
    own = client.get("/launch/?gpu_model=T4&profile=whole&environment=mine:mine").content.decode()
    assert "2.50" in own and "~/.venvs/mine" in own


def test_a_launch_with_the_users_venv_runs_it_at_its_base_price(fleet, django_capture_on_commit_callbacks):
    user, client = _client("ada")
    mine = environment_save(user=user, name="mine", home_path=".venvs/mine", base="torch")
    with django_capture_on_commit_callbacks(execute=False):
        response = client.post(
            "/launch/",
            {"gpu_model": "T4", "profile": "whole", "environment": "mine:mine", "idempotency_key": "k-1"},
        )
    assert response.status_code == 302, response.content.decode()[:2000]
    session = Session.objects.get(owner=user)
    assert session.environment_id == mine.id and session.price_micros_per_hour == 2_500_000


def test_the_launch_page_says_when_no_environment_is_installed(fleet):
    Environment.objects.update(enabled=False)
    _user, client = _client("ada")
    page = client.get("/launch/?gpu_model=T4&profile=whole").content.decode()
    assert 'data-testid="no-environments"' in page
    assert "No environment is installed on any node right now" in page


def test_my_environments_saves_lists_refuses_a_bad_path_and_removes(fleet):
    user, client = _client("ada")
    empty = client.get("/environments/").content.decode()
    assert 'data-testid="no-own-environments"' in empty
    refused = client.post("/environments/", {"name": "bad", "home_path": "../bob/.venvs/x", "base": "torch"})
    assert refused.status_code == 200 and "no .. and not absolute" in refused.content.decode()
    saved = client.post("/environments/", {"name": "mine", "home_path": ".venvs/mine", "base": "torch"})
    assert saved.status_code == 302
    listed = client.get("/environments/").content.decode()
    assert "~/.venvs/mine" in listed and ">torch<" in listed
    env = Environment.objects.get(owner=user)
    _other, stranger = _client("bob")
    assert stranger.post(f"/environments/{env.id}/remove").status_code == 302  # not theirs: nothing done
    assert Environment.objects.filter(id=env.id).exists()
    assert client.post(f"/environments/{env.id}/remove").status_code == 302
    assert not Environment.objects.filter(id=env.id).exists()


def test_a_launch_of_an_environment_no_node_has_is_refused_not_swapped_for_another(fleet):
    user, client = _client("ada")
    response = client.post(
        "/launch/",
        {"gpu_model": "T4", "profile": "whole", "environment": "elsewhere", "idempotency_key": "k-2"},
    )
    assert response.status_code == 200
    assert "No node has the environment elsewhere installed yet." in response.content.decode()
    assert not Session.objects.filter(owner=user).exists()
