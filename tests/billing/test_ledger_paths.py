"""The ledger's two write paths agree: any sequence of legs posted one by one through ``transfer_post``
(the ORM path) and all at once through ``transfers_post_many`` (the set-based path the metering tick
uses), each on its own fresh accounts, writes the same transfers, entries and balances, refuses the
same sequences, and posts a replayed idempotency key once."""

from __future__ import annotations

import itertools
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from django.db import connection
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from billing.models import CARD_UNIT, Entry, LedgerAccount, Transfer
from billing.services.ledger import Leg, money_unit, transfer_post, transfers_post_many
from core.errors import ApplicationError, InsufficientFunds, ValidationFailed
from tests.billing.conftest import assert_ledger_invariants, make_account

Kind = LedgerAccount.Kind

# The roles of one fresh set of ledger accounts: the floors (wallet, card), the ceiling (overdraft)
# and unbounded sources and sinks, in both units. All are owned by one account, so each example gets
# its own set (a system account is one per unit for the whole database).
ROLES = [
    (Kind.WALLET, "money"),
    (Kind.OVERDRAFT, "money"),
    (Kind.PROMOTIONS, "money"),
    (Kind.REVENUE, "money"),
    (Kind.CARD, CARD_UNIT),
    (Kind.PROMOTIONS, CARD_UNIT),
    (Kind.CARD_BURN, CARD_UNIT),
]
# (debit role, credit role, transfer kind, amount scale): every pair in one unit; funding is drawn
# larger and more often, so that most sequences post and some run a floor or the ceiling dry
PAIRS = [
    (2, 0, Transfer.Kind.PROMOTION, 10),
    (2, 0, Transfer.Kind.PROMOTION, 10),
    (0, 3, Transfer.Kind.USAGE, 1),
    (1, 3, Transfer.Kind.USAGE, 1),
    (0, 1, Transfer.Kind.OVERDRAFT_RECOVERY, 1),
    (3, 2, Transfer.Kind.ADJUSTMENT, 1),
    (5, 4, Transfer.Kind.CARD_ISSUE, 10),
    (5, 4, Transfer.Kind.CARD_ISSUE, 10),
    (4, 6, Transfer.Kind.CARD_BURN, 1),
]

_examples = itertools.count()

legs_strategy = st.lists(
    st.tuples(
        st.integers(0, 11),  # the key: a small range, so keys repeat within a batch
        st.sampled_from(PAIRS),
        st.integers(1, 5_000_000),
        # memos the set-based path must carry through its array literals unchanged
        st.sampled_from(["", "memo", 'a "quoted", {braced} back\\slash', "NULL", "账单 ünï"]),
    ),
    min_size=1,
    max_size=25,
)


def _accounts() -> list[LedgerAccount]:
    owner = make_account()
    return [
        LedgerAccount.objects.create(kind=kind, unit=money_unit() if unit == "money" else unit, owner=owner)
        for kind, unit in ROLES
    ]


def _legs(drawn, accounts: list[LedgerAccount], prefix: str) -> list[Leg]:
    return [
        Leg(
            debit_id=accounts[debit].id,
            credit_id=accounts[credit].id,
            amount_micros=amount * scale,
            kind=kind,
            idempotency_key=f"{prefix}:{key}",
            memo=memo,
        )
        for key, (debit, credit, kind, scale), amount, memo in drawn
    ]


def _orm_post(legs: list[Leg]) -> tuple[list[int], ApplicationError | None]:
    """Each leg through ``transfer_post``: the transfer ids returned, and the first refusal."""
    ids, refused = [], None
    for leg in legs:
        try:
            transfer = transfer_post(
                debit=LedgerAccount.objects.get(id=leg.debit_id),
                credit=LedgerAccount.objects.get(id=leg.credit_id),
                amount_micros=leg.amount_micros,
                kind=leg.kind,
                idempotency_key=leg.idempotency_key,
                memo=leg.memo,
            )
            ids.append(transfer.id)
        except ApplicationError as exc:
            refused = refused or exc
    return ids, refused


def _ledger(accounts: list[LedgerAccount], prefix: str) -> dict:
    """What the ledger holds for these accounts, by role and key (not by id), so two sets compare."""
    role = {la.id: n for n, la in enumerate(accounts)}
    transfers = Transfer.objects.filter(idempotency_key__startswith=f"{prefix}:").order_by("id")
    entries = Entry.objects.filter(account_id__in=role).select_related("transfer").order_by("id")
    return {
        "transfers": [
            (
                t.idempotency_key.removeprefix(prefix),
                role[t.debit_id],
                role[t.credit_id],
                t.amount_micros,
                t.unit,
                t.kind,
                t.memo,
            )
            for t in transfers
        ],
        "entries": [
            (
                e.transfer.idempotency_key.removeprefix(prefix),
                role[e.account_id],
                e.amount_micros,
                e.balance_after_micros,
            )
            for e in entries
        ],
        "balances": [LedgerAccount.objects.get(id=la.id).balance_micros for la in accounts],
    }


