"""Benchmark: one metering tick over 1,000 / 10,000 / 50,000 running sessions on 5,000 accounts.

Brings Django up on the embedded PostgreSQL under its own data directory (``.data/bench``), creates
5,000 accounts with mixed wallets and compute cards (a consistent ledger: every balance is funded by a
transfer), then opens N running meters, all a posting interval and 30 seconds old. The first tick bills
and posts every one of them (the catch-up after an outage); the postings are then spread over the
posting interval as steady running leaves them, so about tick/interval of the meters are due at each
later tick (1/60 with 5 s ticks and the default 300 s postings; ``BILLING_POSTING_INTERVAL_SECONDS=60``
in the environment measures 1/12). At each size it times, at the same instants (5, 10, … seconds on),
over the same state:

- the FLOOR: the same work done as directly as this engine allows, written here: one SQL statement that
  posts the meters due (cards first, then the wallet, the rest to the overdraft: the transfers, their
  entries with running balances, the cached balances and the meters' watermarks; the meters not due are
  not written, their accruals are computed when read), one that reads the runway of the accounts a tick
  checks (those posted for, and those it watches), and the deferred foreign-key checks those writes
  owe (``SET CONSTRAINTS ALL IMMEDIATE``). Rolled back, so the tick then starts from the same state. It
  is a lower bound, not a second implementation: it splits a meter's seconds between cards by whole
  micro-units, takes no meter locks, sends no signals and does not commit;
- the TICK: ``metering_tick`` (billing.services.metering), the product's code path, committed, with
  the after-commit signal receivers the project wires to it (their share is shown);
- a baseline written here: a plain per-session ORM loop (lock the meter, find the account's cards,
  post each leg through ``transfer_post``, save the meter, then a runway check per account), rolled
  back; at large sizes timed on a sample of sessions and extrapolated (said so in the output).

Prints each size's figures, the tick over the floor, the tick's growth from 10,000 to 50,000 sessions,
and whether the targets of issue #15 are met (at 10,000: tick ≤ 2× the floor and ≤ 160 ms; 10,000 to
50,000: the tick grows ≤ 5×). Never fails on a time.

    .venv/bin/python bench/metering.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("SUANLI_DATA_DIR", str(ROOT / ".data" / "bench"))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")

import django  # noqa: E402

from portal import embedded  # noqa: E402

embedded.ensure_wanted()
django.setup()

from django.conf import settings  # noqa: E402
from django.core.management import call_command  # noqa: E402
from django.db import connection, transaction  # noqa: E402
from django.db.models import Q  # noqa: E402

from billing import signals  # noqa: E402
from billing.models import CARD_UNIT, Card, LedgerAccount, Meter, Transfer, accrued_now_sql  # noqa: E402
from billing.selectors import account_funds  # noqa: E402
from billing.services.ledger import (  # noqa: E402
    bulk_cursor,
    money_unit,
    overdraft_for,
    system_account,
    transfer_post,
)
from billing.services.metering import RUNWAY_CHECKED_SQL, metering_tick  # noqa: E402
from billing.services.pricing import price_quote, price_set  # noqa: E402
from core.clock import db_now  # noqa: E402

ACCOUNTS = 5_000
MODELS = [("A100-SXM4-80GB", 12_000_000, 2000), ("T4", 2_000_000, 500), ("H200", 36_000_000, 4000)]
PROFILES = ["whole", "1/2", "1/4", "1/8"]
AGE_SECONDS = settings.BILLING_POSTING_INTERVAL_SECONDS + 30  # every meter due at the first tick
TICK_SECONDS = 5
REPEATS = 5  # steady-state ticks (and floors) per size; the median is reported
TARGET_RATIO = 2.0  # at 10,000 sessions: tick ≤ 2× the floor
TARGET_TICK_MS = 160  # at 10,000 sessions
TARGET_GROWTH = 5.0  # from 10,000 to 50,000 sessions


class _Rollback(Exception):
    pass


def _reset_schema() -> None:
    with connection.cursor() as cursor:
        cursor.execute(
            "TRUNCATE billing_entry, billing_transfer, billing_meter, billing_invitecode, billing_card, "
            "billing_cardbatch, billing_ledgeraccount, billing_price, billing_cardburnrate, "
            "notices_notice, billing_auditentry, billing_account CASCADE"
        )
    for model, price, burn in MODELS:
        price_set(gpu_model=model, profile="whole", price_micros_per_hour=price)
        from billing.services.pricing import burn_rate_set

        burn_rate_set(gpu_model=model, multiplier_milli=burn)


def _fund_sql(cursor, *, source_id: int, targets: list[tuple[int, int]], kind: str, key: str) -> None:
    """Transfers (and their entries) from ``source_id`` to each (ledger account, amount): the cached
    balances the bench inserted are then the sums of their entries, as the ledger requires."""
    targets = [(la, amount) for la, amount in targets if amount > 0]
    ids, amounts = [t[0] for t in targets], [t[1] for t in targets]
    cursor.execute(
        """
        WITH t AS (
            INSERT INTO billing_transfer (debit_id, credit_id, amount_micros, unit, kind, memo,
                                          idempotency_key)
            SELECT %(source)s, v.la, v.amount, la.unit, %(kind)s, 'bench', %(key)s || v.la
            FROM unnest(%(ids)s::bigint[], %(amounts)s::bigint[]) AS v(la, amount)
            JOIN billing_ledgeraccount la ON la.id = v.la
            RETURNING id, credit_id, amount_micros
        ), ordered AS (
            SELECT id, credit_id, amount_micros,
                   sum(amount_micros) OVER (ORDER BY id) AS running FROM t
        )
        INSERT INTO billing_entry (transfer_id, account_id, amount_micros, balance_after_micros)
        SELECT id, %(source)s, -amount_micros, -running FROM ordered
        UNION ALL
        SELECT id, credit_id, amount_micros, amount_micros FROM ordered
        """,
        {"source": source_id, "ids": ids, "amounts": amounts, "kind": kind, "key": key},
    )
    cursor.execute(
        "UPDATE billing_ledgeraccount SET balance_micros = balance_micros - %s, version = version + 1 "
        "WHERE id = %s",
        [sum(amounts), source_id],
    )


def seed_accounts(rng: random.Random) -> list[int]:
    """5,000 accounts: wallets from empty to 50.00, half with one or two cards (some model-restricted)."""
    unit = money_unit()
    promotions = system_account(kind=LedgerAccount.Kind.PROMOTIONS, unit=unit)
    card_source = system_account(kind=LedgerAccount.Kind.PROMOTIONS, unit=CARD_UNIT)
    system_account(kind=LedgerAccount.Kind.REVENUE, unit=unit)
    system_account(kind=LedgerAccount.Kind.CARD_BURN, unit=CARD_UNIT)
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO billing_account (kind, name, created_at) SELECT CASE WHEN g %% 10 = 0 THEN 'team' "
            "ELSE 'user' END, 'bench-' || g, now() FROM generate_series(1, %s) g RETURNING id",
            [ACCOUNTS],
        )
        account_ids = sorted(row[0] for row in cursor.fetchall())
        wallet_amounts = [rng.choice([0, 0, 200_000, 1_000_000, 5_000_000, 50_000_000]) for _ in account_ids]
        cursor.execute(
            """
            INSERT INTO billing_ledgeraccount (kind, owner_id, unit, balance_micros, version, created_at)
            SELECT k.kind, v.id, %s, CASE WHEN k.kind = 'wallet' THEN v.amount ELSE 0 END, 0, now()
            FROM unnest(%s::bigint[], %s::bigint[]) AS v(id, amount)
            CROSS JOIN (VALUES ('wallet'), ('overdraft')) AS k(kind)
            RETURNING id, kind, balance_micros
            """,
            [unit, account_ids, wallet_amounts],
        )
        wallets = [(la, bal) for la, kind, bal in cursor.fetchall() if kind == "wallet"]
        _fund_sql(cursor, source_id=promotions.id, targets=wallets, kind="promotion", key="bench-fund-")

        cursor.execute(
            "INSERT INTO billing_cardbatch (label, hours_micros, valid_days, gpu_models, splittable, "
            "max_parts, one_per_user, created_at) "
            "VALUES ('bench', 10000000, 30, '[]', true, 3, false, now()) RETURNING id"
        )
        batch_id = cursor.fetchone()[0]
        owners, hours, models, expiries = [], [], [], []
        now = db_now()
        for account_id in account_ids:
            for _ in range(rng.choice([0, 0, 1, 2])):
                owners.append(account_id)
                hours.append(rng.choice([50_000, 500_000, 2_000_000, 10_000_000]))
                models.append(rng.choice(["[]", "[]", '["A100-SXM4-80GB"]', '["T4"]']))
                expiries.append(now + timedelta(days=rng.randint(1, 30)))
        cursor.execute(
            """
            INSERT INTO billing_ledgeraccount (kind, owner_id, unit, balance_micros, version, created_at)
            SELECT 'card', o, %s, h, 0, now() FROM unnest(%s::bigint[], %s::bigint[]) WITH ORDINALITY
                AS v(o, h, n) ORDER BY n
            RETURNING id
            """,
            [CARD_UNIT, owners, hours],
        )
        card_ledgers = [row[0] for row in cursor.fetchall()]
        cursor.execute(
            """
            INSERT INTO billing_card (ledger_account_id, batch_id, owner_id, hours_micros, gpu_models,
                                      max_parts, splittable, redeemed_at, expires_at, state, reminded_days,
                                      created_at)
            SELECT la, %s, o, h, m::jsonb, 3, true, now(), e, 'active', '[]', now()
            FROM unnest(%s::bigint[], %s::bigint[], %s::bigint[], %s::text[], %s::timestamptz[])
                AS v(la, o, h, m, e)
            """,
            [batch_id, card_ledgers, owners, hours, models, expiries],
        )
        _fund_sql(
            cursor,
            source_id=card_source.id,
            targets=list(zip(card_ledgers, hours, strict=True)),
            kind="card_issue",
            key="bench-card-",
        )
    return account_ids


def open_meters(rng: random.Random, account_ids: list[int], count: int) -> None:
    """``count`` running meters (bulk insert), ``AGE_SECONDS`` old, confirmed alive for the next hour."""
    with connection.cursor() as cursor:
        cursor.execute("DELETE FROM billing_meter")
    now = db_now()
    quotes = {(m, p): price_quote(gpu_model=m, profile=p) for m, _, _ in MODELS for p in PROFILES}
    rows = []
    for n in range(count):
        model, _, _ = rng.choice(MODELS)
        profile = rng.choice(PROFILES)
        quote = quotes[(model, profile)]
        started = now - timedelta(seconds=AGE_SECONDS + rng.randint(0, 30))
        rows.append(
            Meter(
                account_id=account_ids[n % len(account_ids)],
                session_ref=f"bench-{n}",
                gpu_model=model,
                profile=profile,
                price_id=quote.price_id,
                price_micros_per_hour=quote.price_micros_per_hour,
                card_burn_micros_per_hour=quote.card_burn_micros_per_hour,
                started_at=started,
                alive_until=now + timedelta(hours=1),
                billed_until=started,
            )
        )
    Meter.objects.bulk_create(rows, batch_size=5_000)
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE")


# --- the floor: the tick's work as directly as PostgreSQL allows ----------------------------------------

# Every open meter accrued and every due one posted, in one statement. Each account's due meters (id
# order) draw on its usable cards (restricted ones first, then earliest expiry, then oldest) as
# consecutive ranges of micro-units; a card restricted to another model is skipped. What the cards do
# not cover is money: the wallet pays up to its balance, the overdraft the rest.
FLOOR_POST_SQL = """
WITH m AS MATERIALIZED (
    SELECT id, account_id, gpu_model, price_micros_per_hour AS price, card_burn_micros_per_hour AS burn,
           posted_seconds AS posted,
           GREATEST(billed_seconds,
                    floor(extract(epoch FROM (LEAST(%(now)s, alive_until) - started_at)))::bigint) AS secs,
           true AS due
    FROM billing_meter
    WHERE state = 'open'
      AND COALESCE(last_posted_at, started_at) <= %(now)s - make_interval(secs => %(interval)s)
), due AS (
    SELECT *, burn * (secs - posted) / 3600 AS want,
           (sum(burn * (secs - posted) / 3600) OVER (PARTITION BY account_id ORDER BY id))::bigint AS want_to
    FROM m WHERE due AND secs > posted
), supply AS (
    SELECT la.id AS la_id, la.owner_id AS account_id, c.gpu_models,
           (sum(la.balance_micros) OVER w)::bigint - la.balance_micros AS from_micros,
           (sum(la.balance_micros) OVER w)::bigint AS to_micros
    FROM billing_ledgeraccount la JOIN billing_card c ON c.ledger_account_id = la.id
    WHERE la.kind = 'card' AND la.balance_micros > 0 AND c.state = 'active'
      AND (c.expires_at IS NULL OR c.expires_at > %(now)s) AND la.owner_id IN (SELECT account_id FROM due)
    WINDOW w AS (PARTITION BY la.owner_id ORDER BY c.gpu_models = '[]', c.expires_at NULLS LAST, la.id)
), card_leg AS (
    SELECT d.id AS meter_id, s.la_id,
           LEAST(d.want_to, s.to_micros) - GREATEST(d.want_to - d.want, s.from_micros) AS amount
    FROM due d JOIN supply s ON s.account_id = d.account_id
     AND s.from_micros < d.want_to AND d.want_to - d.want < s.to_micros
    WHERE s.gpu_models = '[]' OR s.gpu_models ? d.gpu_model
), paid AS (
    SELECT d.*, LEAST(d.secs - d.posted, COALESCE(c.micros, 0) * 3600 / NULLIF(d.burn, 0))::bigint AS card_s
    FROM due d
    LEFT JOIN (SELECT meter_id, sum(amount)::bigint AS micros FROM card_leg GROUP BY meter_id) c
      ON c.meter_id = d.id
), money AS (
    SELECT p.*, p.price * (p.secs - p.posted - COALESCE(p.card_s, 0)) / 3600 AS owed,
           w.id AS wallet_id, w.balance_micros AS wallet, o.id AS overdraft_id
    FROM paid p
    JOIN billing_ledgeraccount w ON w.owner_id = p.account_id AND w.kind = 'wallet' AND w.unit = %(unit)s
    JOIN billing_ledgeraccount o ON o.owner_id = p.account_id AND o.kind = 'overdraft' AND o.unit = %(unit)s
), split AS (
    SELECT money.*, LEAST(owed_to, wallet) - LEAST(owed_to - owed, wallet) AS from_wallet
    FROM (SELECT *, (sum(owed) OVER (PARTITION BY account_id ORDER BY id))::bigint AS owed_to
          FROM money) money
), leg AS (
    SELECT meter_id, 0 AS n, la_id AS debit, %(burned)s::bigint AS credit, amount, 'card_burn' AS kind,
           ':card:' || la_id AS suffix
    FROM card_leg WHERE amount > 0
    UNION ALL
    SELECT id, 1, wallet_id, %(revenue)s, from_wallet, 'usage', ':wallet' FROM split WHERE from_wallet > 0
    UNION ALL
    SELECT id, 2, overdraft_id, %(revenue)s, owed - from_wallet, 'usage', ':overdraft' FROM split
    WHERE owed > from_wallet
), transfer AS (
    INSERT INTO billing_transfer (debit_id, credit_id, amount_micros, unit, kind, memo, idempotency_key,
                                  meter_id)
    SELECT leg.debit, leg.credit, leg.amount, la.unit, leg.kind, '',
           'floor:' || leg.meter_id || ':' || m.posted || '-' || m.secs || leg.suffix, leg.meter_id
    FROM leg JOIN m ON m.id = leg.meter_id JOIN billing_ledgeraccount la ON la.id = leg.debit
    ORDER BY leg.meter_id, leg.n
    RETURNING id, debit_id, credit_id, amount_micros
), side AS (
    SELECT id, debit_id AS la_id, -amount_micros AS amount FROM transfer
    UNION ALL
    SELECT id, credit_id, amount_micros FROM transfer
), entry AS (
    INSERT INTO billing_entry (transfer_id, account_id, amount_micros, balance_after_micros)
    SELECT side.id, side.la_id, side.amount,
           la.balance_micros + (sum(side.amount) OVER (PARTITION BY side.la_id ORDER BY side.id))::bigint
    FROM side JOIN billing_ledgeraccount la ON la.id = side.la_id
), balance AS (
    UPDATE billing_ledgeraccount la
    SET balance_micros = la.balance_micros + s.amount, version = la.version + 1
    FROM (SELECT la_id, sum(amount)::bigint AS amount FROM side GROUP BY la_id) s WHERE la.id = s.la_id
)
UPDATE billing_meter meter SET
    billed_seconds = s.secs,
    billed_until = meter.started_at + make_interval(secs => s.secs::double precision),
    posted_seconds = s.secs,
    card_seconds = meter.card_seconds + s.card_s,
    wallet_seconds = meter.wallet_seconds + (s.secs - s.posted - s.card_s),
    charged_micros = meter.price_micros_per_hour
                   * (meter.wallet_seconds + s.secs - s.posted - s.card_s) / 3600,
    card_charged_micros = meter.card_burn_micros_per_hour * (meter.card_seconds + s.card_s) / 3600,
    last_posted_at = %(now)s
