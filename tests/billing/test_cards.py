"""Compute cards: issue, redeem (and every error), split, gift, revoke, expiry, reminders, daily grant,
burn order, and the ``cards issue`` command."""

from __future__ import annotations

import csv
import io
from datetime import timedelta

import pytest
from django.core import mail
from django.core.cache import cache
from django.core.management import call_command
from django.db import IntegrityError, connection, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from rest_framework.test import APIClient

from billing.codes import code_generate, code_normalize
from billing.models import CARD_UNIT, Card, CardBatch, LedgerAccount, Transfer
from billing.services.cards import (
    _make_parts,
    card_batch_issue,
    card_daily_grant,
    card_expire,
    card_gift,
    card_redeem,
    card_remind,
    card_split,
)
from billing.services.ledger import overdraft_for, system_account, wallet_for
from billing.services.metering import meter_alive, meter_cost, meter_open, metering_tick
from billing.services.pricing import price_quote
from billing.services.topups import wallet_credit_promotion
from core.clock import db_now
from notices.models import Notice
from portal.services import user_create
from tests.billing.conftest import A100, assert_ledger_invariants

pytestmark = pytest.mark.django_db
HOUR = 1_000_000


@pytest.fixture(autouse=True)
def _clear_rate_limits():
    cache.clear()


def _user(name: str):
    return user_create(username=name, email=f"{name}@example.com", password="a-long-pass-phrase-9")


def _client(user) -> APIClient:
    client = APIClient()
    client.force_authenticate(user)
    return client


def _redeem(client, code, **extra):
    return client.post("/api/v1/cards/redeem", {"code": code}, format="json", **extra)


def _typo(code: str) -> str:
    """The same code with one data symbol changed: the check symbol no longer matches."""
    data = code_normalize(code)
    swapped = ("1" if data[0] != "1" else "2") + data[1:]
    return swapped + code[-1]


# --- issue --------------------------------------------------------------------------------------------


def test_codes_are_80_bits_grouped_with_a_check_symbol_and_stored_hashed():
    batch, codes = card_batch_issue(hours_micros=HOUR, count=20, valid_days=30)
    assert len(set(codes)) == 20
    for code in codes:
        groups = code.split("-")
        assert [len(g) for g in groups] == [4, 4, 4, 4, 1]
        assert code_normalize(code) == "".join(groups[:4])
    stored = set(batch.cards.values_list("codes__code_hash", flat=True))
    assert not stored & {code_normalize(c) for c in codes} and not stored & set(codes)
    assert system_account(kind="promotions", unit=CARD_UNIT).balance_micros == -20 * HOUR


def test_cards_issue_command_prints_one_code_a_line_and_writes_csv(tmp_path):
    out, err = io.StringIO(), io.StringIO()
    path = tmp_path / "codes.csv"
    call_command(
        "cards",
        "issue",
        "--hours",
        "2.5",
        "--count",
        "3",
        "--valid-days",
        "30",
        "--models",
        A100,
        "T4",
        "--max-parts",
        "2",
        "--label",
        "DL101",
        "--csv",
        str(path),
        stdout=out,
        stderr=err,
    )
    codes = out.getvalue().split()
    assert len(codes) == 3 and all(code_normalize(c) for c in codes)
    batch = CardBatch.objects.get(label="DL101")
    assert batch.hours_micros == 2_500_000 and batch.gpu_models == sorted([A100, "T4"])
    assert batch.max_parts == 2 and batch.one_per_user and batch.valid_days == 30
    rows = list(csv.DictReader(path.open()))
    assert [r["code"] for r in rows] == codes and rows[0]["hours"] == "2.5"
    assert path.stat().st_mode & 0o077 == 0
    user = _user("cmd")
    assert (
        card_redeem(user=user, account=user.account, code=codes[0]).ledger_account.balance_micros == 2_500_000
    )


