from __future__ import annotations

import pytest
from django.core.cache import cache
from rest_framework.test import APIClient

from billing.models import Card, Transfer
from billing.services.cards import card_batch_issue
from portal.services import team_create, user_create
from tests.billing.conftest import fund

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _clear_rate_limits():
    cache.clear()


def _client(username: str):
    user = user_create(username=username, email=f"{username}@example.com", password="a-long-pass-phrase-9")
    client = APIClient()
    client.force_authenticate(user)
    return user, client


def test_wallet_shows_balance_and_recent_entries():
    user, client = _client("alice")
    fund(user.account, 5_000_000)
    body = client.get("/api/v1/wallet").json()
    assert body["balance_micros"] == 5_000_000
    assert body["available_micros"] == 5_000_000
    assert body["runway_seconds"] is None
    assert body["recent_entries"][0]["amount_micros"] == 5_000_000


def test_team_wallet_needs_membership_and_others_are_404():
    alice, client = _client("alice")
    bob, other = _client("bob")
    team = team_create(creator=alice, name="Vision Lab")
    assert client.get(f"/api/v1/wallet?account={team.account_id}").status_code == 200
    assert other.get(f"/api/v1/wallet?account={team.account_id}").status_code == 404
    assert other.get(f"/api/v1/wallet?account={alice.account_id}").status_code == 404
    assert other.get("/api/v1/wallet?account=garbage").status_code == 404


def test_ledger_is_paged_and_filtered():
    user, client = _client("alice")
    for _ in range(3):
        fund(user.account, 1_000_000)
    body = client.get("/api/v1/ledger?limit=2").json()
    assert body["count"] == 3 and len(body["results"]) == 2
    assert client.get("/api/v1/ledger?kind=usage").json()["count"] == 0
    assert client.get("/api/v1/ledger?since=garbage").status_code == 400


def test_statement_csv():
    user, _ = _client("alice")
    fund(user.account, 1_000_000)
    from django.test import Client

    browser = Client()
    browser.force_login(user)
    response = browser.get("/wallet/statement.csv")
    text = b"".join(response.streaming_content).decode()
    assert response["Content-Type"].startswith("text/csv")
    assert "promotion" in text and "1000000" in text


@pytest.mark.parametrize(
    "payload",
    [
        {"amount_micros": 0},
        {"amount_micros": -5},
        {"amount_micros": 1.5},
        {"amount": "0.0000001"},
        {"amount": "abc"},
        {"amount": "10", "currency": "XXX"},
        {"amount_micros": 10},  # below the minimum
        {"amount_micros": 10**15},  # above the maximum
        {},
    ],
)
def test_bad_topup_amounts_are_clear_errors(payload):
    _, client = _client("alice")
    response = client.post("/api/v1/wallet/topups", payload, format="json")
    assert response.status_code == 400
    assert response.json()["error"]["message"]


@pytest.mark.parametrize("code", ["", "garbage", "x" * 10_000, "ABCD-EFGH-JKMN-PQRS-Z", "\u2603" * 17])
def test_garbage_codes_get_clear_4xx_without_hints(code):
    _, client = _client("alice")
    response = client.post("/api/v1/cards/redeem", {"code": code}, format="json")
    assert 400 <= response.status_code < 500
    error = response.json()["error"]
    assert error["code"] in ("code_invalid", "code_mistyped", "code_unknown")
    assert "hash" not in error["message"].lower()


