"""Metering: per-second billing of running sessions from the database clock.

A meter bills whole seconds from ``started_at`` up to min(now, ``alive_until``) (the last time the
agent confirmed the workload alive), computed when read (``billing.models.AccruedNow``): the tick
writes only the meters due for a posting (at most one per meter per
``BILLING_POSTING_INTERVAL_SECONDS``, found through an index), and posts them in bulk through
``ledger.transfers_post_many``: cards burn first (cards restricted to the
session's GPU model, then earliest expiry, then oldest), then the wallet, and any overshoot goes to
the account's overdraft. Watermarks and postings commit in one transaction, and every posting's
idempotency key is derived from the meter id and its watermark, so a worker killed halfway loses
and repeats nothing.

Lock order: meters (id order, ``SKIP LOCKED`` in the tick, so it never waits on a meter), then ledger
accounts (id order). One tick runs at a time (a transaction-scoped advisory lock).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import psycopg
from django.conf import settings
from django.db import connection, transaction
from django.db.models import Sum
from django.utils.translation import gettext as _

from billing import signals
from billing.models import (
    CARD_UNIT,
    Account,
    AccruedNow,
    BilledNow,
    LedgerAccount,
    Meter,
    Transfer,
    accrued_now_sql,
    billed_now_sql,
)
from billing.selectors import account_funds
from billing.services.ledger import (
    Leg,
    bigint_array,
    bulk_cursor,
    money_unit,
    overdraft_for,
    system_account,
    text_array,
    transfers_post_many,
    wallet_for,
)
from billing.services.pricing import PriceQuote
from billing.services.reconcile import account_hold_check
from core.clock import db_now
from core.compiled import Lookup
from core.errors import Conflict, InsufficientFunds, NotFound, ValidationFailed

TICK_LOCK_KEY = 0x5A11B111  # pg advisory lock: one metering tick at a time
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


@dataclass(frozen=True)
class MeterCost:
    charged_micros: int  # money posted (wallet + overdraft)
    accrued_micros: int  # money-equivalent of seconds billed but not yet posted
    card_micros: int  # card-hour micros burned from cards
    wallet_micros: int  # money from the wallet
    overdraft_micros: int  # money that went to the overdraft
    billed_seconds: int


@dataclass(frozen=True)
class TickResult:
    posted_meters: int  # meters posted (their watermark moved; the others are read live)
    transfers: int
    exhausted_session_refs: list[str]


def _cost(rate_per_hour: int, seconds: int) -> int:
    return rate_per_hour * seconds // 3600


# --- the interface the provisioner calls --------------------------------------------------------------


def account_can_launch(*, account: Account, quote: PriceQuote, gpu_model: str) -> None:
    """Raise Conflict while a reconciliation hold is open on the account, InsufficientFunds while it
    owes money (an overdraft its wallet does not cover), and InsufficientFunds unless cards usable for
    ``gpu_model`` plus the wallet cover
    ``BILLING_ADMISSION_MINUTES`` at ``quote`` (accruals not yet posted count as spent). Reads only."""
    account_hold_check(account=account)
    funds = account_funds(account=account, gpu_model=gpu_model)
    if funds.overdraft_micros < 0 and funds.wallet_micros + funds.overdraft_micros < 0:
        owed = -(funds.wallet_micros + funds.overdraft_micros)
        raise InsufficientFunds(
            _(
                "This account owes %(amount)s %(unit)s (a refund, a dispute or usage past its funds); "
                "top up to cover it before launching."
            )
            % {"amount": f"{owed / 1_000_000:.2f}", "unit": money_unit()},
            code="account_owes",
        )
    need_seconds = settings.BILLING_ADMISSION_MINUTES * 60
    if quote.price_micros_per_hour == 0:
        return
    card_seconds = (
        funds.cards_micros * 3600 // quote.card_burn_micros_per_hour if quote.card_burn_micros_per_hour else 0
    )
    money = funds.money_micros - funds.accrued_micros
    wallet_seconds = money * 3600 // quote.price_micros_per_hour if money > 0 else 0
    if card_seconds + wallet_seconds < need_seconds:
        raise InsufficientFunds(
            _(
                "Not enough funds: this launch needs at least %(minutes)s minutes of credit on a compute "
                "card or in the wallet."
            )
            % {"minutes": settings.BILLING_ADMISSION_MINUTES}
        )


def meter_open(
    *,
    account: Account,
    session_ref: str,
    gpu_model: str,
    profile: str,
    quote: PriceQuote,
    started_at: datetime,
) -> Meter:
    """Open the meter of one session at ``quote``'s price; billing starts at ``started_at`` but goes no
    further than the agent's last ``meter_alive``. Idempotent by ``session_ref`` (a second call returns
    the first meter); raises Conflict when that ref already belongs to another account."""
    if not session_ref:
        raise ValidationFailed("A meter needs a session reference.")
    wallet_for(account=account)
    overdraft_for(account=account)
    with transaction.atomic():
        meter, created = Meter.objects.get_or_create(
            session_ref=session_ref,
            defaults={
                "account": account,
                "gpu_model": gpu_model,
                "profile": profile,
                "price_id": quote.price_id,
                "price_micros_per_hour": quote.price_micros_per_hour,
                "card_burn_micros_per_hour": quote.card_burn_micros_per_hour,
                "started_at": started_at,
                "alive_until": started_at,
                "billed_until": started_at,
            },
        )
    if not created and meter.account_id != account.id:
        raise Conflict("This session is metered on another account.")
    return meter


def meter_alive(*, session_refs: list[str], alive_at: datetime) -> int:
    """Extend the billable window of these open meters to ``alive_at`` (never backwards). Locks the meters
    in id order. Returns how many moved."""
    if not session_refs:
        return 0
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(
            """
            WITH target AS (
                SELECT id FROM billing_meter
                WHERE session_ref = ANY(%s) AND state = 'open' AND alive_until < %s
                ORDER BY id FOR UPDATE
            )
            UPDATE billing_meter m SET alive_until = %s FROM target WHERE m.id = target.id
            """,
            [list(session_refs), alive_at, alive_at],
        )
        return cursor.rowcount


def meter_close(*, session_ref: str, ended_at: datetime) -> Meter:
    """Bill the session up to min(``ended_at``, last alive) and post everything still accrued; close it.

    Idempotent: closing a closed meter returns it unchanged. Locks the meter, then its ledger accounts.
    Raises NotFound for an unknown ref.
    """
    with transaction.atomic():
        meter = Meter.objects.select_for_update().filter(session_ref=session_ref).first()
        if meter is None:
            raise NotFound("No such meter.")
        if meter.state == Meter.State.CLOSED:
            return meter
        end = max(min(ended_at, meter.alive_until), meter.started_at)
        meter.billed_seconds = max(meter.billed_seconds, int((end - meter.started_at).total_seconds()))
        meter.billed_until = meter.started_at + timedelta(seconds=meter.billed_seconds)
        meter.state = Meter.State.CLOSED
        meter.ended_at = ended_at
        meter.save(update_fields=["billed_seconds", "billed_until", "state", "ended_at"])
        _post([_row(meter)], now=db_now())
        meter.refresh_from_db()
    return meter


def meter_cost(*, session_ref: str) -> MeterCost:
    """What a session has cost so far, split by source. Reads only; raises NotFound."""
    cost = meter_costs(session_refs=[session_ref]).get(session_ref)
    if cost is None:
        raise NotFound("No such meter.")
    return cost


def _costs(meters):
    return meters.annotate(billed_now=BilledNow(), accrued_now=AccruedNow())


def _paid(transfers):
    return transfers.values_list("meter_id", "debit__kind").annotate(total=Sum("amount_micros"))


# The cost of a page's sessions (one session's page, every answer of the sessions API, the dashboard):
# compiled once per process, for any number of sessions.
_COSTS_OF = Lookup(
    lambda refs: _costs(Meter.objects.filter(session_ref__any=refs)), key_types=(list,), many=True
)
_PAID_BY = Lookup(
    lambda meter_ids: _paid(Transfer.objects.filter(meter_id__any=meter_ids)), key_types=(list,), many=True
)


def meter_costs(*, session_refs: list[str]) -> dict[str, MeterCost]:
    """``meter_cost`` of many sessions in two queries, whatever their number (one when none of them
    was metered, none when there are none); a session never metered (it has not run) is left out.
    Reads only."""
    refs = sorted({str(ref) for ref in session_refs})
    meters = {m.id: m for m in _COSTS_OF.all(refs)} if refs else {}
    by_kind = {meter_id: {"card": 0, "wallet": 0, "overdraft": 0} for meter_id in meters}
    if meters:
        for meter_id, kind, total in _PAID_BY.all(sorted(meters)):
            by_kind[meter_id][kind] += total
    return {
        meter.session_ref: MeterCost(
            charged_micros=meter.charged_micros,
            accrued_micros=meter.accrued_now,
            card_micros=by_kind[meter.id]["card"],
            wallet_micros=by_kind[meter.id]["wallet"],
            overdraft_micros=by_kind[meter.id]["overdraft"],
            billed_seconds=meter.billed_now,
        )
        for meter in meters.values()
    }


# --- the tick -----------------------------------------------------------------------------------------

# The meters due for a posting (last posted a posting interval ago, with seconds to post), locked:
# each one not locked by a concurrent close or heartbeat (SKIP LOCKED: the tick never waits on a
# meter, so it needs no lock order among them), with its whole seconds up to min(now, alive). Found
# through the index on when each open meter was last posted; the others are not read.
_DUE_SQL = f"""
SELECT id, account_id, gpu_model, price_micros_per_hour, card_burn_micros_per_hour, billed_seconds,
       posted_seconds, card_seconds, wallet_seconds