def test_cards_issue_command_with_a_fixed_date_and_bad_input():
    out = io.StringIO()
    call_command("cards", "issue", "--hours", "1", "--count", "1", "--valid-until", "2099-01-31", stdout=out)
    batch = CardBatch.objects.get()
    assert timezone.localtime(batch.valid_until).strftime("%Y-%m-%d %H:%M") == "2099-01-31 23:59"
    from django.core.management.base import CommandError

    for bad in (["--hours", "0"], ["--hours", "x"], ["--hours", "1"]):  # the last: no validity
        with pytest.raises(CommandError):
            call_command("cards", "issue", *bad, "--count", "1", stdout=io.StringIO())


# --- redeem: every answer -----------------------------------------------------------------------------


def test_redeem_errors_through_the_api():
    alice, bob = _user("alice"), _user("bob")
    client, other = _client(alice), _client(bob)
    _, (code, second) = card_batch_issue(hours_micros=5 * HOUR, count=2, valid_days=30)

    typo = _redeem(client, _typo(code))
    assert typo.status_code == 400 and typo.json()["error"]["code"] == "code_mistyped"
    assert _redeem(client, "").json()["error"]["code"] == "code_invalid"
    unknown = _redeem(client, code_generate())
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "code_unknown"

    assert _redeem(client, code).status_code == 201
    used = _redeem(other, code)
    assert used.status_code == 409 and used.json()["error"]["code"] == "code_used"
    limit = _redeem(client, second)  # one card of the batch per user
    assert limit.status_code == 400 and limit.json()["error"]["code"] == "card_limit"
    assert _redeem(other, second).status_code == 201


def test_a_mistyped_code_is_refused_before_any_lookup():
    user = _user("typist")
    _, (code,) = card_batch_issue(hours_micros=HOUR, count=1, valid_days=30)
    with CaptureQueriesContext(connection) as queries:
        response = _redeem(_client(user), _typo(code))
    assert response.json()["error"]["code"] == "code_mistyped"
    assert not [q for q in queries.captured_queries if "billing_invitecode" in q["sql"]]


def test_redeem_of_expired_and_revoked_codes():
    alice, bob = _user("alice"), _user("bob")
    _, (code,) = card_batch_issue(hours_micros=5 * HOUR, count=1, valid_days=30, max_parts=3)
    card = card_redeem(user=alice, account=alice.account, code=code)
    client = _client(alice)
    parts = client.post(f"/api/v1/cards/{card.id}/split", {"parts": [1, 1]}, format="json").json()["parts"]
    client.post(f"/api/v1/cards/{parts[0]['card']['id']}/revoke")
    revoked = _redeem(_client(bob), parts[0]["code"])
    assert revoked.status_code == 400 and revoked.json()["error"]["code"] == "code_revoked"

    _, (old,) = card_batch_issue(hours_micros=HOUR, count=1, valid_until=db_now() - timedelta(seconds=1))
    expired = _redeem(_client(bob), old)
    assert expired.status_code == 400 and expired.json()["error"]["code"] == "code_expired"
    assert Card.objects.get(id=parts[1]["card"]["id"]).state == "gifted"


def test_redeem_is_rate_limited_per_user_and_per_ip(settings):
    settings.CARD_REDEEM_RATE_PER_MINUTE = 3
    one, two, three = _user("one"), _user("two"), _user("three")
    answers = [_redeem(_client(one), "nope", REMOTE_ADDR="192.0.2.1").status_code for _ in range(4)]
    assert answers == [400, 400, 400, 429]
    assert _redeem(_client(two), "nope", REMOTE_ADDR="192.0.2.9").status_code == 400  # another user and IP
    cache.clear()
    shared = {"REMOTE_ADDR": "198.51.100.7"}
    answers = [_redeem(_client(u), "nope", **shared).status_code for u in (one, two, three, two)]
    assert answers[-1] == 429  # one IP guessing through many accounts
    _, (code,) = card_batch_issue(hours_micros=HOUR, count=1, valid_days=3)
    assert _redeem(_client(three), code, **shared).status_code == 429  # even a good code, nothing moved
    assert not Card.objects.filter(state="active").exists()


# --- split, gift, revoke ------------------------------------------------------------------------------


