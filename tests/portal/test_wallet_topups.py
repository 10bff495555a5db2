"""The wallet page tells the payer what became of each card payment, in English and in Chinese."""

from __future__ import annotations

import re

import pytest
from django.test import Client

from billing.models import TopUp, TopUpDispute
from portal.services import user_create

pytestmark = pytest.mark.django_db

STATES = {
    # status: (TopUp fields, dispute state or None, English label, Chinese label)
    "pending": ({"state": "pending"}, None, "Pending", "待支付"),
    "expired": ({"state": "expired"}, None, "Expired", "已过期"),
    "failed": ({"state": "failed"}, None, "Payment failed", "支付失败"),
    "paid": ({"state": "paid"}, None, "Paid", "已支付"),
    "refunded": ({"state": "paid", "refunded_micros": 10_000_000}, None, "Refunded", "已退款"),
    "partly_refunded": ({"state": "paid", "refunded_micros": 4_000_000}, None, "Partly refunded", "部分退款"),
    "disputed": ({"state": "paid"}, "open", "Disputed", "争议中"),
    "dispute_lost": ({"state": "paid"}, "lost", "Dispute lost", "争议败诉"),
}


def _page(language: str) -> str:
    user = user_create(
        username=f"payer-{language}", email="", password="a-long-pass-phrase-9", language=language
    )
    for status, (fields, dispute, _en, _zh) in STATES.items():
        topup = TopUp.objects.create(
            account=user.account,
            amount_micros=10_000_000,
            currency="CNY",
            checkout_session_id=f"cs_{language}_{status}",
            **fields,
        )
        if dispute:
            TopUpDispute.objects.create(
                dispute_id=f"dp_{language}_{status}", topup=topup, amount_micros=10_000_000, state=dispute
            )
    client = Client()
    client.force_login(user)
    response = client.get("/wallet/")
    assert response.status_code == 200
    return response.content.decode()


def _rows(page: str) -> dict[str, str]:
    return {
        status: re.sub(r"<[^>]+>|\s+", " ", row)
        for status, row in re.findall(r'<tr data-topup-status="(\w+)">(.*?)</tr>', page, re.S)
    }


def test_every_topup_state_is_shown_in_english():
    rows = _rows(_page("en"))
    assert set(rows) == set(STATES)
    for status, (_fields, _dispute, label, _zh) in STATES.items():
        assert f" {label} " in rows[status], (status, rows[status])
    assert "4.00 CNY was refunded" in rows["partly_refunded"]
    assert "nothing was charged" in rows["expired"]
    assert "held until the dispute closes" in rows["disputed"]


def test_every_topup_state_is_shown_in_chinese():
    rows = _rows(_page("zh-hans"))
    assert set(rows) == set(STATES)
    for status, (_fields, _dispute, _en, label) in STATES.items():
        if label:
            assert label in rows[status], (status, rows[status])
        assert not re.search(r"[A-Za-z]{4,}", rows[status].replace("CNY", "")), rows[status]


def test_no_payments_yet_says_so():
    user = user_create(username="nobody", email="", password="a-long-pass-phrase-9")
    client = Client()
    client.force_login(user)
    assert "No card payments yet." in client.get("/wallet/").content.decode()
