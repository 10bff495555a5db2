"""The double-entry ledger: every balance change is one transfer with an idempotency key.

Two ways in: the ORM one for a few transfers at a time (``transfer_post``; ``post_legs_locked`` for a
caller that took the locks and checked the keys) and ``transfers_post_many`` for thousands at once
(the metering tick). Given the same legs they write the same transfers, entries and balances and
refuse the same way (``tests/billing/test_ledger_paths.py``). No other module writes
``billing_transfer``, ``billing_entry`` or a cached balance.

Locks: the two ledger accounts of a transfer are locked with ``select_for_update`` in id order, so
concurrent transfers never deadlock. A replayed idempotency key returns the first transfer and moves
nothing, also when the two attempts race (the key is checked again under the locks, and the unique
constraint catches the rest).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import psycopg
from django.conf import settings
from django.db import IntegrityError, connection, transaction
from django.utils.translation import gettext as _

from billing.audit import audit_record
from billing.models import Account, Entry, LedgerAccount, Transfer
from core.errors import InsufficientFunds, ValidationFailed

IDEMPOTENCY_KEY_RE = re.compile(r"^[\x21-\x7e]{1,200}$")


def idempotency_key_check(key: str | None) -> None:
    """Raise ValidationFailed unless ``key`` (a client's Idempotency-Key, or None) is 1-200 printable
    ASCII characters."""
    if key is not None and not IDEMPOTENCY_KEY_RE.match(key):
        raise ValidationFailed(
            _("A bad Idempotency-Key."), fields={"idempotency_key": "1-200 printable characters"}
        )


Kind = LedgerAccount.Kind


def money_unit() -> str:
    return settings.SITE_CURRENCY


def system_account(*, kind: str, unit: str | None = None) -> LedgerAccount:
    """The one system ledger account of ``kind`` in ``unit`` (created on first use)."""
    unit = unit or money_unit()
    found = LedgerAccount.objects.filter(kind=kind, unit=unit, owner__isnull=True).first()
    if found:
        return found
    try:
        with transaction.atomic():
            return LedgerAccount.objects.create(kind=kind, unit=unit, owner=None)
    except IntegrityError:
        return LedgerAccount.objects.get(kind=kind, unit=unit, owner__isnull=True)


def owned_account(*, account: Account, kind: str) -> LedgerAccount:
    """The account's wallet or overdraft in the site currency (created on first use)."""
    unit = money_unit()
    found = LedgerAccount.objects.filter(kind=kind, unit=unit, owner=account).first()
    if found:
        return found
    try:
        with transaction.atomic():
            return LedgerAccount.objects.create(kind=kind, unit=unit, owner=account)
    except IntegrityError:
        return LedgerAccount.objects.get(kind=kind, unit=unit, owner=account)


def wallet_for(*, account: Account) -> LedgerAccount:
    return owned_account(account=account, kind=Kind.WALLET)


def overdraft_for(*, account: Account) -> LedgerAccount:
    return owned_account(account=account, kind=Kind.OVERDRAFT)


@dataclass(frozen=True)
class Leg:
    """One transfer to post: ``amount_micros`` from ``debit_id`` to ``credit_id``, once per
    ``idempotency_key``."""

    debit_id: int
    credit_id: int
    amount_micros: int
    kind: str
    idempotency_key: str
    memo: str = ""
    meter_id: int | None = None


def lock_accounts(ids: set[int] | list[int]) -> dict[int, LedgerAccount]:
    """Lock ledger accounts in id order (the one lock order of the ledger). Call inside a transaction."""
    return {
        la.id: la for la in LedgerAccount.objects.select_for_update().filter(id__in=set(ids)).order_by("id")
    }


def _check_amount(amount_micros: object) -> int:
    if isinstance(amount_micros, bool) or not isinstance(amount_micros, int):
        raise ValidationFailed(
            _("The amount must be a whole number of micro-units."), fields={"amount_micros": "not an integer"}
        )
    if amount_micros <= 0:
        raise ValidationFailed(
            _("The amount must be more than zero."), fields={"amount_micros": "must be > 0"}
        )
    return amount_micros


def post_legs_locked(*, legs: list[Leg], locked: dict[int, LedgerAccount], actor=None) -> list[Transfer]:
    """Post ``legs`` on already locked accounts (see ``lock_accounts``), in order; skip zero amounts.

    Raises InsufficientFunds when a wallet or card would go below zero (nothing is saved: the caller's
    transaction rolls back), ValidationFailed when the two sides are in different units.
    """
    transfers: list[Transfer] = []
    entries: list[Entry] = []
    touched: dict[int, LedgerAccount] = {}
    for leg in legs:
        if leg.amount_micros == 0:
            continue
        _check_amount(leg.amount_micros)
        debit, credit = locked[leg.debit_id], locked[leg.credit_id]
        if debit.unit != credit.unit:
            raise ValidationFailed("The two sides of a transfer must be in the same unit.")
        if debit.kind in LedgerAccount.FLOOR_ZERO and debit.balance_micros < leg.amount_micros:
            raise InsufficientFunds(_("Not enough funds for this transfer."))
        if credit.kind in LedgerAccount.CEILING_ZERO and credit.balance_micros + leg.amount_micros > 0:
            raise ValidationFailed("An overdraft cannot be paid back beyond zero.")
        debit.balance_micros -= leg.amount_micros
        credit.balance_micros += leg.amount_micros
        transfer = Transfer(
            debit=debit,
            credit=credit,
            amount_micros=leg.amount_micros,
            unit=debit.unit,
            kind=leg.kind,
            memo=leg.memo[:200],
            actor=actor if getattr(actor, "pk", None) else None,
            meter_id=leg.meter_id,
            idempotency_key=leg.idempotency_key,
        )
        transfers.append(transfer)
        entries.append(
            Entry(
                transfer=transfer,
                account=debit,
                amount_micros=-leg.amount_micros,
                balance_after_micros=debit.balance_micros,
            )
        )
        entries.append(
            Entry(
                transfer=transfer,
                account=credit,
                amount_micros=leg.amount_micros,
                balance_after_micros=credit.balance_micros,
            )
        )
        touched[debit.id] = debit
        touched[credit.id] = credit
    if not transfers:
        return []
    Transfer.objects.bulk_create(transfers)
    Entry.objects.bulk_create(entries)
    for la in touched.values():
        la.version += 1
    LedgerAccount.objects.bulk_update(list(touched.values()), ["balance_micros", "version"])
    return transfers


def bulk_cursor() -> psycopg.Cursor:
    """A cursor on the current connection and transaction with server-side parameter binding: Django's
    default client-side binding quotes every element of a 10,000-long array parameter in Python."""
    connection.ensure_connection()
    return psycopg.Cursor(connection.connection)


def bigint_array(values: Iterable[int | None]) -> str:
    """``values`` as a PostgreSQL array literal for a ``%s::bigint[]`` parameter of ``bulk_cursor``:
    psycopg dumps a list in Python, element by element (about 2 µs each: tens of milliseconds per
    metering tick at 10,000 sessions); the literal is one join."""
    return "{" + ",".join("NULL" if v is None else str(int(v)) for v in values) + "}"


def text_array(values: Iterable[str]) -> str:
    """``values`` as a PostgreSQL array literal for a ``%s::text[]`` parameter (see ``bigint_array``):
    every element double-quoted, its backslashes and double quotes escaped."""
    return "{" + ",".join('"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"' for v in values) + "}"


def transfers_post_many(*, legs: Sequence[Leg]) -> list[int]:
    """Post ``legs`` in order with a few set-based statements; return the ids of the transfers written.

    The same outcome as ``transfer_post`` on each leg in turn: a leg whose idempotency key is already in
    the ledger, or earlier in ``legs``, posts nothing (a concurrent transaction that holds the key is
    waited for); zero amounts are skipped; every other leg writes one transfer, its two entries with
    running balances, and the cached balances (``version`` goes up once per account per call). Locks
    every ledger account of ``legs`` in id order (``FOR UPDATE``; the caller may already hold them, as
    the metering tick does). Raises ValidationFailed (a bad amount or key, an unknown account, a unit
    mismatch, an overdraft paid back beyond zero) and InsufficientFunds (a wallet or card below zero);
    then nothing of ``legs`` is written.
    """
    todo = _legs_to_post(legs)
    if not todo:
        return []
    # wrap_database_errors: the raw cursor's errors reach callers as Django's (IntegrityError, …)
    with transaction.atomic(), connection.wrap_database_errors, bulk_cursor() as cursor:
        kind, unit, running = _ledger_accounts_lock(cursor, todo)
        written = _transfers_insert(cursor, todo, unit)
        if not written:
            return []
        entries, touched = _entries_of(todo, written, kind, running)
        cursor.execute(
            """
            INSERT INTO billing_entry (transfer_id, account_id, amount_micros, balance_after_micros)
            SELECT * FROM unnest(%s::bigint[], %s::bigint[], %s::bigint[], %s::bigint[])
            """,
            [bigint_array(column) for column in entries],
        )
        ids = sorted(touched)
        cursor.execute(
            """
            UPDATE billing_ledgeraccount la SET balance_micros = v.balance, version = la.version + 1
            FROM unnest(%s::bigint[], %s::bigint[]) AS v(id, balance) WHERE la.id = v.id
            """,
            [bigint_array(ids), bigint_array(running[la_id] for la_id in ids)],
        )
    return [written[leg.idempotency_key] for leg in todo if leg.idempotency_key in written]


def _legs_to_post(legs: Sequence[Leg]) -> list[Leg]:
    """The legs that may post, in order: checked, zero amounts left out, and the first of each key."""
    first: dict[str, Leg] = {}
    for leg in legs:
        if leg.amount_micros == 0:
            continue
        _check_amount(leg.amount_micros)
        if not leg.idempotency_key:
            raise ValidationFailed("A transfer needs an idempotency key.")
        first.setdefault(leg.idempotency_key, leg)
    return list(first.values())


def _ledger_accounts_lock(cursor: psycopg.Cursor, todo: list[Leg]) -> tuple[dict, dict, dict]:
    """Lock the legs' ledger accounts in id order; their kinds, units and balances by id. Refuses a leg
    naming an unknown account or joining two units."""
    cursor.execute(
        "SELECT id, kind, unit, balance_micros FROM billing_ledgeraccount WHERE id = ANY(%s::bigint[]) "
        "ORDER BY id FOR UPDATE",
        [bigint_array(sorted({leg.debit_id for leg in todo} | {leg.credit_id for leg in todo}))],
    )
    kind, unit, running = {}, {}, {}
    for la_id, la_kind, la_unit, balance in cursor.fetchall():
        kind[la_id], unit[la_id], running[la_id] = la_kind, la_unit, balance
    for leg in todo:
        if leg.debit_id not in unit or leg.credit_id not in unit:
            raise ValidationFailed("A transfer names a ledger account that does not exist.")
        if unit[leg.debit_id] != unit[leg.credit_id]:
            raise ValidationFailed("The two sides of a transfer must be in the same unit.")
    return kind, unit, running


def _transfers_insert(cursor: psycopg.Cursor, todo: list[Leg], unit: dict) -> dict[str, int]:
    """Insert the legs' transfers in order, each key at most once (one already in the ledger, or held by
    a concurrent transaction that commits it, posts nothing); the new transfers' ids by key."""
    cursor.execute(
        """
        INSERT INTO billing_transfer (debit_id, credit_id, amount_micros, unit, kind, memo,
                                      idempotency_key, meter_id)
        SELECT d, c, a, u, k, memo, key, m
        FROM unnest(%s::bigint[], %s::bigint[], %s::bigint[], %s::text[], %s::text[], %s::text[],
                    %s::text[], %s::bigint[]) WITH ORDINALITY AS v(d, c, a, u, k, memo, key, m, n)
        ORDER BY n
        ON CONFLICT (idempotency_key) DO NOTHING
        RETURNING id, idempotency_key
        """,
        [
            bigint_array(leg.debit_id for leg in todo),
            bigint_array(leg.credit_id for leg in todo),
            bigint_array(leg.amount_micros for leg in todo),
            text_array(unit[leg.debit_id] for leg in todo),
            text_array(leg.kind for leg in todo),
            text_array(leg.memo[:200] for leg in todo),
            text_array(leg.idempotency_key for leg in todo),
            bigint_array(leg.meter_id for leg in todo),
        ],
    )
    return {key: transfer_id for transfer_id, key in cursor.fetchall()}


def _entries_of(
    todo: list[Leg], written: dict[str, int], kind: dict, running: dict
) -> tuple[list[list[int]], set[int]]:
    """The entries of the written transfers as four columns (transfer, account, amount, balance after),
    moving ``running`` on as it goes, and the accounts they touch. Refuses a wallet or card going below
    zero and an overdraft paid back beyond zero."""
    e_transfer, e_account, e_amount, e_after = [], [], [], []
    touched: set[int] = set()
    for leg in todo:
        transfer_id = written.get(leg.idempotency_key)
        if transfer_id is None:  # already in the ledger: posts nothing
            continue
        debit, credit, amount = leg.debit_id, leg.credit_id, leg.amount_micros
        if kind[debit] in LedgerAccount.FLOOR_ZERO and running[debit] < amount:
            raise InsufficientFunds(_("Not enough funds for this transfer."))
        if kind[credit] in LedgerAccount.CEILING_ZERO and running[credit] + amount > 0:
            raise ValidationFailed("An overdraft cannot be paid back beyond zero.")
        for la_id, signed in ((debit, -amount), (credit, amount)):
            running[la_id] += signed
            e_transfer.append(transfer_id)
            e_account.append(la_id)
            e_amount.append(signed)
            e_after.append(running[la_id])
        touched |= {debit, credit}
    return [e_transfer, e_account, e_amount, e_after], touched


def transfer_post(
    *,
    debit: LedgerAccount,
    credit: LedgerAccount,
    amount_micros: int,
    kind: str,
    idempotency_key: str,
    memo: str = "",
    actor=None,
) -> Transfer:
    """Move ``amount_micros`` from ``debit`` to ``credit`` exactly once per ``idempotency_key``.

    Locks both ledger accounts (id order). Replaying the key returns the original transfer and moves
    nothing. Raises ValidationFailed (bad amount, unit mismatch), InsufficientFunds (a wallet or card
    would go below zero).
    """
    _check_amount(amount_micros)
    if not idempotency_key:
        raise ValidationFailed("A transfer needs an idempotency key.")
    existing = Transfer.objects.filter(idempotency_key=idempotency_key).first()
    if existing:
        return existing
    try:
        with transaction.atomic():
            locked = lock_accounts([debit.id, credit.id])
            existing = Transfer.objects.filter(idempotency_key=idempotency_key).first()
            if existing:
                return existing
            leg = Leg(debit.id, credit.id, amount_micros, kind, idempotency_key, memo)
            (transfer,) = post_legs_locked(legs=[leg], locked=locked, actor=actor)
    except IntegrityError:
        existing = Transfer.objects.filter(idempotency_key=idempotency_key).first()
        if existing is None:
            raise
        return existing
    debit.refresh_from_db(fields=["balance_micros", "version"])
    credit.refresh_from_db(fields=["balance_micros", "version"])
    return transfer


def wallet_adjust(
    *, account: Account, amount_micros: int, actor, reason: str, idempotency_key: str
) -> Transfer:
    """An admin's correction of a wallet: positive credits it, negative debits it (not below zero).

    Needs a reason; writes an audit row in the same transaction. Idempotent by key. Raises
    ValidationFailed (no reason, zero or non-integer amount), InsufficientFunds.
    """
    if not (reason or "").strip():
        raise ValidationFailed(_("An adjustment needs a reason."), fields={"reason": "required"})
    if isinstance(amount_micros, bool) or not isinstance(amount_micros, int) or amount_micros == 0:
        raise ValidationFailed(_("The adjustment must be a non-zero whole number of micro-units."))
    wallet = wallet_for(account=account)
    pool = system_account(kind=Kind.ADJUSTMENTS)
    debit, credit = (pool, wallet) if amount_micros > 0 else (wallet, pool)
    key = f"adjust:{idempotency_key}"
    with transaction.atomic():
        locked = lock_accounts([wallet.id, pool.id])
        existing = Transfer.objects.filter(idempotency_key=key).first()
        if existing:
            return existing
        before = locked[wallet.id].balance_micros
        (transfer,) = post_legs_locked(
            legs=[Leg(debit.id, credit.id, abs(amount_micros), Transfer.Kind.ADJUSTMENT, key, reason[:200])],
            locked=locked,
            actor=actor,
        )
        audit_record(
            actor=actor,
            action="wallet.adjust",
            target=wallet,
            before={"balance_micros": before},
            after={"balance_micros": locked[wallet.id].balance_micros},
            reason=reason,
        )
    return transfer


def overdraft_recover_locked(
    *, account_id: int, locked: dict[int, LedgerAccount], key: str
) -> Transfer | None:
    """Pay the account's overdraft back from its wallet as far as the wallet allows (accounts locked)."""
    wallet = next(la for la in locked.values() if la.owner_id == account_id and la.kind == Kind.WALLET)
    overdraft = next(la for la in locked.values() if la.owner_id == account_id and la.kind == Kind.OVERDRAFT)
    amount = min(wallet.balance_micros, -overdraft.balance_micros)
    if amount <= 0:
        return None
    legs = [
        Leg(wallet.id, overdraft.id, amount, Transfer.Kind.OVERDRAFT_RECOVERY, key, "overdraft recovered")
    ]
    return post_legs_locked(legs=legs, locked=locked)[0]