FROM (
    SELECT id, account_id, gpu_model, price_micros_per_hour, card_burn_micros_per_hour, posted_seconds,
           card_seconds, wallet_seconds,
           {billed_now_sql("%(now)s")} AS billed_seconds
    FROM billing_meter
    WHERE state = 'open'
      AND COALESCE(last_posted_at, started_at) <= %(now)s - make_interval(secs => %(interval)s)
    ORDER BY id FOR UPDATE SKIP LOCKED
) due
WHERE billed_seconds > posted_seconds
ORDER BY id
"""  # noqa: S608 (no input in the f-string: billing.models' SQL for seconds billed as of now)

# The runway of the accounts the tick checks, in one statement: those it posted for, those told their
# runway is short or gone (every tick, so that the end of their funds is seen at once), and those with
# a meter not posted yet (a launch: its burn is new). The others had more than the warning at their
# last posting, at most a posting interval ago, and are warned that much ahead (``_signal_runway``).
# Funds taken away at once (a refund, a dispute, a revoked card) are seen at the account's next
# posting, within the interval; the overdraft takes the rest. Accruals are computed as of now. The
# session refs are gathered only for the few accounts this tick signals.
RUNWAY_CHECKED_SQL = """
    SELECT unnest(%(posted)s::bigint[]) AS account_id
    UNION
    SELECT account_id FROM billing_meter
    WHERE state = 'open'
      AND (runway_warned_at IS NOT NULL OR exhausted_at IS NOT NULL OR last_posted_at IS NULL)
