"""The database protects posted money itself, and a periodic reconciliation catches what gets around it."""

from __future__ import annotations

import psycopg
import pytest
from django.core import mail
from django.db import DatabaseError, connection, transaction
from django.test import Client

from billing.models import AuditEntry, Entry, LedgerHold, Transfer
from billing.services.ledger import wallet_adjust, wallet_for
from billing.services.metering import account_can_launch
from billing.services.pricing import price_quote
from billing.services.reconcile import ledger_findings, ledger_hold_resolve, ledger_reconcile
from billing.tasks import ledger_reconcile_task
from core.errors import Conflict, ValidationFailed
from notices.models import Notice
from portal.services import user_create
from tests.billing.conftest import A100, assert_ledger_invariants, fund, make_account, seed_prices

pytestmark = pytest.mark.django_db


def _refused(sql: str, params: list) -> str:
    """Run ``sql`` as the app's own database user (Django's connection); return PostgreSQL's refusal."""
    with pytest.raises(DatabaseError) as refused, transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(sql, params)
    return str(refused.value)


def test_update_and_delete_of_posted_money_are_refused_by_postgresql():
    account = make_account()
    fund(account, 5_000_000)
    entry = Entry.objects.filter(account=wallet_for(account=account)).get()
    transfer = entry.transfer
    for sql, params in [
        ("UPDATE billing_entry SET amount_micros = 999000000 WHERE id = %s", [entry.id]),
        ("UPDATE billing_entry SET balance_after_micros = 0 WHERE id = %s", [entry.id]),
        ("DELETE FROM billing_entry WHERE id = %s", [entry.id]),
        ("UPDATE billing_transfer SET amount_micros = 1 WHERE id = %s", [transfer.id]),
        ("UPDATE billing_transfer SET memo = 'edited', actor_id = NULL WHERE id = %s", [transfer.id]),
        ("DELETE FROM billing_transfer WHERE id = %s", [transfer.id]),
    ]:
        assert "append-only" in _refused(sql, params), sql
    entry.refresh_from_db()
    assert entry.amount_micros == 5_000_000 and Transfer.objects.count() == 1
    assert_ledger_invariants()


def test_the_orm_cannot_edit_or_delete_an_entry_either():
    account = make_account()
    fund(account, 1_000_000)
    entry = Entry.objects.filter(account=wallet_for(account=account)).get()
    with pytest.raises(DatabaseError), transaction.atomic():
        Entry.objects.filter(pk=entry.pk).update(amount_micros=2)
    with pytest.raises(DatabaseError), transaction.atomic():
        Entry.objects.filter(pk=entry.pk).delete()
    assert Entry.objects.get(pk=entry.pk).amount_micros == 1_000_000


def test_deleting_a_user_unlinks_them_from_their_transfers_and_keeps_the_money():
    staff = user_create(username="leaver", email="", password="a-long-pass-phrase-9")
    account = make_account()
    transfer = wallet_adjust(
        account=account, amount_micros=3_000_000, actor=staff, reason="goodwill", idempotency_key="g1"
    )
    staff.delete()
    transfer.refresh_from_db()
    assert transfer.actor_id is None and transfer.amount_micros == 3_000_000
    assert_ledger_invariants()


def _superuser_sql(sql: str, params: list, *, replica: bool = False) -> None:
    """Behind the app's back: a separate connection as the database superuser."""
    db = connection.settings_dict
    with psycopg.connect(
        host=db["HOST"], port=db["PORT"] or None, user="postgres", password=db["PASSWORD"], dbname=db["NAME"]
    ) as conn:
        if replica:
            conn.execute("SET session_replication_role = replica")
        conn.execute(sql, params)


@pytest.mark.django_db(transaction=True)
def test_a_corrupted_cached_balance_alerts_staff_and_blocks_launches_until_resolved(
    settings, django_capture_on_commit_callbacks
):
    seed_prices()
    quote = price_quote(gpu_model=A100, profile="whole")
    admin = user_create(username="ops", email="ops@example.org", password="a-long-pass-phrase-9")
    admin.is_staff = True
    admin.language = "zh-hans"
    admin.save()
    student = user_create(username="stu", email="", password="a-long-pass-phrase-9")
    fund(student.account, 20_000_000)
    account_can_launch(account=student.account, quote=quote, gpu_model=A100)
    assert ledger_reconcile() == []
    wallet = wallet_for(account=student.account)
    _superuser_sql("UPDATE billing_ledgeraccount SET balance_micros = 900000000 WHERE id = %s", [wallet.id])

    with django_capture_on_commit_callbacks(execute=True):
        assert ledger_reconcile_task() == 1
    hold = LedgerHold.objects.get()
    assert hold.kind == "balance" and hold.account_id == student.account_id
    assert hold.detail["cached_micros"] == 900_000_000 and hold.detail["entries_micros"] == 20_000_000
    alert = Notice.objects.get(user=admin, kind="ledger_hold")
    assert "stu" in alert.message and f"#{hold.id}" in alert.message
    assert len(mail.outbox) == 1 and mail.outbox[0].to == ["ops@example.org"]
    assert "账本" in mail.outbox[0].body  # in the staff member's language
    with pytest.raises(Conflict) as blocked:
        account_can_launch(account=student.account, quote=quote, gpu_model=A100)
    assert blocked.value.code == "account_on_hold"
    scrape = Client().get("/metrics").content.decode()
    assert 'suanli_ledger_holds_open{kind="balance"} 1.0' in scrape
    assert Client(REMOTE_ADDR="10.0.0.9").get("/metrics").status_code == 403

    with django_capture_on_commit_callbacks(execute=True):
        assert ledger_reconcile() == []  # one open hold per problem: no second alert
    assert len(mail.outbox) == 1
    with pytest.raises(ValidationFailed):
        ledger_hold_resolve(hold=hold, actor=admin, resolution=" ")
    ledger_hold_resolve(hold=hold, actor=admin, resolution="cache edited by hand; rebuilt", rebuild=True)
    wallet.refresh_from_db()
    assert wallet.balance_micros == 20_000_000
    assert ledger_findings() == []
    account_can_launch(account=student.account, quote=quote, gpu_model=A100)
    assert 'suanli_ledger_holds_open{kind="balance"} 0.0' in Client().get("/metrics").content.decode()
    assert set(AuditEntry.objects.values_list("action", flat=True)) >= {
        "ledger_hold.resolve",
        "ledger_account.rebuild",
    }
    with pytest.raises(Conflict):
        ledger_hold_resolve(hold=hold, actor=admin, resolution="again")


@pytest.mark.django_db(transaction=True)
def test_reconciliation_finds_a_unit_that_does_not_balance_and_a_one_legged_transfer():
    account = make_account()
    fund(account, 1_000_000)
    transfer = Transfer.objects.get()
    wallet = wallet_for(account=account)
    # a bad restore: the trigger is bypassed the way only a superuser can (replica mode skips triggers)
    _superuser_sql(
        "DELETE FROM billing_entry WHERE transfer_id = %s AND account_id <> %s",
        [transfer.id, wallet.id],
        replica=True,
    )
    kinds = {(f.kind, f.subject) for f in ledger_findings()}
    assert ("unit", "unit:CNY") in kinds
    assert ("transfer", f"transfer:{transfer.id}") in kinds
    assert any(kind == "balance" for kind, _ in kinds)  # the system side's cache no longer matches
    ledger_reconcile()
    # a system ledger account's mismatch blocks no customer
    assert not LedgerHold.objects.filter(account=account).exists()
