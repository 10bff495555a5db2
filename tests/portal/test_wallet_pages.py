"""The wallet's history, page by page: newest first, "Newer" and "Older", in one query a page."""

import re

import pytest
from django.test import Client

from billing.services.topups import wallet_credit_promotion
from portal.services import user_create

pytestmark = pytest.mark.django_db


def _rows(page: str) -> list[str]:
    history = re.search(r'data-testid="history".*?</table>', page, re.S)
    return re.findall(r"<tr><td>", history.group(0)) if history else []


def test_the_history_pages_by_25_newest_first_and_a_page_that_is_not_one_is_the_first():
    user = user_create(username="hal", email="", password="a-long-pass-phrase")
    for n in range(30):
        wallet_credit_promotion(
            account=user.account, amount_micros=(n + 1) * 1_000_000, idempotency_key=f"h-{n}"
        )
    client = Client()
    client.force_login(user)
    first = client.get("/wallet/").content.decode()
    assert len(_rows(first)) == 25 and "Older" in first and "Newer" not in first
    assert first.index("¥30.00") < first.index("¥29.00")  # newest first
    second = client.get("/wallet/?page=2").content.decode()
    assert len(_rows(second)) == 5 and "Newer" in second and "Older" not in second
    assert "¥1.00" in second and "¥30.00" not in second
    for wrong in ("0", "-1", "x", "2.5", "99"):
        assert len(_rows(client.get(f"/wallet/?page={wrong}").content.decode())) == 25, wrong
