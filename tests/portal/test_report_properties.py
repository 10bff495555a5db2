"""Property: for any ledger activity (sessions of several users, on their own and a team's account, on
several GPU models and profiles, at random prices, paid by compute cards, the wallet and the overdraft,
posted on random days), every usage report's rows equal what the ledger says, row by row, and partition
the ledger's total to the micro-unit, whatever the grouping, period and date range."""

from __future__ import annotations

import zoneinfo
from collections import defaultdict
from datetime import date, timedelta
from decimal import Decimal

import pytest
from django.conf import settings as django_settings
from django.db import connection, transaction
from django.utils import timezone
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from billing.models import CARD_UNIT, Entry, LedgerAccount, Meter, Transfer
from billing.services.cards import card_batch_issue, card_redeem
from billing.services.pricing import burn_rate_set, price_set, profile_fraction
from billing.services.topups import wallet_credit_promotion
from portal import reports
from portal.models import Membership
from portal.services import team_create, user_create
from tests.billing.conftest import assert_ledger_invariants
from tests.portal.usage_fixtures import catalog_ensure, metered_session

pytestmark = pytest.mark.django_db

MODELS = ("A100-SXM4-80GB", "T4")
PROFILES = ("whole", "1/2", "1/4", "1/8", "3g.40gb")

sessions_st = st.lists(
    st.fixed_dictionaries(
        {
            "who": st.integers(0, 2),  # user 0, 1 or 2
            "on_team": st.booleans(),  # users 0 and 1 are in the team; user 2 is not
            "model": st.sampled_from(MODELS),
            "profile": st.sampled_from(PROFILES),
            "seconds": st.integers(1, 30_000),
            "days_ago": st.integers(0, 75),
            "hours_ago": st.integers(0, 23),
        }
    ),
    min_size=0,
    max_size=8,
)
activity_st = st.fixed_dictionaries(
    {
        "prices": st.tuples(*(st.integers(1_000_000, 60_000_000) for _ in MODELS)),
        "burns": st.tuples(*(st.integers(500, 5000) for _ in MODELS)),
        "wallets": st.tuples(*(st.integers(0, 50_000_000) for _ in range(4))),  # 3 users and the team
        "cards": st.lists(st.tuples(st.integers(0, 3), st.integers(1, 5_000_000)), max_size=3),
        "sessions": sessions_st,
    }
)
question_st = st.fixed_dictionaries(
    {
        "group": st.sampled_from(reports.GROUPINGS),
        "bucket": st.sampled_from(reports.BUCKETS),
        "start_ago": st.integers(-3, 90),
        "length": st.integers(0, 90),
    }
)


def _shift(meter_id: int, *, days: int, hours: int) -> None:
    """Move one meter's postings into the past. The ledger refuses UPDATE; the test lifts its guard
    inside the example's savepoint, which is rolled back with everything else."""
    with connection.cursor() as cursor:
        cursor.execute("SET CONSTRAINTS ALL IMMEDIATE")  # no deferred checks pending on the table
        cursor.execute("ALTER TABLE billing_transfer DISABLE TRIGGER billing_transfer_append_only")
        cursor.execute(
            "UPDATE billing_transfer SET created_at = created_at - make_interval(days => %s, hours => %s) "
            "WHERE meter_id = %s",
            [days, hours, meter_id],
        )
        cursor.execute("ALTER TABLE billing_transfer ENABLE TRIGGER billing_transfer_append_only")
        cursor.execute("SET CONSTRAINTS ALL DEFERRED")


def _bucket_of(day: date, bucket: str) -> date:
    if bucket == "week":
        return day - timedelta(days=day.weekday())
    if bucket == "month":
        return day.replace(day=1)
    return day


def _build(activity: dict, users: list, team) -> list:
    catalog_ensure()
    for model, price, burn in zip(MODELS, activity["prices"], activity["burns"], strict=True):
        price_set(gpu_model=model, profile="whole", price_micros_per_hour=price)
        burn_rate_set(gpu_model=model, multiplier_milli=burn)
    accounts = [u.account for u in users] + [team.account]
    for n, (account, micros) in enumerate(zip(accounts, activity["wallets"], strict=True)):
        if micros:
            wallet_credit_promotion(account=account, amount_micros=micros, idempotency_key=f"prop-w{n}")
    for n, (holder, hours) in enumerate(activity["cards"]):
        _batch, (code,) = card_batch_issue(hours_micros=hours, count=1, valid_days=365, one_per_user=False)
        card_redeem(user=users[min(holder, 2)], account=accounts[holder], code=code, ip=f"10.9.0.{n}")
    made = []
    for spec in activity["sessions"]:
        owner = users[spec["who"]]
        on_team = spec["on_team"] and spec["who"] < 2
        account = team.account if on_team else owner.account
        meter = metered_session(
            owner=owner,
            account=account,
            gpu_model=spec["model"],
            profile=spec["profile"],
            seconds=spec["seconds"],
        )
        _shift(meter.id, days=spec["days_ago"], hours=spec["hours_ago"])
        keys = {
            "user": (str(owner.id), owner.username),
            "team": (str(team.id), team.name) if on_team else (None, None),
            "gpu_model": (spec["model"], spec["model"]),
            "profile": (spec["profile"], spec["profile"]),
        }
        made.append((meter, keys))
    return made