"""  # the accounts a tick checks: those it posted for (``posted``) and those it watches (an index)
_RUNWAY_SQL = f"""
WITH checked AS ({RUNWAY_CHECKED_SQL}), om AS (
    SELECT account_id, sum(price_micros_per_hour) AS price, sum(card_burn_micros_per_hour) AS burn,
           sum({accrued_now_sql("%(now)s")}) AS accrued,
           array_agg(DISTINCT gpu_model) AS models,
           bool_or(runway_warned_at IS NULL) AS unwarned, bool_or(runway_warned_at IS NOT NULL) AS warned,
           bool_or(exhausted_at IS NULL OR exhausted_at <= %(now)s - interval '60 seconds') AS unsignalled
    FROM billing_meter WHERE state = 'open' AND account_id IN (SELECT account_id FROM checked)
    GROUP BY account_id HAVING sum(price_micros_per_hour) > 0
), money AS (
    SELECT la.owner_id AS account_id, sum(la.balance_micros) AS money
    FROM billing_ledgeraccount la JOIN om ON om.account_id = la.owner_id
    WHERE la.kind IN ('wallet', 'overdraft') AND la.unit = %(unit)s
    GROUP BY la.owner_id
), cards AS (
    SELECT la.owner_id AS account_id, sum(la.balance_micros) AS cards
    FROM billing_ledgeraccount la
    JOIN om ON om.account_id = la.owner_id
    JOIN billing_card c ON c.ledger_account_id = la.id
    WHERE la.kind = 'card' AND la.balance_micros > 0 AND c.state = 'active'
      AND (c.expires_at IS NULL OR c.expires_at > %(now)s)
      AND (c.gpu_models = '[]'::jsonb OR c.gpu_models ?| om.models)
    GROUP BY la.owner_id
), runway AS (
    SELECT om.account_id, om.unwarned, om.warned, om.unsignalled,
           (CASE WHEN om.burn > 0 THEN COALESCE(cards.cards, 0) * 3600 / om.burn ELSE 0 END)
           + (COALESCE(money.money, 0) - om.accrued) * 3600 / om.price AS seconds
    FROM om LEFT JOIN money USING (account_id) LEFT JOIN cards USING (account_id)
), low AS MATERIALIZED (
    SELECT * FROM runway
    WHERE (seconds > 0 AND seconds <= %(warn)s AND unwarned)  -- runway_low, once
       OR (seconds <= 0 AND unsignalled)  -- funds_exhausted, at most once a minute
       OR (warned AND seconds > 2 * %(warn)s)  -- runway_recovered
)
SELECT low.account_id, array_agg(m.session_ref ORDER BY m.id), low.seconds, low.unwarned, low.unsignalled
FROM low JOIN billing_meter m ON m.account_id = low.account_id AND m.state = 'open'
GROUP BY low.account_id, low.seconds, low.unwarned, low.unsignalled
"""  # noqa: S608 (no input in the f-string: billing.models' SQL for accruals as of now)


def metering_tick(*, now: datetime | None = None) -> TickResult:
    """Post every open meter due for a posting up to ``now`` (default: the database clock), and check
    the runways of the accounts it posted for and of those already told theirs is short.

    Idempotent and safe to run from several workers: one tick at a time (advisory lock; a tick that
    finds it taken returns at once), meters locked by a concurrent ``meter_close`` are left to the next
    tick. Meters not due are not written: what they have run is computed when read (``AccruedNow``).
    Sends ``runway_low``, ``runway_recovered`` and ``funds_exhausted`` after commit.
    """
    with transaction.atomic(), bulk_cursor() as cursor:
        cursor.execute("SELECT pg_try_advisory_xact_lock(%s)", [TICK_LOCK_KEY])
        if not cursor.fetchone()[0]:
            return TickResult(0, 0, [])
        if now is None:
            cursor.execute("SELECT clock_timestamp()")
            now = cursor.fetchone()[0]
        cursor.execute(_DUE_SQL, {"now": now, "interval": float(settings.BILLING_POSTING_INTERVAL_SECONDS)})
        columns = [c.name for c in cursor.description]
        due = [dict(zip(columns, row, strict=True)) for row in cursor.fetchall()]
        transfers = _post(due, now=now) if due else 0
        exhausted = _signal_runway(cursor, now, posted_accounts={m["account_id"] for m in due})
    return TickResult(len(due), transfers, exhausted)


def _row(meter: Meter) -> dict:
    return {
        "id": meter.id,
        "account_id": meter.account_id,
        "gpu_model": meter.gpu_model,
        "price_micros_per_hour": meter.price_micros_per_hour,
        "card_burn_micros_per_hour": meter.card_burn_micros_per_hour,
        "billed_seconds": meter.billed_seconds,
        "posted_seconds": meter.posted_seconds,
        "card_seconds": meter.card_seconds,
        "wallet_seconds": meter.wallet_seconds,
    }


@dataclass
class Payers:
    """The locked ledger accounts the due meters draw on, by owner, and every balance as it moves."""

    balance: dict[int, int]  # ledger account id -> balance, moved on as legs are planned
    wallet: dict[int, int]  # account id -> its wallet's ledger account id
    overdraft: dict[int, int]  # account id -> its overdraft's ledger account id
    cards: dict[int, list[tuple]]  # account id -> (ledger account id, gpu models, expiry) of usable cards


def _post(meters: list[dict], *, now: datetime) -> int:
    """Post ``meters`` (locked by the caller) up to their ``billed_seconds``, in bulk. Returns transfers."""
    unit = money_unit()
    revenue = system_account(kind=LedgerAccount.Kind.REVENUE, unit=unit)
    burned = system_account(kind=LedgerAccount.Kind.CARD_BURN, unit=CARD_UNIT)
    with bulk_cursor() as cursor:
        payers = payers_lock(cursor, meters, system_ids=[revenue.id, burned.id], unit=unit, now=now)
        legs: list[Leg] = []
        meter_updates: list[tuple] = []
        for m in meters:
            meter_legs, update = payer_legs(m, payers, revenue_id=revenue.id, burned_id=burned.id)
            legs += meter_legs
            meter_updates.append(update)
        transfers = transfers_post_many(legs=legs)
        cursor.execute(
            """
            UPDATE billing_meter m SET billed_seconds = v.posted,
                billed_until = m.started_at + make_interval(secs => v.posted::double precision),
                posted_seconds = v.posted, card_seconds = v.card_s,
                wallet_seconds = v.wallet_s, charged_micros = v.charged, card_charged_micros = v.card_charged,
                last_posted_at = %s
            FROM unnest(%s::bigint[], %s::bigint[], %s::bigint[], %s::bigint[], %s::bigint[], %s::bigint[])
                 AS v(id, posted, card_s, wallet_s, charged, card_charged)
            WHERE m.id = v.id
            """,
            [now, *(bigint_array(column) for column in zip(*meter_updates, strict=True))],
        )
    return len(transfers)


def payers_lock(
    cursor: psycopg.Cursor, meters: list[dict], *, system_ids: list[int], unit: str, now: datetime
) -> Payers:
    """Lock, in id order, the system accounts and every wallet, overdraft and usable card of the meters'
    accounts; a wallet or overdraft that is missing is made first (meter_open makes both; a meter
    written another way gets them here)."""
    account_ids = sorted({m["account_id"] for m in meters})
    cursor.execute(
        """
        SELECT la.id, la.kind, la.owner_id, la.balance_micros,
               ARRAY(SELECT jsonb_array_elements_text(c.gpu_models)) AS models, c.expires_at
        FROM billing_ledgeraccount la LEFT JOIN billing_card c ON c.ledger_account_id = la.id
        WHERE la.id IN (
            SELECT unnest(%(system)s::bigint[])
            UNION ALL
            SELECT own.id FROM unnest(%(accounts)s::bigint[]) AS a(id)
            JOIN billing_ledgeraccount own ON own.owner_id = a.id
            WHERE (own.kind IN ('wallet', 'overdraft') AND own.unit = %(unit)s)
               OR (own.kind = 'card' AND own.balance_micros > 0)
        ) AND (la.kind <> 'card' OR (c.state = 'active' AND (c.expires_at IS NULL OR c.expires_at > %(now)s)))
        ORDER BY la.id FOR UPDATE OF la
        """,
        {"system": bigint_array(system_ids), "accounts": bigint_array(account_ids), "unit": unit, "now": now},
    )
    payers = Payers(balance={}, wallet={}, overdraft={}, cards={})
    for la_id, kind, owner_id, bal, models, expires_at in cursor.fetchall():
        payers.balance[la_id] = bal
        if kind == "wallet":
            payers.wallet[owner_id] = la_id
        elif kind == "overdraft":
            payers.overdraft[owner_id] = la_id
        elif kind == "card":
            payers.cards.setdefault(owner_id, []).append((la_id, models or [], expires_at))
    missing = [a for a in account_ids if a not in payers.wallet or a not in payers.overdraft]
    if missing:
        cursor.execute(
            """
            INSERT INTO billing_ledgeraccount (kind, owner_id, unit, balance_micros, version, created_at)
            SELECT k.kind, a.id, %s, 0, 0, now()
            FROM unnest(%s::bigint[]) AS a(id) CROSS JOIN (VALUES ('wallet'), ('overdraft')) AS k(kind)
            ON CONFLICT DO NOTHING
            """,
            [unit, bigint_array(missing)],
        )
        cursor.execute(
            "SELECT id, kind, owner_id, balance_micros FROM billing_ledgeraccount "
            "WHERE owner_id = ANY(%s::bigint[]) AND kind IN ('wallet', 'overdraft') AND unit = %s "
            "ORDER BY id FOR UPDATE",
            [bigint_array(missing), unit],
        )
        for la_id, kind, owner_id, held in cursor.fetchall():
            payers.balance[la_id] = held
            (payers.wallet if kind == "wallet" else payers.overdraft)[owner_id] = la_id
    return payers


def _leg_planned(
    balance: dict[int, int], debit_id: int, credit_id: int, amount: int, kind: str, m: dict, key: str
) -> Leg:
    """One leg of a meter's posting, with the planned balances moved on by it."""
    balance[debit_id] -= amount
    balance[credit_id] += amount
    return Leg(
        debit_id=debit_id,
        credit_id=credit_id,
        amount_micros=amount,
        kind=kind,
        idempotency_key=key,
        meter_id=m["id"],
    )