def test_redeem_split_gift_revoke_through_the_api():
    alice, client = _client("alice")
    bob, other = _client("bob")
    _, (code,) = card_batch_issue(hours_micros=10_000_000, count=1, valid_days=30, max_parts=3)
    card = client.post("/api/v1/cards/redeem", {"code": code}, format="json").json()
    assert card["hours_left_micros"] == 10_000_000
    assert (
        client.post("/api/v1/cards/redeem", {"code": code}, format="json").json()["error"]["code"]
        == "code_used"
    )
    split = client.post(f"/api/v1/cards/{card['id']}/split", {"parts": [2, "1.5"]}, format="json")
    assert split.status_code == 201, split.json()
    parts = split.json()["parts"]
    assert [p["card"]["hours_left_micros"] for p in parts] == [2_000_000, 1_500_000]
    too_much = client.post(f"/api/v1/cards/{card['id']}/split", {"parts": [7]}, format="json")
    assert too_much.status_code == 400
    got = other.post("/api/v1/cards/redeem", {"code": parts[0]["code"]}, format="json").json()
    assert got["hours_left_micros"] == 2_000_000
    revoked = client.post(f"/api/v1/cards/{parts[1]['card']['id']}/revoke")
    assert revoked.status_code == 200
    detail = client.get(f"/api/v1/cards/{card['id']}").json()
    assert detail["hours_left_micros"] == 10_000_000 - 2_000_000
    assert other.get(f"/api/v1/cards/{card['id']}").status_code == 404
    lineage = other.get(f"/api/v1/cards/{got['id']}").json()["lineage"]
    assert lineage[0]["redeemed_by"] == "alice" and lineage[1]["gifted_by"] == "alice"
    gift = client.post(f"/api/v1/cards/{card['id']}/gift")
    assert gift.status_code == 201 and gift.json()["card"]["hours_left_micros"] == 8_000_000
    assert len(client.get("/api/v1/cards").json()) >= 2


def test_a_split_replayed_with_its_key_splits_once_and_gives_fresh_codes():
    alice, client = _client("alice")
    bob, other = _client("bob")
    _, (code,) = card_batch_issue(hours_micros=10_000_000, count=1, valid_days=30, max_parts=3)
    card = client.post("/api/v1/cards/redeem", {"code": code}, format="json").json()
    url, key = f"/api/v1/cards/{card['id']}/split", {"HTTP_IDEMPOTENCY_KEY": "split-once"}
    first = client.post(url, {"parts": [2, 3]}, format="json", **key)
    again = client.post(url, {"parts": [2, 3]}, format="json", **key)
    assert (first.status_code, again.status_code) == (201, 200)
    ids = [p["card"]["id"] for p in first.json()["parts"]]
    assert [p["card"]["id"] for p in again.json()["parts"]] == ids
    assert client.get(f"/api/v1/cards/{card['id']}").json()["hours_left_micros"] == 5_000_000
    assert Transfer.objects.filter(kind=Transfer.Kind.CARD_SPLIT).count() == 2  # the replay posted nothing
    # The first codes were replaced: the replay's work, the first ones do not.
    old, new = first.json()["parts"][0]["code"], again.json()["parts"][0]["code"]
    assert old != new
    assert other.post("/api/v1/cards/redeem", {"code": old}, format="json").status_code >= 400
    assert other.post("/api/v1/cards/redeem", {"code": new}, format="json").status_code == 201
    third = client.post(url, {"parts": [2, 3]}, format="json", **key).json()["parts"]
    assert third[0]["code"] == "" and third[1]["code"]  # the redeemed part has no code to give
    other_parts = client.post(url, {"parts": [1]}, format="json", **key)
    assert other_parts.status_code == 409
    assert other_parts.json()["error"]["code"] == "idempotency_key_reused"
    bad = client.post(url, {"parts": [1]}, format="json", HTTP_IDEMPOTENCY_KEY="x" * 201)
    assert bad.status_code == 400 and Card.objects.filter(parent_id=card["id"]).count() == 2
    # Another tenant replaying the key on that card finds nothing.
    assert other.post(url, {"parts": [2, 3]}, format="json", **key).status_code == 404


def test_redeem_is_rate_limited():
    _, client = _client("alice")
    codes = [
        client.post("/api/v1/cards/redeem", {"code": "nope"}, format="json").status_code for _ in range(12)
    ]
    assert codes[-1] == 429
