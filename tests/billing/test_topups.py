from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
import stripe
from django.core import mail
from django.test import Client, override_settings

from billing.models import TopUp, Transfer
from billing.services.ledger import overdraft_for, wallet_for
from billing.services.metering import meter_alive, meter_open, metering_tick
from billing.services.pricing import price_quote
from billing.services.topups import topup_create
from core.clock import db_now
from tests.billing.conftest import assert_ledger_invariants, make_account
from tests.billing.test_concurrency import SECRET, _paid_event, _signed

pytestmark = pytest.mark.django_db


def _post(body: bytes, header: str):
    return Client().post(
        "/api/stripe/webhook", body, content_type="application/json", HTTP_STRIPE_SIGNATURE=header
    )


@override_settings(STRIPE_WEBHOOK_SECRET=SECRET)
def test_signed_webhook_credits_wallet_once_and_recovers_overdraft(prices):
    account = make_account()
    # a real overdraft: 1 h 0 min 1 s of a T4 (2.00 an hour) metered on an empty wallet
    start = db_now() - timedelta(hours=2)
    quote = price_quote(gpu_model="T4", profile="whole")
    meter_open(
        account=account, session_ref="od", gpu_model="T4", profile="whole", quote=quote, started_at=start
    )
    end = start + timedelta(seconds=3601)
    meter_alive(session_refs=["od"], alive_at=end)
    metering_tick(now=end)
    owed = 2_000_000 * 3601 // 3600
    assert owed == 2_000_555
    assert overdraft_for(account=account).balance_micros == -owed
    assert wallet_for(account=account).balance_micros == 0

    TopUp.objects.create(
        account=account, amount_micros=50_000_000, currency="CNY", checkout_session_id="cs_ok"
    )
    body, header = _signed(_paid_event("cs_ok", 5000))
    assert _post(body, header).status_code == 200
    assert _post(body, header).json()["outcome"] == "duplicate"
    second = _paid_event("cs_ok", 5000) | {"id": "evt_other"}
    assert _post(*_signed(second)).json()["outcome"] == "already credited"
    assert TopUp.objects.get().state == "paid"
    assert overdraft_for(account=account).balance_micros == 0
    assert wallet_for(account=account).balance_micros == 50_000_000 - owed
    (recovery,) = Transfer.objects.filter(kind=Transfer.Kind.OVERDRAFT_RECOVERY)
    assert recovery.amount_micros == owed
    assert (recovery.debit, recovery.credit) == (wallet_for(account=account), overdraft_for(account=account))
    assert_ledger_invariants()


@override_settings(STRIPE_WEBHOOK_SECRET=SECRET)
def test_a_credited_top_up_tells_its_payer_once(django_capture_on_commit_callbacks):
    from notices.models import Notice
    from portal.services import user_create

    payer = user_create(username="payer", email="payer@example.com", password="a-long-pass-phrase-9")
    TopUp.objects.create(
        account=payer.account, amount_micros=50_000_000, currency="CNY", checkout_session_id="cs_told",
        created_by=payer,
    )  # fmt: skip
    with django_capture_on_commit_callbacks(execute=True):
        assert _post(*_signed(_paid_event("cs_told", 5000))).status_code == 200
        assert _post(*_signed(_paid_event("cs_told", 5000) | {"id": "evt_again"})).status_code == 200
    (told,) = Notice.objects.filter(kind="topup_credited")
    assert told.user == payer and "50.00 CNY" in told.text and told.url == "/wallet/"
    assert [m.to for m in mail.outbox] == [["payer@example.com"]]


@override_settings(STRIPE_WEBHOOK_SECRET=SECRET)
def test_bad_and_stale_signatures_are_400_and_move_nothing():
    account = make_account()
    TopUp.objects.create(
        account=account, amount_micros=50_000_000, currency="CNY", checkout_session_id="cs_x"
    )
    body, header = _signed(_paid_event("cs_x", 5000), secret="whsec_wrong")
    assert _post(body, header).status_code == 400
    body, header = _signed(_paid_event("cs_x", 5000), at=int(time.time()) - 3600)
    assert _post(body, header).status_code == 400
    assert _post(body, "").status_code == 400
    assert not Transfer.objects.exists()


@override_settings(STRIPE_WEBHOOK_SECRET=SECRET)
def test_unknown_and_unpaid_events_change_nothing():
    body, header = _signed({"id": "evt", "type": "customer.created", "data": {"object": {"id": "cus"}}})
    assert _post(body, header).json()["outcome"] == "ignored"
    TopUp.objects.create(
        account=make_account(), amount_micros=50_000_000, currency="CNY", checkout_session_id="cs_u"
    )
    unpaid = _paid_event("cs_u", 5000)
    unpaid["data"]["object"]["payment_status"] = "unpaid"
    body, header = _signed(unpaid)
    assert _post(body, header).json()["outcome"] == "not paid"
    assert not Transfer.objects.exists()
    assert TopUp.objects.get().state == "pending"


FAKE = Path(__file__).with_name("fake_stripe.py")


@pytest.fixture
def localstripe_url():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    process = subprocess.Popen(
        [sys.executable, str(FAKE), "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    url = f"http://127.0.0.1:{port}"
    for _ in range(100):
        try:
            httpx.get(url + "/v1/customers", headers={"Authorization": "Bearer sk_test_x"}, timeout=0.5)
            break
        except httpx.HTTPError:
            time.sleep(0.1)
    yield url
    process.terminate()
    process.wait(timeout=10)


def test_checkout_session_is_created_on_localstripe(localstripe_url, settings):
    settings.STRIPE_SECRET_KEY = "sk_test_x"
    settings.STRIPE_API_BASE = localstripe_url
    account = make_account()
    try:
        topup = topup_create(account=account, amount_micros=25_000_000, idempotency_key="k1")
    finally:
        stripe.api_base = "https://api.stripe.com"
    assert topup.checkout_session_id.startswith("cs_")
    assert topup.checkout_url
    assert topup.state == "pending"
    session = httpx.get(
        f"{localstripe_url}/v1/checkout/sessions/{topup.checkout_session_id}",
        headers={"Authorization": "Bearer sk_test_x"},
    ).json()
    assert session["amount_total"] == 2500 and session["mode"] == "payment"
    assert session["success_url"].startswith(settings.SITE_URL.rstrip("/") + "/wallet/")
    assert json.loads(json.dumps(session["metadata"]))["account_id"] == str(account.id)