def payer_legs(
    m: dict,
    payers: Payers,
    *,
    revenue_id: int,
    burned_id: int,
    base: str | None = None,
    card_kind: str = Transfer.Kind.CARD_BURN,
    money_kind: str = Transfer.Kind.USAGE,
) -> tuple[list[Leg], tuple]:
    """Who pays a meter's unposted seconds: its legs (cards first, then the wallet, the rest to the
    overdraft), moving the payers' balances on, and its row for the meters' update.

    The one payer rule of billing: the metering tick calls it for each due meter, the daily storage
    charge (``billing.services.storage``) with a day's charge as a meter-shaped row (``id`` None). Legs are
    keyed ``<base>:card:<ledger account>``, ``<base>:wallet`` and ``<base>:overdraft``."""
    balance = payers.balance
    legs: list[Leg] = []
    card_s0, wallet_s0 = m["card_seconds"], m["wallet_seconds"]
    card_s = card_s0
    base = base or f"meter:{m['id']}:{m['posted_seconds']}-{m['billed_seconds']}"
    for la_id, seconds in _allocate(m, payers.cards.get(m["account_id"], []), balance):
        amount = _cost(m["card_burn_micros_per_hour"], card_s + seconds) - _cost(
            m["card_burn_micros_per_hour"], card_s
        )
        card_s += seconds
        if amount:
            legs.append(_leg_planned(balance, la_id, burned_id, amount, card_kind, m, f"{base}:card:{la_id}"))
    wallet_s = wallet_s0 + (m["billed_seconds"] - m["posted_seconds"]) - (card_s - card_s0)
    price = m["price_micros_per_hour"]
    money = _cost(price, wallet_s) - _cost(price, wallet_s0)
    w_id, o_id = payers.wallet[m["account_id"]], payers.overdraft[m["account_id"]]
    from_wallet = min(money, balance[w_id])
    for la_id, amount, source in ((w_id, from_wallet, "wallet"), (o_id, money - from_wallet, "overdraft")):
        if amount:
            legs.append(_leg_planned(balance, la_id, revenue_id, amount, money_kind, m, f"{base}:{source}"))
    update = (
        m["id"],
        m["billed_seconds"],
        card_s,
        wallet_s,
        _cost(price, wallet_s),
        _cost(m["card_burn_micros_per_hour"], card_s),
    )
    return legs, update


