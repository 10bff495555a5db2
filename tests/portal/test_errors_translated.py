"""Domain errors reach people in their language: the launch page shows a refusal (quota, funds) in the
user's chosen language, and the API answers in the caller's, while ``code`` and ``fields`` stay the same
machine-readable values in every language."""

from __future__ import annotations

import pytest
from django.core.cache import cache
from django.test import Client
from rest_framework.test import APIClient

from billing.services.pricing import price_set
from billing.services.topups import wallet_credit_promotion
from portal.services import access_token_create, user_create
from provisioner.models import Device, Environment, GpuModel, Profile, Session
from provisioner.quotas import quota_set
from provisioner.services.nodes import node_enroll

pytestmark = pytest.mark.django_db

LAUNCH = {"gpu_model": "T4", "profile": "whole", "environment": "python-3.11"}


@pytest.fixture(autouse=True)
def _fresh(settings):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    cache.clear()  # the API's launch throttle counts in Redis


@pytest.fixture
def fleet():
    model = GpuModel.objects.create(name="T4", memory_mib=15360, peak_tflops=65.0, profiles=["whole"])
    Profile.objects.get_or_create(name="whole", defaults={"kind": "whole", "eighths": 8, "quota_eighths": 8})
    Environment.objects.get_or_create(name="python-3.11", defaults={"python": "/usr/bin/python3"})
    node = node_enroll(name="node-t", address="http://127.0.0.1:9").node
    Device.objects.create(
        node=node, uuid="GPU-t4-0", index=0, gpu_model=model, nvml_name="Tesla T4", memory_mib=15360
    )
    price_set(gpu_model="T4", profile="whole", price_micros_per_hour=2_000_000)


def _user(name: str, *, language: str, funded: int = 0, max_sessions: int | None = None):
    user = user_create(username=name, email="", password="pw-123456789", language=language)
    if funded:
        wallet_credit_promotion(account=user.account, amount_micros=funded, idempotency_key=f"fund-{name}")
    if max_sessions is not None:
        quota_set(user=user, limits={"max_sessions": max_sessions})
    return user


def _page(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def test_a_chinese_user_over_the_session_quota_reads_the_refusal_in_chinese(
    fleet, django_capture_on_commit_callbacks
):
    user = _user("mei", language="zh-hans", funded=10_000_000, max_sessions=1)
    client = _page(user)
    with django_capture_on_commit_callbacks(execute=False):
        assert client.post("/launch/", LAUNCH | {"idempotency_key": "k-1"}).status_code == 302
    response = client.post("/launch/", LAUNCH | {"idempotency_key": "k-2"})
    page = response.content.decode()
    assert response.status_code == 200 and response["Content-Language"] == "zh-hans"
    assert "你已有 1 个会话，最多只能有 1 个。" in page
    assert "at most" not in page
    assert Session.objects.filter(owner=user).count() == 1


def test_a_chinese_user_without_funds_reads_the_refusal_in_chinese(fleet):
    user = _user("lin", language="zh-hans")
    page = _page(user).post("/launch/", LAUNCH).content.decode()
    assert "余额不足：本次启动需要算力卡或钱包中至少有够用" in page
    assert "Not enough funds" not in page
    assert not Session.objects.filter(owner=user).exists()


def test_an_english_user_without_funds_reads_the_refusal_in_english(fleet):
    page = _page(_user("ada", language="en")).post("/launch/", LAUNCH).content.decode()
    assert "Not enough funds: this launch needs at least" in page
    assert "余额不足" not in page


def test_the_api_answers_a_browser_session_in_the_users_language_with_the_same_code(fleet):
    user = _user("mei", language="zh-hans", funded=10_000_000, max_sessions=0)
    client = APIClient()
    client.force_login(user)  # through the portal's middleware, as the browser calls the API
    response = client.post("/api/v1/sessions", LAUNCH, format="json")
    assert response.status_code == 403, response.content
    error = response.json()["error"]
    assert error["code"] == "quota_sessions"
    assert error["message"] == "你已有 0 个会话，最多只能有 0 个。"


def test_the_api_answers_a_token_in_the_language_the_caller_asks_for(fleet):
    user = _user("mei", language="en")
    _token, raw = access_token_create(user=user, name="ci", scopes=["sessions"])
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
    body = LAUNCH | {"gpu_model": "H100"}
    chinese = client.post("/api/v1/sessions", body, format="json", HTTP_ACCEPT_LANGUAGE="zh-Hans").json()
    english = client.post("/api/v1/sessions", body, format="json", HTTP_ACCEPT_LANGUAGE="en").json()
    assert chinese["error"]["message"] == "未知的 GPU 型号 'H100'。"
    assert english["error"]["message"] == "Unknown GPU model 'H100'."
    for answer in (chinese, english):
        assert answer["error"]["code"] == "invalid"
        assert answer["error"]["fields"] == {"gpu_model": "unknown"}


def test_a_token_without_accept_language_answers_in_its_users_language(fleet):
    user = _user("lin", language="zh-hans")
    _token, raw = access_token_create(user=user, name="ci", scopes=["sessions"])
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
    answer = client.post("/api/v1/sessions", LAUNCH | {"gpu_model": "H100"}, format="json").json()
    assert answer["error"]["message"] == "未知的 GPU 型号 'H100'。"
    assert answer["error"]["code"] == "invalid"