def test_split_errors_change_nothing():
    alice, bob = _user("alice"), _user("bob")
    _, (code,) = card_batch_issue(hours_micros=10 * HOUR, count=1, valid_days=30, max_parts=2)
    card = card_redeem(user=alice, account=alice.account, code=code)
    client = _client(alice)
    url = f"/api/v1/cards/{card.id}/split"
    for body in (
        {"parts": []},
        {"parts": [1, 1, 1]},  # more than max_parts
        {"parts": [0.5]},  # below the one-hour minimum
        {"parts": [6, 5]},  # more than is left
        {"parts": [-1]},
        {"parts": ["x"]},
        {},
    ):
        response = client.post(url, body, format="json")
        assert response.status_code == 400, body
        assert response.json()["error"]["message"]
    assert _client(bob).post(url, {"parts": [1]}, format="json").status_code == 404  # someone else's
    card.ledger_account.refresh_from_db()
    assert card.ledger_account.balance_micros == 10 * HOUR
    assert not Card.objects.filter(parent=card).exists()

    _, (whole,) = card_batch_issue(hours_micros=3 * HOUR, count=1, valid_days=30, max_parts=0, label="x")
    unsplittable = card_redeem(user=alice, account=alice.account, code=whole)
    answer = client.post(f"/api/v1/cards/{unsplittable.id}/split", {"parts": [1]}, format="json")
    assert answer.json()["error"]["code"] == "not_splittable"

    Card.objects.filter(id=card.id).update(expires_at=db_now() - timedelta(seconds=1))
    assert client.post(url, {"parts": [1]}, format="json").json()["error"]["code"] == "card_inactive"


def test_a_split_key_reaches_the_ledger_whose_unique_key_refuses_a_second_split_under_it():
    """The card lock makes a replay return the first parts; under it, the split's transfers carry the
    key, so even a split that skipped the replay check could not post twice under one key."""
    alice = _user("alice")
    _, (code,) = card_batch_issue(hours_micros=10 * HOUR, count=1, valid_days=30, max_parts=5)
    card = card_redeem(user=alice, account=alice.account, code=code)
    made = card_split(card_id=card.id, account=alice.account, parts=[2 * HOUR, HOUR], idempotency_key="k-1")
    keys = Transfer.objects.filter(kind=Transfer.Kind.CARD_SPLIT).values_list("idempotency_key", flat=True)
    assert len(keys) == 2 and all(k.startswith(f"card:{card.id}:split:") for k in keys)
    assert {part.split_key for part, _code in made} == {"k-1"}
    with pytest.raises(IntegrityError), transaction.atomic():
        locked = Card.objects.select_for_update().get(id=card.id)
        ledger = LedgerAccount.objects.select_for_update().get(id=card.ledger_account_id)
        _make_parts(card=locked, ledger=ledger, amounts=[HOUR], actor=None, now=db_now(), split_key="k-1")
    card.ledger_account.refresh_from_db()
    assert card.ledger_account.balance_micros == 7 * HOUR
    assert Card.objects.filter(parent=card).count() == 2
    # without a key (and under another) splits stay independent
    card_split(card_id=card.id, account=alice.account, parts=[HOUR], idempotency_key="k-2")
    card_split(card_id=card.id, account=alice.account, parts=[HOUR])
    assert Card.objects.filter(parent=card).count() == 4
    assert_ledger_invariants()


def test_parts_keep_restrictions_and_expiry_and_lineage_names_users_only():
    alice, bob = _user("alice"), _user("bob")
    _, (code,) = card_batch_issue(
        hours_micros=4 * HOUR, count=1, valid_days=10, gpu_models=[A100], max_parts=3, label="course"
    )
    card = card_redeem(user=alice, account=alice.account, code=code)
    ((part, part_code),) = card_split(card_id=card.id, account=alice.account, parts=[2 * HOUR], actor=alice)
    assert part.gpu_models == [A100] and part.expires_at == card.expires_at
    got = card_redeem(user=bob, account=bob.account, code=part_code)
    lineage = _client(bob).get(f"/api/v1/cards/{got.id}").json()["lineage"]
    assert [step["batch"] for step in lineage] == ["course", "course"]
    assert lineage[0]["redeemed_by"] == "alice" and lineage[1]["gifted_by"] == "alice"
    assert lineage[1]["redeemed_by"] == "bob"
    assert "example.com" not in str(lineage)