def _allocate(meter: dict, account_cards: list[tuple], balance: dict[int, int]) -> list[tuple[int, int]]:
    """Which cards pay how many of the meter's unposted seconds, in burn order.

    Reads ``balance``; the caller subtracts what it posts, so the next meter of the account sees the rest.
    """
    burn = meter["card_burn_micros_per_hour"]
    remaining = meter["billed_seconds"] - meter["posted_seconds"]
    if burn <= 0 or remaining <= 0 or not account_cards:
        return []
    model = meter["gpu_model"]
    usable = [c for c in account_cards if not c[1] or model in c[1]]
    # restricted to this model first, then earliest expiry (no expiry last), then oldest
    usable.sort(key=lambda c: (0 if c[1] else 1, c[2] is None, c[2] or _EPOCH, c[0]))
    card_s = meter["card_seconds"]
    taken: list[tuple[int, int]] = []
    for la_id, _models, _expires in usable:
        if remaining <= 0:
            break
        held = balance[la_id]
        if held <= 0:
            continue
        spent_before = _cost(burn, card_s)
        # the most whole seconds whose cumulative cost stays within what this card holds
        most = ((held + spent_before + 1) * 3600 - 1) // burn - card_s
        seconds = min(remaining, most)
        if seconds <= 0:
            continue
        taken.append((la_id, seconds))
        card_s += seconds
        remaining -= seconds
    return taken