FROM (SELECT id, secs, posted, COALESCE(card_s, 0) AS card_s FROM split) s
WHERE meter.id = s.id
RETURNING meter.account_id
"""

# The runway of the accounts a tick checks (those it posted for, and those it watches: told their runway is
# short or gone, or with a meter not posted yet), with accruals as of now, and those at or under the
# warning or back above twice it: the accounts a tick would signal.
FLOOR_RUNWAY_SQL = f"""
WITH checked AS ({RUNWAY_CHECKED_SQL}), om AS (
    SELECT account_id, sum(price_micros_per_hour) AS price, sum(card_burn_micros_per_hour) AS burn,
           sum({accrued_now_sql("%(now)s")}) AS accrued,
           array_agg(DISTINCT gpu_model) AS models
    FROM billing_meter WHERE state = 'open' AND account_id IN (SELECT account_id FROM checked)
    GROUP BY account_id HAVING sum(price_micros_per_hour) > 0
), money AS (
    SELECT om.account_id, sum(la.balance_micros) AS money
    FROM om JOIN billing_ledgeraccount la ON la.owner_id = om.account_id
    WHERE la.kind IN ('wallet', 'overdraft') AND la.unit = %(unit)s GROUP BY om.account_id
), cards AS (
    SELECT om.account_id, sum(la.balance_micros) AS cards
    FROM om JOIN billing_ledgeraccount la ON la.owner_id = om.account_id
    JOIN billing_card c ON c.ledger_account_id = la.id
    WHERE la.kind = 'card' AND la.balance_micros > 0 AND c.state = 'active'
      AND (c.expires_at IS NULL OR c.expires_at > %(now)s)
      AND (c.gpu_models = '[]'::jsonb OR c.gpu_models ?| om.models)
    GROUP BY om.account_id
)
SELECT account_id, seconds FROM (
    SELECT om.account_id,
           (CASE WHEN om.burn > 0 THEN COALESCE(cards.cards, 0) * 3600 / om.burn ELSE 0 END)
           + (COALESCE(money.money, 0) - om.accrued) * 3600 / om.price AS seconds
    FROM om LEFT JOIN money USING (account_id) LEFT JOIN cards USING (account_id)
) runway
WHERE seconds <= %(warn)s OR seconds > 2 * %(warn)s
"""  # noqa: S608 (no input in the f-string: billing.models' SQL for accruals as of now)


def floor_tick(*, now) -> tuple[float, float, float]:
    """The floor at ``now``: its statements and the foreign-key checks they owe, timed, then rolled back.
    Returns the seconds of its three parts: post the due, the runways, the foreign-key checks."""
    revenue = system_account(kind=LedgerAccount.Kind.REVENUE)
    burned = system_account(kind=LedgerAccount.Kind.CARD_BURN, unit=CARD_UNIT)
    post_args = {
        "now": now,
        "interval": float(settings.BILLING_POSTING_INTERVAL_SECONDS),
        "unit": money_unit(),
        "revenue": revenue.id,
        "burned": burned.id,
    }
    runway_args = {"now": now, "unit": money_unit(), "warn": settings.BILLING_RUNWAY_WARN_SECONDS}
    marks = []
    try:
        with transaction.atomic(), bulk_cursor() as cursor:
            marks.append(time.perf_counter())
            cursor.execute(FLOOR_POST_SQL, post_args)
            runway_args["posted"] = sorted({row[0] for row in cursor.fetchall()})
            marks.append(time.perf_counter())
            cursor.execute(FLOOR_RUNWAY_SQL, runway_args)
            cursor.fetchall()
            marks.append(time.perf_counter())
            cursor.execute("SET CONSTRAINTS ALL IMMEDIATE")  # what the commit would check
            marks.append(time.perf_counter())
            raise _Rollback
    except _Rollback:
        pass
    post_s, runway_s, checks_s = (b - a for a, b in zip(marks, marks[1:], strict=False))
    return post_s, runway_s, checks_s


TICK_SIGNALS = (signals.funds_exhausted, signals.runway_low, signals.runway_recovered, signals.metered)


class _SignalClock:
    """Time spent in the receivers of billing's signals (the tick sends them after commit)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        for signal in TICK_SIGNALS:
            signal.send = self._timed(signal.send)

    def _timed(self, send):
        def timed_send(*args, **kwargs):
            start = time.perf_counter()
            try:
                return send(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return timed_send


# --- the baseline: a plain per-session ORM loop --------------------------------------------------------


def baseline_tick(*, now, limit: int | None = None) -> int:
    """What a straightforward implementation does each tick: one session at a time, through the ORM.
    Accrue every session; post those due (once a minute) through ``transfer_post``, cards first."""
    interval = timedelta(seconds=settings.BILLING_POSTING_INTERVAL_SECONDS)
    revenue = system_account(kind=LedgerAccount.Kind.REVENUE)
    burned = system_account(kind=LedgerAccount.Kind.CARD_BURN, unit=CARD_UNIT)
    meters = Meter.objects.filter(state=Meter.State.OPEN).order_by("id").values_list("id", flat=True)
    done = 0
    accounts = set()
    for meter_id in meters[:limit] if limit else meters:
        done += 1
        with transaction.atomic():
            meter = Meter.objects.select_for_update().select_related("account").get(id=meter_id)
            seconds = int((min(now, meter.alive_until) - meter.started_at).total_seconds())
            meter.billed_seconds = seconds
            meter.billed_until = meter.started_at + timedelta(seconds=seconds)
            accounts.add(meter.account)
            if (meter.last_posted_at or meter.started_at) > now - interval:
                meter.save()
                continue
            new = seconds - meter.posted_seconds
            cards = (
                Card.objects.filter(owner_id=meter.account_id, state=Card.State.ACTIVE, expires_at__gt=now)
                .filter(Q(gpu_models=[]) | Q(gpu_models__contains=[meter.gpu_model]))
                .select_related("ledger_account")
                .order_by("expires_at", "id")
            )
            key = f"base:{meter.id}:{seconds}"
            for card in cards:
                if new <= 0 or not meter.card_burn_micros_per_hour:
                    break
                held = card.ledger_account.balance_micros
                take = min(new, held * 3600 // meter.card_burn_micros_per_hour)
                amount = meter.card_burn_micros_per_hour * take // 3600
                if amount > 0:
                    transfer_post(
                        debit=card.ledger_account,
                        credit=burned,
                        amount_micros=amount,
                        kind=Transfer.Kind.CARD_BURN,
                        idempotency_key=f"{key}:card:{card.id}",
                    )
                    meter.card_seconds += take
                    new -= take
            money = meter.price_micros_per_hour * new // 3600
            wallet = LedgerAccount.objects.get(owner_id=meter.account_id, kind="wallet", unit=revenue.unit)
            from_wallet = min(money, wallet.balance_micros)
            if from_wallet > 0:
                transfer_post(
                    debit=wallet,
                    credit=revenue,
                    amount_micros=from_wallet,
                    kind=Transfer.Kind.USAGE,
                    idempotency_key=f"{key}:wallet",
                )
            if money - from_wallet > 0:
                transfer_post(
                    debit=overdraft_for(account=meter.account),
                    credit=revenue,
                    amount_micros=money - from_wallet,
                    kind=Transfer.Kind.USAGE,
                    idempotency_key=f"{key}:overdraft",
                )
            meter.wallet_seconds += new
            meter.posted_seconds = seconds
            meter.charged_micros += money
            meter.last_posted_at = now
            meter.save()
    for account in accounts:  # the runway check, one account at a time
        account_funds(account=account).runway_seconds  # noqa: B018
    return done


def timed(function) -> tuple[float, object]:
    """Run ``function`` in a transaction that is rolled back; return (seconds, its result)."""
    result = None
    start = time.perf_counter()
    try:
        with transaction.atomic():
            result = function()
            elapsed = time.perf_counter() - start
            raise _Rollback
    except _Rollback:
        pass
    return elapsed, result


def _stagger(now) -> None:
    """Spread the next postings over the posting interval, as steady running does: with 5 s ticks and
    300 s postings about a sixtieth of the meters are due at each tick."""
    ticks = max(1, int(settings.BILLING_POSTING_INTERVAL_SECONDS // TICK_SECONDS))
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE billing_meter SET last_posted_at = %s - make_interval(secs => (id %% %s) * %s)",
            [now, ticks, TICK_SECONDS],
        )
        cursor.execute("VACUUM ANALYZE billing_meter")


def _commit_timed(function) -> tuple[float, object]:
    start = time.perf_counter()
    result = function()
    return time.perf_counter() - start, result


def growth_words(sessions: float, growth: float) -> str:
    """How the tick grew against the sessions, in words: per session it got cheaper, stayed about the
    same (within 5 %), or dearer."""
    per_session = growth / sessions
    if per_session < 0.95:
        return "better than linear"
    if per_session <= 1.05:
        return "about linear"
    if per_session <= 1.25:
        return "slightly worse than linear"
    return "worse than linear"


def _met(ok: bool) -> str:
    return "met" if ok else "MISSED"


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="smaller sizes (300 / 1,000 / 3,000)")
    args = parser.parse_args()
    sizes = [300, 1_000, 3_000] if args.quick else [1_000, 10_000, 50_000]
    sample = 300 if args.quick else 1_000
    rng = random.Random(5)
    clock = _SignalClock()
    print(f"database: {connection.settings_dict['HOST']} (SUANLI_DATA_DIR={os.environ['SUANLI_DATA_DIR']})")
    print(f"{ACCOUNTS:,} accounts, mixed wallets (empty to 50.00) and compute cards (none to two each)")
    interval = settings.BILLING_POSTING_INTERVAL_SECONDS
    share = max(1, int(interval // TICK_SECONDS))
    print(f"a tick every {TICK_SECONDS} s, a posting every {interval} s: 1/{share} of the meters due at each")
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    t0 = time.perf_counter()
    call_command("migrate", verbosity=0, interactive=False)
    print()
    header = (
        f"{'sessions':>9}  {'floor ms':>8}  {'tick ms':>8}  {'tick/floor':>10}  {'signals ms':>10}  "
        f"{'posted':>7}  {'catch-up ms':>11}  {'baseline ms':>11}  note"
    )
    print(header)
    print("-" * len(header))
    results, parts = [], []
    for size in sizes:
        _reset_schema()  # the same accounts, wallets and cards for every size
        account_ids = seed_accounts(random.Random(5))
        open_meters(rng, account_ids, size)
        now = db_now()
        catch_up_s, first = _commit_timed(lambda now=now: metering_tick(now=now))
        assert first.posted_meters == size, first  # every meter was due: the catch-up case was measured
        _stagger(now)
        floors, ticks, receivers, posted = [], [], [], []
        for n in range(1, REPEATS + 1):
            at = now + timedelta(seconds=TICK_SECONDS * n)
            floors.append(floor_tick(now=at))  # rolled back: the tick below starts from the same state
            clock.seconds = 0.0
            seconds, tick = _commit_timed(lambda at=at: metering_tick(now=at))
            ticks.append(seconds)
            receivers.append(clock.seconds)
            posted.append(tick.posted_meters)
        floor_s, tick_s = _median([sum(parts) for parts in floors]), _median(ticks)
        floor_parts = [_median([parts[n] for parts in floors]) for n in range(3)]
        later = now + timedelta(seconds=TICK_SECONDS * (REPEATS + 1))
        if size <= sample:
            base_s, done = timed(lambda later=later: baseline_tick(now=later))
            note = "baseline measured on every session"
        else:
            sample_s, done = timed(lambda later=later: baseline_tick(now=later, limit=sample))
            base_s = sample_s * size / done
            note = f"baseline extrapolated from {done:,} sessions"
        results.append((size, floor_s, tick_s))
        parts.append((size, floor_parts))
        print(
            f"{size:>9,}  {floor_s * 1000:>8.0f}  {tick_s * 1000:>8.0f}  {tick_s / floor_s:>9.2f}×  "
            f"{_median(receivers) * 1000:>10.0f}  {_median(posted):>7,}  {catch_up_s * 1000:>11.0f}  "
            f"{base_s * 1000:>11.0f}  {note}"
        )
    print()
    print("floor by part, ms (post the due / runways / foreign-key checks; medians):")
    for size, (post_s, runway_s, checks_s) in parts:
        print(f"  {size:>9,}: {post_s * 1000:.0f} / {runway_s * 1000:.0f} / {checks_s * 1000:.0f}")
    (_, _, _), (small, small_floor_s, small_s), (large, _, large_s) = results
    growth, sessions = large_s / small_s, large / small
    print(
        f"{large:,} vs {small:,} sessions: {sessions:.0f}× the sessions, {growth:.1f}× the tick: "
        f"{growth_words(sessions, growth)}"
    )
    scale = "" if small == 10_000 else " (--quick: the targets are for 10,000 and 50,000 sessions)"
    print(f"targets{scale}:")
    ratio = small_s / small_floor_s
    print(
        f"  at {small:,}: tick ≤ {TARGET_RATIO:.0f}× the floor: {ratio:.2f}× — {_met(ratio <= TARGET_RATIO)}"
    )
    print(
        f"  at {small:,}: tick ≤ {TARGET_TICK_MS} ms: {small_s * 1000:.0f} ms — "
        f"{_met(small_s * 1000 <= TARGET_TICK_MS)}"
    )
    print(
        f"  {small:,} to {large:,}: the tick grows ≤ {TARGET_GROWTH:.0f}×: {growth:.1f}× — "
        f"{_met(growth <= TARGET_GROWTH)}"
    )
    print(
        "floor: the tick's work as directly as PostgreSQL allows (one statement posts the due meters, one\n"
        "  reads the runways it checks, then the deferred foreign-key checks;\n"
        f"  rolled back; median of {REPEATS});\n"
        f"tick: a steady-state metering_tick (the due 1/{share} posted, the rest read live; committed, with\n"
        f"  its after-commit signal receivers, whose share is 'signals'; median of {REPEATS});\n"
        f"catch-up: the first tick over {AGE_SECONDS} s old meters, every one posted (after an outage);\n"
        "baseline: a per-session ORM loop (writes every meter, posts the due ones, a runway per account)."
    )
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"total {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