# --- expiry, reminders, daily grant -------------------------------------------------------------------


def test_expiry_moves_what_is_left_to_the_expiry_account():
    user = _user("late")
    _, (code,) = card_batch_issue(hours_micros=3 * HOUR, count=1, valid_days=1)
    card = card_redeem(user=user, account=user.account, code=code)
    assert card_expire(now=db_now() + timedelta(hours=1)) == 0
    assert card_expire(now=db_now() + timedelta(days=2)) == 1
    card.refresh_from_db()
    assert card.state == "expired"
    assert LedgerAccount.objects.get(id=card.ledger_account_id).balance_micros == 0
    assert system_account(kind="card_expiry", unit=CARD_UNIT).balance_micros == 3 * HOUR
    assert card_expire(now=db_now() + timedelta(days=3)) == 0  # idempotent
    assert_ledger_invariants()


def test_an_unredeemed_gift_returns_to_its_parent_while_the_parent_is_valid():
    user = _user("giver")
    _, (code,) = card_batch_issue(hours_micros=5 * HOUR, count=1, valid_days=60)
    card = card_redeem(user=user, account=user.account, code=code)
    ((part, part_code),) = card_split(card_id=card.id, account=user.account, parts=[2 * HOUR])
    assert card_expire(now=db_now() + timedelta(days=15)) == 1  # gift codes live 14 days
    part.refresh_from_db()
    card.ledger_account.refresh_from_db()
    assert part.state == "expired" and card.ledger_account.balance_micros == 5 * HOUR
    friend = _user("friend")
    with pytest.raises(Exception) as caught:
        card_redeem(user=friend, account=friend.account, code=part_code)
    assert caught.value.code in ("code_revoked", "code_expired")
    assert system_account(kind="card_expiry", unit=CARD_UNIT).balance_micros == 0
    assert_ledger_invariants()


def test_reminders_seven_days_and_one_day_before_by_notice_and_mail(django_capture_on_commit_callbacks):
    user = _user("reminded")
    _, (code,) = card_batch_issue(hours_micros=2 * HOUR, count=1, valid_days=10)
    card = card_redeem(user=user, account=user.account, code=code)
    with django_capture_on_commit_callbacks(execute=True):
        assert card_remind(now=card.expires_at - timedelta(days=8)) == 0
        assert card_remind(now=card.expires_at - timedelta(days=6)) == 1
        assert card_remind(now=card.expires_at - timedelta(days=5)) == 0  # once per lead time
        assert card_remind(now=card.expires_at - timedelta(hours=20)) == 1
    notices = Notice.objects.filter(user=user).order_by("id")
    assert [(n.kind, n.dedupe_key) for n in notices] == [
        ("card_expiring", f"card:{card.id}:expiry:7d"),
        ("card_expiring", f"card:{card.id}:expiry:1d"),
    ]
    assert f"#{card.id}" in notices[0].text and "2.00 h" in notices[0].text
    assert [m.to for m in mail.outbox] == [["reminded@example.com"], ["reminded@example.com"]]
    assert mail.outbox[0].subject == "A compute card expires soon"
    assert "/cards/" in mail.outbox[0].body


def test_a_redeemed_gift_tells_its_new_holder_and_its_giver(django_capture_on_commit_callbacks):
    giver, friend = _user("giver"), _user("friend")
    _, (code,) = card_batch_issue(hours_micros=4 * HOUR, count=1, valid_days=10, max_parts=3)
    card = card_redeem(user=giver, account=giver.account, code=code)
    part, part_code = card_gift(card_id=card.id, account=giver.account, actor=giver)
    assert not Notice.objects.exists()  # nothing until it is received
    with django_capture_on_commit_callbacks(execute=True):
        card_redeem(user=friend, account=friend.account, code=part_code)
    received = Notice.objects.get(user=friend, kind="card_received")
    redeemed = Notice.objects.get(user=giver, kind="card_received")
    assert "a gift from giver" in received.text and f"#{part.id}" in received.text
    assert "redeemed by friend" in redeemed.text
    assert sorted(m.to[0] for m in mail.outbox) == ["friend@example.com", "giver@example.com"]


