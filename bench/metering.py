"""Benchmark: one metering tick over 1,000 / 10,000 / 50,000 running sessions on 5,000 accounts.

Brings Django up on the embedded PostgreSQL under its own data directory (``.data/bench``), creates
5,000 accounts with mixed wallets and compute cards (a consistent ledger: every balance is funded by a
transfer), then opens N running meters, all 90 seconds old, so one tick bills and posts every one
of them (the worst case: in steady state only about a twelfth of the meters are due each tick). It
times

- ``metering_tick`` (billing.services.metering): the set-based tick;
- the same tick a second time 5 seconds later (accrual only, nothing due: the steady-state tick);
- a baseline written here: a plain per-session ORM loop (lock the meter, find the account's cards,
  post each leg through ``transfer_post``, save the meter, then a runway check per account).

Each measurement runs in a transaction that is rolled back, so all start from the same state. The
baseline at large sizes is timed on a sample of sessions and extrapolated (said so in the output).
Never fails on a time.

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

from billing.models import CARD_UNIT, Card, LedgerAccount, Meter, Transfer  # noqa: E402
from billing.selectors import account_funds  # noqa: E402
from billing.services.ledger import money_unit, overdraft_for, system_account, transfer_post  # noqa: E402
from billing.services.metering import metering_tick  # noqa: E402
from billing.services.pricing import price_quote, price_set  # noqa: E402
from core.clock import db_now  # noqa: E402

ACCOUNTS = 5_000
MODELS = [("A100-SXM4-80GB", 12_000_000, 2000), ("T4", 2_000_000, 500), ("H200", 36_000_000, 4000)]
PROFILES = ["whole", "1/2", "1/4", "1/8"]
AGE_SECONDS = 90
TICK_SECONDS = 5


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
    """``count`` running meters (bulk insert), 90 s old, confirmed alive for the next hour."""
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
            meter.accrued_micros = meter.price_micros_per_hour * (seconds - meter.posted_seconds) // 3600
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
            meter.accrued_micros = 0
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
    60 s postings about a twelfth of the meters are due at each tick."""
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="smaller sizes (300 / 1,000 / 3,000)")
    args = parser.parse_args()
    sizes = [300, 1_000, 3_000] if args.quick else [1_000, 10_000, 50_000]
    sample = 300 if args.quick else 1_000
    rng = random.Random(5)
    print(f"database: {connection.settings_dict['HOST']} (SUANLI_DATA_DIR={os.environ['SUANLI_DATA_DIR']})")
    print(f"{ACCOUNTS:,} accounts, mixed wallets (empty to 50.00) and compute cards (none to two each)")
    t0 = time.perf_counter()
    call_command("migrate", verbosity=0, interactive=False)
    print()
    header = (
        f"{'sessions':>9}  {'tick ms':>8}  {'posted':>7}  {'catch-up ms':>11}  {'baseline ms':>11}  "
        f"{'ratio':>7}  note"
    )
    print(header)
    print("-" * len(header))
    results = []
    for size in sizes:
        _reset_schema()  # the same accounts, wallets and cards for every size
        account_ids = seed_accounts(random.Random(5))
        open_meters(rng, account_ids, size)
        now = db_now()
        catch_up_s, first = _commit_timed(lambda now=now: metering_tick(now=now))
        assert first.posted_meters == size, first  # every meter was due: the catch-up case was measured
        _stagger(now)
        steady = []
        for n in (1, 2, 3):
            seconds, tick = _commit_timed(
                lambda n=n, now=now: metering_tick(now=now + timedelta(seconds=5 * n))
            )
            steady.append((seconds, tick.posted_meters))
        tick_s, posted = sorted(steady)[1]  # the median of three ticks
        later = now + timedelta(seconds=20)
        if size <= sample:
            base_s, done = timed(lambda later=later: baseline_tick(now=later))
            note = "baseline measured on every session"
        else:
            sample_s, done = timed(lambda later=later: baseline_tick(now=later, limit=sample))
            base_s = sample_s * size / done
            note = f"baseline extrapolated from {done:,} sessions"
        results.append((size, tick_s))
        print(
            f"{size:>9,}  {tick_s * 1000:>8.0f}  {posted:>7,}  {catch_up_s * 1000:>11.0f}  "
            f"{base_s * 1000:>11.0f}  {base_s / tick_s:>6.0f}×  {note}"
        )
    print()
    (small, small_s), (large, large_s) = results[1], results[-1]
    growth, sessions = large_s / small_s, large / small
    print(
        f"{large:,} vs {small:,} sessions: {sessions:.0f}× the sessions, {growth:.1f}× the tick time "
        f"({'no faster than' if growth <= sessions else 'FASTER than'} the session count)"
    )
    print(
        "tick: a steady-state tick (every meter accrued, the due twelfth posted; median of 3);\n"
        "catch-up: the first tick over fresh 90-second-old meters, every one posted (after an outage);\n"
        "baseline: a per-session ORM loop doing the tick's work (accrue all, post the due ones)."
    )
    print(f"total {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