def _expected(made: list, usage_filter: reports.UsageFilter, account=None) -> dict:
    """Per (bucket, group key): seconds, GPU-seconds, money and card micros, read from the ledger's
    transfers one meter at a time (the slow way the report must agree with)."""
    tz = zoneinfo.ZoneInfo(django_settings.TIME_ZONE)
    rows: dict = defaultdict(lambda: [0, Decimal(0), 0, 0, None])
    for meter, keys in made:
        if account is not None and meter.account_id != account.id:
            continue
        meter = Meter.objects.get(id=meter.id)
        transfers = list(Transfer.objects.filter(meter=meter))
        if not transfers:
            continue
        day = transfers[0].created_at.astimezone(tz).date()
        assert {t.created_at for t in transfers} == {transfers[0].created_at}  # one posting
        if not usage_filter.since <= day <= usage_filter.until:
            continue
        key, label = keys[usage_filter.group]
        row = rows[(_bucket_of(day, usage_filter.bucket), key)]
        row[0] += meter.posted_seconds
        share = (
            Decimal(profile_fraction(meter.profile).numerator) / profile_fraction(meter.profile).denominator
        )
        row[1] += meter.posted_seconds * share
        row[2] += sum(t.amount_micros for t in transfers if t.kind == "usage")
        row[3] += sum(t.amount_micros for t in transfers if t.kind == "card_burn")
        row[4] = label
    return rows


def _ledger_totals(usage_filter: reports.UsageFilter, account=None) -> tuple[int, int]:
    """Money and card-hours the ledger's entries say were used in the range: the debits of wallets,
    overdrafts and cards by metering postings."""
    start, end = reports._bounds(usage_filter.since, usage_filter.until)
    entries = Entry.objects.filter(
        transfer__meter__isnull=False, transfer__created_at__gte=start, transfer__created_at__lt=end
    )
    if account is not None:
        entries = entries.filter(transfer__meter__account=account)
    money = entries.filter(
        transfer__kind="usage", account__kind__in=[LedgerAccount.Kind.WALLET, LedgerAccount.Kind.OVERDRAFT]
    )
    cards = entries.filter(
        transfer__kind="card_burn", account__kind=LedgerAccount.Kind.CARD, account__unit=CARD_UNIT
    )
    return -sum(money.values_list("amount_micros", flat=True)), -sum(
        cards.values_list("amount_micros", flat=True)
    )


def _check(report: reports.UsageReport, expected: dict, ledger: tuple[int, int]) -> None:
    got = {
        (row.bucket, row.group_key): [
            row.seconds,
            row.gpu_seconds,
            row.money_micros,
            row.card_micros,
            row.group_label,
        ]
        for row in report.rows
    }
    assert len(got) == len(report.rows)  # each (period, group) once: rows partition the total
    for row in expected.values():
        row[1] = row[1].quantize(reports.MICRO_SECOND)
    assert got == dict(expected)
    totals = report.totals
    assert (totals.money_micros, totals.card_micros) == ledger
    assert totals.seconds == sum(row[0] for row in expected.values())


@pytest.fixture
def people(settings):  # pytest-django's settings, not hypothesis's
    """Three users (made once: hashing passwords is slow), the first two in a team."""
    settings.CARD_REDEEM_RATE_PER_MINUTE = 10_000
    users = [user_create(username=f"u{i}", email="", password="a-long-pass-phrase-9") for i in range(3)]
    team = team_create(creator=users[0], name="Lab")
    Membership.objects.create(team=team, user=users[1], role=Membership.Role.MEMBER)
    return users, team


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
    ],
)
@given(activity=activity_st, questions=st.lists(question_st, min_size=1, max_size=4))
def test_report_rows_equal_the_ledger_and_partition_its_total(people, activity, questions):
    users, team = people
    with transaction.atomic():
        made = _build(activity, users, team)
        assert_ledger_invariants()
        today = timezone.localdate(timezone=zoneinfo.ZoneInfo(django_settings.TIME_ZONE))
        for question in questions:
            until = today - timedelta(days=question["start_ago"]) + timedelta(days=question["length"])
            usage_filter = reports.UsageFilter(
                since=today - timedelta(days=question["start_ago"]),
                until=until,
                group=question["group"],
                bucket=question["bucket"],
            )
            for account in (None, team.account):
                report = reports.usage_report(usage_filter=usage_filter, account=account)
                _check(report, _expected(made, usage_filter, account), _ledger_totals(usage_filter, account))
        transaction.set_rollback(True)