def _signal_runway(cursor, now: datetime, *, posted_accounts: set[int]) -> list[str]:
    """Find, among the accounts checked (see ``_RUNWAY_SQL``), those whose runway is short, gone, or back
    above twice the warning (funds were added since a warning); mark their meters and send the signals
    after commit. Returns the refs of the sessions whose funds are exhausted."""
    # an account is checked at least once a posting interval: warned that much ahead, it is never told
    # later than BILLING_RUNWAY_WARN_SECONDS before its funds end
    warn = settings.BILLING_RUNWAY_WARN_SECONDS + settings.BILLING_POSTING_INTERVAL_SECONDS
    cursor.execute(
        _RUNWAY_SQL,
        {"now": now, "unit": money_unit(), "warn": warn, "posted": bigint_array(sorted(posted_accounts))},
    )
    exhausted_refs: list[str] = []
    low: list[tuple[int, int, list[str]]] = []
    recovered: list[tuple[int, list[str]]] = []
    for account_id, refs, seconds, unwarned, unsignalled in cursor.fetchall():
        if seconds > warn:
            recovered.append((account_id, refs))
        elif seconds <= 0:
            if unsignalled:
                exhausted_refs += refs
        elif unwarned:
            low.append((account_id, int(seconds), refs))
    _meters_mark(cursor, "exhausted_at", now, refs=exhausted_refs)
    _meters_mark(cursor, "runway_warned_at", now, accounts=[a for a, _s, _r in low])
    _meters_mark(cursor, "runway_warned_at", None, accounts=[a for a, _r in recovered])

    def send() -> None:
        for account_id, seconds, refs in low:
            signals.runway_low.send(
                sender=Meter, account_id=account_id, runway_seconds=seconds, session_refs=refs
            )
        for account_id, refs in recovered:
            signals.runway_recovered.send(sender=Meter, account_id=account_id, session_refs=refs)
        if exhausted_refs:
            signals.funds_exhausted.send(sender=Meter, session_refs=exhausted_refs)
        signals.metered.send(sender=Meter, at=now)

    transaction.on_commit(send)
    return exhausted_refs


def _meters_mark(cursor, column: str, value: datetime | None, *, refs=(), accounts=()) -> None:
    """Set ``column`` on the open meters of these sessions or accounts: only rows this tick can lock at
    once (it never waits on a meter; see the lock order above)."""
    if not refs and not accounts:
        return
    if refs:
        where, args = "session_ref = ANY(%s::text[])", text_array(refs)
    else:
        where, args = "account_id = ANY(%s::bigint[])", bigint_array(accounts)
    cursor.execute(
        f"UPDATE billing_meter SET {column} = %s WHERE id IN (SELECT id FROM billing_meter "  # noqa: S608
        f"WHERE state = 'open' AND {where} ORDER BY id FOR UPDATE SKIP LOCKED)",
        [value, args],
    )