@pytest.mark.django_db
@settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(drawn=legs_strategy)
def test_one_by_one_and_set_based_posting_write_the_same_ledger(drawn):
    n = next(_examples)
    orm_accounts, bulk_accounts = _accounts(), _accounts()
    orm_legs = _legs(drawn, orm_accounts, f"orm{n}")
    bulk_legs = _legs(drawn, bulk_accounts, f"bulk{n}")

    orm_ids, refused = _orm_post(orm_legs)
    event("refused" if refused else "posted")
    if refused is not None:
        # one by one, the legs before the first refusal post; all at once, the batch posts nothing
        with pytest.raises(type(refused)):
            transfers_post_many(legs=bulk_legs)
        assert _ledger(bulk_accounts, f"bulk{n}")["transfers"] == []
        assert all(b == 0 for b in _ledger(bulk_accounts, f"bulk{n}")["balances"])
        return

    bulk_ids = transfers_post_many(legs=bulk_legs)
    orm, bulk = _ledger(orm_accounts, f"orm{n}"), _ledger(bulk_accounts, f"bulk{n}")
    assert orm == bulk
    assert len(bulk_ids) == len(bulk["transfers"]) == len({key for key, *_ in drawn})
    orm_transfers = Transfer.objects.filter(idempotency_key__startswith=f"orm{n}:")
    assert set(orm_ids) == set(orm_transfers.values_list("id", flat=True))

    # the whole sequence again: every key is a replay, so neither path moves anything
    assert _orm_post(orm_legs) == (orm_ids, None)
    assert transfers_post_many(legs=bulk_legs) == []
    assert _ledger(orm_accounts, f"orm{n}") == orm
    assert _ledger(bulk_accounts, f"bulk{n}") == bulk
    assert_ledger_invariants()


@pytest.mark.django_db
def test_set_based_posting_refuses_a_unit_mismatch_and_writes_nothing():
    wallet, _, _, _, card, _, _ = _accounts()
    source = LedgerAccount.objects.create(kind=Kind.PROMOTIONS, unit=money_unit(), owner=wallet.owner)
    legs = [
        Leg(source.id, wallet.id, 5, Transfer.Kind.PROMOTION, "mismatch:1"),
        Leg(wallet.id, card.id, 5, Transfer.Kind.ADJUSTMENT, "mismatch:2"),
    ]
    with pytest.raises(ValidationFailed):
        transfers_post_many(legs=legs)
    assert not Transfer.objects.filter(idempotency_key__startswith="mismatch:").exists()
    wallet.refresh_from_db()
    assert wallet.balance_micros == 0


@pytest.mark.django_db
def test_set_based_posting_refuses_a_wallet_below_zero_and_writes_nothing():
    wallet, _, source, revenue, *_ = _accounts()
    legs = [
        Leg(source.id, wallet.id, 5, Transfer.Kind.PROMOTION, "floor:1"),
        Leg(wallet.id, revenue.id, 6, Transfer.Kind.USAGE, "floor:2"),
    ]
    with pytest.raises(InsufficientFunds):
        transfers_post_many(legs=legs)
    assert not Transfer.objects.filter(idempotency_key__startswith="floor:").exists()
    assert [LedgerAccount.objects.get(id=la.id).balance_micros for la in (wallet, source)] == [0, 0]


@pytest.mark.django_db(transaction=True)
def test_one_key_posted_set_based_from_ten_threads_at_once_moves_money_once():
    wallet, _, source, *_ = _accounts()
    barrier = threading.Barrier(10)

    def post(i: int) -> list[int]:
        barrier.wait()
        try:
            return transfers_post_many(
                legs=[Leg(source.id, wallet.id, 7, Transfer.Kind.PROMOTION, "race:1", memo=str(i))]
            )
        finally:
            connection.close()

    with ThreadPoolExecutor(10) as pool:
        results = list(pool.map(post, range(10)))
    assert sorted(len(r) for r in results) == [0] * 9 + [1]
    wallet.refresh_from_db()
    assert wallet.balance_micros == 7
    assert Transfer.objects.filter(idempotency_key="race:1").count() == 1
    assert_ledger_invariants()
