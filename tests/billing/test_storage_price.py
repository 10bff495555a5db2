"""Home storage priced per GB-month above a free allowance, charged once a UTC day through the ledger
(billing/services/storage.py): exact amounts, the payer rule of metering, idempotency, bad input."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta

import pytest
from django.db import connection
from django.test import Client

from billing.models import AuditEntry, LedgerAccount, StoragePrice, Transfer
from billing.services.cards import card_batch_issue, card_redeem
from billing.services.ledger import overdraft_for, wallet_for
from billing.services.storage import StorageCharge, storage_charge_many, storage_price_set
from core.clock import db_now
from core.errors import ValidationFailed
from portal.services import user_create
from tests.billing.conftest import assert_ledger_invariants, fund

pytestmark = pytest.mark.django_db
GB = 10**9


@pytest.fixture(autouse=True)
def _fast_hasher(settings):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


def _today():
    return db_now().astimezone(UTC).date()


def _user(name: str, *, wallet: int = 0):
    user = user_create(username=name, email="", password="pw-123456789")
    if wallet:
        fund(user.account, wallet)
    return user


def _charge(user, home_bytes: int, day=None) -> int:
    return storage_charge_many(
        charges=[StorageCharge(user.id, user.account_id, home_bytes)], day=day or _today()
    )


def _storage_transfers(user) -> list[Transfer]:
    return list(Transfer.objects.filter(kind="storage", idempotency_key__startswith=f"storage:{user.id}:"))


def _yesterday_price(**fields) -> StoragePrice:
    """A price in effect since before today began (a day is charged at the price of its start)."""
    return storage_price_set(effective_from=db_now() - timedelta(days=2), **fields)


@pytest.mark.parametrize(
    ("price", "free_gb", "home_bytes", "expected"),
    [
        (3_000_000, 5, 17 * GB, 1_200_000),  # 12 GB × ¥3 / 30
        (1_000_000, 5, 6_234_567_891, 41_152),  # 1.234567891 GB × ¥1 / 30 = 41,152.26…: rounded down
        (2_500_000, 0, 1_000_000_007, 83_333),  # 1.000000007 GB × ¥2.5 / 30 = 83,333.35…
        (7, 0, 10 * GB, 2),  # 10 GB × 7 micros / 30 = 2.33…
    ],
)
def test_a_day_costs_the_bytes_over_the_allowance_times_the_price_over_thirty_rounded_down(
    price, free_gb, home_bytes, expected
):
    user = _user("ada", wallet=100_000_000)
    _yesterday_price(price_micros_per_gb_month=price, free_gb=free_gb)
    assert _charge(user, home_bytes) == 1
    (transfer,) = _storage_transfers(user)
    assert transfer.amount_micros == expected
    assert transfer.debit_id == wallet_for(account=user.account).id
    assert transfer.credit.kind == LedgerAccount.Kind.REVENUE
    assert transfer.idempotency_key == f"storage:{user.id}:{_today().isoformat()}:wallet"
    assert transfer.memo == _today().isoformat()
    assert wallet_for(account=user.account).balance_micros == 100_000_000 - expected
    assert_ledger_invariants()


def test_nothing_is_charged_at_or_under_the_allowance_nor_for_a_fraction_below_one_micro():
    user = _user("bo", wallet=10_000_000)
    _yesterday_price(price_micros_per_gb_month=3_000_000, free_gb=5)
    assert _charge(user, 5 * GB) == 0  # at the allowance exactly
    assert _charge(user, 5 * GB + 1) == 0  # one byte over: 3e6 / 3e10 of a micro
    assert _storage_transfers(user) == []
    assert wallet_for(account=user.account).balance_micros == 10_000_000


def test_without_a_price_storage_is_free():
    user = _user("cy", wallet=10_000_000)
    assert _charge(user, 500 * GB) == 0
    assert Transfer.objects.filter(kind="storage").count() == 0


def test_a_price_effective_tomorrow_is_not_used_today_and_one_from_yesterday_still_is():
    user = _user("di", wallet=10_000_000)
    _yesterday_price(price_micros_per_gb_month=3_000_000)
    tomorrow = datetime.combine(_today() + timedelta(days=1), datetime.min.time(), tzinfo=UTC)
    storage_price_set(price_micros_per_gb_month=300_000_000, effective_from=tomorrow)
    assert _charge(user, 10 * GB) == 1
    assert [t.amount_micros for t in _storage_transfers(user)] == [1_000_000]  # 10 × 3e6 / 30


def test_a_price_set_during_the_day_starts_with_the_next_day():
    user = _user("ed", wallet=10_000_000)
    storage_price_set(price_micros_per_gb_month=3_000_000)  # effective now: today began without it
    assert _charge(user, 10 * GB) == 0
    assert _storage_transfers(user) == []


def test_the_same_day_charged_twice_moves_money_once_and_a_new_day_charges_again():
    # a wallet that cannot pay twice: a second charge would spill into the overdraft under new keys
    user = _user("fa", wallet=1_500_000)
    _yesterday_price(price_micros_per_gb_month=3_000_000)
    yesterday = _today() - timedelta(days=1)
    assert _charge(user, 10 * GB) == 1  # ¥1
    assert _charge(user, 20 * GB) == 0  # grew since: today is already charged
    assert wallet_for(account=user.account).balance_micros == 500_000
    assert overdraft_for(account=user.account).balance_micros == 0
    assert _charge(user, 10 * GB, day=yesterday) == 2  # ¥0.50 from the wallet, ¥0.50 owed
    assert _charge(user, 10 * GB, day=yesterday) == 0
    assert sorted(t.memo for t in _storage_transfers(user)) == [
        yesterday.isoformat(),
        yesterday.isoformat(),
        _today().isoformat(),
    ]
    assert wallet_for(account=user.account).balance_micros == 0
    assert overdraft_for(account=user.account).balance_micros == -500_000
    assert_ledger_invariants()


def test_cards_for_any_model_pay_before_the_wallet_and_a_card_tied_to_a_model_does_not():
    user = _user("gu", wallet=10_000_000)
    _, (code,) = card_batch_issue(hours_micros=500_000, count=1, valid_days=30)
    card = card_redeem(user=user, account=user.account, code=code)
    _, (tied_code,) = card_batch_issue(hours_micros=9_000_000, count=1, valid_days=30, gpu_models=["T4"])
    tied = card_redeem(user=user, account=user.account, code=tied_code)
    # 30 GB: ¥3 a day, or 1 card-hour a day
    _yesterday_price(price_micros_per_gb_month=3_000_000, card_micros_per_gb_month=1_000_000)
    assert _charge(user, 30 * GB) == 2
    by_source = {t.debit.kind: t.amount_micros for t in _storage_transfers(user)}
    # the card's half card-hour pays half the day; the wallet the other half
    assert by_source == {"card": 500_000, "wallet": 1_500_000}
    card.ledger_account.refresh_from_db()
    tied.ledger_account.refresh_from_db()
    assert card.ledger_account.balance_micros == 0
    assert tied.ledger_account.balance_micros == 9_000_000
    assert wallet_for(account=user.account).balance_micros == 8_500_000
    assert_ledger_invariants()


def test_without_a_card_rate_cards_do_not_pay_for_storage():
    user = _user("ha", wallet=10_000_000)
    _, (code,) = card_batch_issue(hours_micros=5_000_000, count=1, valid_days=30)
    card = card_redeem(user=user, account=user.account, code=code)
    _yesterday_price(price_micros_per_gb_month=3_000_000)
    _charge(user, 30 * GB)
    card.ledger_account.refresh_from_db()
    assert card.ledger_account.balance_micros == 5_000_000
    assert wallet_for(account=user.account).balance_micros == 7_000_000


def test_what_the_wallet_lacks_goes_to_the_overdraft_as_gpu_time_does():
    user = _user("io", wallet=1_000_000)
    _yesterday_price(price_micros_per_gb_month=3_000_000)
    assert _charge(user, 30 * GB) == 2
    assert wallet_for(account=user.account).balance_micros == 0
    assert overdraft_for(account=user.account).balance_micros == -2_000_000
    assert_ledger_invariants()


def test_bad_input_is_refused_and_changes_nothing():
    user = _user("ju", wallet=10_000_000)
    for bad in ({"price_micros_per_gb_month": -1}, {"price_micros_per_gb_month": 1, "free_gb": -5},
                {"price_micros_per_gb_month": 1.5}, {"price_micros_per_gb_month": 1, "card_micros_per_gb_month": -1},
                {"price_micros_per_gb_month": 1, "effective_from": "2026-01-01"}):  # fmt: skip
        with pytest.raises(ValidationFailed):
            storage_price_set(**bad)
    assert StoragePrice.objects.count() == 0
    assert not AuditEntry.objects.filter(action="storage_price.set").exists()
    _yesterday_price(price_micros_per_gb_month=3_000_000)
    for day in ("2026-12-06", _today() + timedelta(days=1), db_now()):
        with pytest.raises(ValidationFailed):
            _charge(user, 30 * GB, day=day)
    with pytest.raises(ValidationFailed):
        _charge(user, -1)
    assert Transfer.objects.filter(kind="storage").count() == 0
    assert wallet_for(account=user.account).balance_micros == 10_000_000


def test_a_price_version_leaves_an_audit_row():
    _yesterday_price(price_micros_per_gb_month=3_000_000, free_gb=5)
    storage_price_set(price_micros_per_gb_month=4_000_000, free_gb=10)
    audit = AuditEntry.objects.filter(action="storage_price.set").order_by("id").last()
    assert audit.before["price_micros_per_gb_month"] == 3_000_000
    assert (audit.after["price_micros_per_gb_month"], audit.after["free_gb"]) == (4_000_000, 10)


@pytest.mark.django_db(transaction=True)
def test_two_workers_at_once_charge_a_day_once():
    # wallets that cannot pay twice: a second charge would go on into the overdraft
    users = [_user(f"race{i}", wallet=4_000_000) for i in range(3)]
    _yesterday_price(price_micros_per_gb_month=3_000_000)
    charges = [StorageCharge(u.id, u.account_id, 30 * GB) for u in users]
    barrier = threading.Barrier(4)

    def run(_i):
        barrier.wait()
        try:
            return storage_charge_many(charges=charges, day=_today())
        finally:
            connection.close()

    with ThreadPoolExecutor(4) as pool:
        written = list(pool.map(run, range(4)))
    assert sorted(written) == [0, 0, 0, 3]
    for user in users:
        assert [t.amount_micros for t in _storage_transfers(user)] == [3_000_000]
        assert wallet_for(account=user.account).balance_micros == 1_000_000
        assert overdraft_for(account=user.account).balance_micros == 0
    assert_ledger_invariants()


def test_an_admin_adds_a_version_through_the_service_and_a_negative_price_is_refused():
    admin_user = user_create(username="root", email="r@example.com", password="pw-123456789", is_staff=True)
    admin_user.is_superuser = True
    admin_user.save(update_fields=["is_superuser"])
    client = Client()
    client.force_login(admin_user)
    form = {
        "price_micros_per_gb_month": "3000000",
        "free_gb": "5",
        "card_micros_per_gb_month": "",
        "effective_from_0": "2026-01-01",
        "effective_from_1": "00:00:00",
    }
    refused = client.post("/admin/billing/storageprice/add/", {**form, "price_micros_per_gb_month": "-1"})
    assert refused.status_code == 200  # the form again, with the error
    assert StoragePrice.objects.count() == 0
    assert client.post("/admin/billing/storageprice/add/", form).status_code == 302
    row = StoragePrice.objects.get()
    assert (row.price_micros_per_gb_month, row.free_gb, row.card_micros_per_gb_month) == (3_000_000, 5, None)
    assert row.created_by == admin_user
    assert AuditEntry.objects.filter(action="storage_price.set", actor=admin_user).count() == 1
    assert client.get(f"/admin/billing/storageprice/{row.id}/change/").status_code == 200  # read-only view