def test_daily_grant_is_off_by_default_and_not_cumulative_when_on(settings):
    user = _user("daily")
    assert card_daily_grant(user=user, account=user.account) is None
    settings.CARD_DAILY_GRANT_MICROS = 2 * HOUR
    first = card_daily_grant(user=user, account=user.account)
    again = card_daily_grant(user=user, account=user.account)
    assert first.id == again.id and first.ledger_account.balance_micros == 2 * HOUR

    local_end = timezone.localtime(first.expires_at)
    assert (local_end.hour, local_end.minute) == (0, 0) and first.expires_at - db_now() <= timedelta(days=1)
    assert not first.splittable
    tomorrow = card_daily_grant(user=user, account=user.account, now=db_now() + timedelta(days=1))
    assert tomorrow.id != first.id
    card_expire(now=first.expires_at + timedelta(seconds=1))
    first.refresh_from_db()
    assert first.state == "expired"  # yesterday's hours do not add up


# --- burn order ---------------------------------------------------------------------------------------


def test_metering_burns_restricted_cards_first_then_earliest_expiry_then_the_wallet(prices):
    user = _user("burner")
    account = user.account
    wallet_credit_promotion(account=account, amount_micros=5_000_000, idempotency_key="burner-wallet")
    _, (later_any,) = card_batch_issue(hours_micros=HOUR, count=1, valid_days=20, one_per_user=False)
    _, (sooner_any,) = card_batch_issue(hours_micros=HOUR, count=1, valid_days=5, one_per_user=False)
    _, (a100_only,) = card_batch_issue(hours_micros=HOUR, count=1, valid_days=30, gpu_models=[A100])
    _, (t4_only,) = card_batch_issue(hours_micros=HOUR, count=1, valid_days=1, gpu_models=["T4"])
    cards = {n: card_redeem(user=user, account=account, code=c) for n, c in
             {"later": later_any, "sooner": sooner_any, "a100": a100_only, "t4": t4_only}.items()}  # fmt: skip
    quote = price_quote(gpu_model=A100, profile="whole")  # 12.00 an hour, or 2 card-hours an hour
    start = db_now() - timedelta(hours=3)
    meter_open(
        account=account, session_ref="b1", gpu_model=A100, profile="whole", quote=quote, started_at=start
    )
    wallet = wallet_for(account=account)
    left = {}
    # the last tick bills 40 min 1 s: 30 min on the last usable card, then 601 s from the wallet
    for seconds in (30 * 60, 60 * 60, 100 * 60 + 1):
        meter_alive(session_refs=["b1"], alive_at=start + timedelta(seconds=seconds))
        metering_tick(now=start + timedelta(seconds=seconds))
        left[seconds] = {
            n: LedgerAccount.objects.get(id=c.ledger_account_id).balance_micros for n, c in cards.items()
        } | {"wallet": LedgerAccount.objects.get(id=wallet.id).balance_micros}
    from_wallet = 12_000_000 * 601 // 3600
    assert from_wallet == 2_003_333
    assert left[1800] == {"a100": 0, "sooner": HOUR, "later": HOUR, "t4": HOUR, "wallet": 5_000_000}
    assert left[3600] == {"a100": 0, "sooner": 0, "later": HOUR, "t4": HOUR, "wallet": 5_000_000}
    # the T4 card never pays for an A100
    assert left[6001] == {"a100": 0, "sooner": 0, "later": 0, "t4": HOUR, "wallet": 5_000_000 - from_wallet}
    cost = meter_cost(session_ref="b1")
    assert (cost.card_micros, cost.wallet_micros, cost.overdraft_micros) == (3 * HOUR, from_wallet, 0)
    assert (cost.charged_micros, cost.accrued_micros, cost.billed_seconds) == (from_wallet, 0, 6001)
    assert overdraft_for(account=account).balance_micros == 0
    assert_ledger_invariants()
