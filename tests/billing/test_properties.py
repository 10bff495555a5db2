"""Property tests: for any sequence of top-ups, ticks, card operations and adjustments the ledger
balances, sums to zero per unit, respects its floors, and every meter's postings equal its charge."""

from __future__ import annotations

import contextlib
import itertools
from datetime import timedelta

import pytest
from django.db import connection
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from billing.models import CARD_UNIT, Card, LedgerAccount
from billing.services.cards import (
    card_batch_issue,
    card_expire,
    card_gift,
    card_redeem,
    card_revoke,
    card_split,
)
from billing.services.ledger import system_account, wallet_adjust
from billing.services.metering import meter_alive, meter_close, meter_open, metering_tick
from billing.services.pricing import price_quote
from core.clock import db_now
from core.errors import ApplicationError
from portal.services import user_create
from tests.billing.conftest import A100, assert_ledger_invariants, fund, make_account, seed_prices

HOUR = 1_000_000
_ids = itertools.count()


def _card_hours_balance() -> tuple[int, int, int, int]:
    issued = -system_account(kind=LedgerAccount.Kind.PROMOTIONS, unit=CARD_UNIT).balance_micros
    left = sum(LedgerAccount.objects.filter(kind="card").values_list("balance_micros", flat=True))
    burned = system_account(kind=LedgerAccount.Kind.CARD_BURN, unit=CARD_UNIT).balance_micros
    expired = system_account(kind=LedgerAccount.Kind.CARD_EXPIRY, unit=CARD_UNIT).balance_micros
    return issued, left, burned, expired


@pytest.mark.django_db(transaction=True)
def test_ledger_state_machine():
    class Ledger(RuleBasedStateMachine):
        @initialize()
        def setup(self):
            with connection.cursor() as cursor:
                cursor.execute(
                    "TRUNCATE billing_entry, billing_transfer, billing_meter, billing_invitecode, billing_card, "
                    "billing_cardbatch, billing_ledgeraccount, billing_price, billing_cardburnrate, "
                    "billing_auditentry, billing_account CASCADE"
                )
            seed_prices()
            n = next(_ids)
            self.users = [
                user_create(username=f"prop{n}u{i}", email="", password="a-long-pass-phrase-9")
                for i in range(2)
            ]
            self.accounts = [u.account for u in self.users]
            self.team = make_account()
            self.now = db_now()
            self.codes: list[str] = []
            self.meters: list[str] = []

        @rule(who=st.integers(0, 2), amount=st.integers(1, 20_000_000))
        def top_up(self, who, amount):
            fund((self.accounts + [self.team])[who], amount)

        @rule(who=st.integers(0, 2), amount=st.integers(-5_000_000, 5_000_000))
        def adjust(self, who, amount):
            with contextlib.suppress(ApplicationError):
                wallet_adjust(
                    account=(self.accounts + [self.team])[who],
                    amount_micros=amount,
                    actor=None,
                    reason="property test",
                    idempotency_key=f"adj{next(_ids)}",
                )

        @rule(
            who=st.integers(0, 2),
            model=st.sampled_from([A100, "T4", "H200"]),
            profile=st.sampled_from(["whole", "1/2", "1/8", "1g.18gb"]),
        )
        def open_meter(self, who, model, profile):
            ref = f"s{next(_ids)}"
            quote = price_quote(gpu_model=model, profile=profile)
            meter_open(
                account=(self.accounts + [self.team])[who],
                session_ref=ref,
                gpu_model=model,
                profile=profile,
                quote=quote,
                started_at=self.now,
            )
            self.meters.append(ref)

        @rule(seconds=st.integers(1, 900))
        def tick(self, seconds):
            self.now += timedelta(seconds=seconds)
            meter_alive(session_refs=self.meters, alive_at=self.now)
            metering_tick(now=self.now)

        @precondition(lambda self: self.meters)
        @rule(index=st.integers(0, 50))
        def close(self, index):
            meter_close(session_ref=self.meters[index % len(self.meters)], ended_at=self.now)

        @rule(hours=st.integers(1, 5), count=st.integers(1, 3), models=st.sampled_from([[], [A100], ["T4"]]))
        def issue(self, hours, count, models):
            _, codes = card_batch_issue(
                hours_micros=hours * HOUR, count=count, valid_days=2, gpu_models=models, one_per_user=False
            )
            self.codes += codes

        @precondition(lambda self: self.codes)
        @rule(who=st.integers(0, 1), index=st.integers(0, 50))
        def redeem(self, who, index):
            code = self.codes.pop(index % len(self.codes))
            with contextlib.suppress(ApplicationError):
                card_redeem(user=self.users[who], account=self.accounts[who], code=code)

        @rule(who=st.integers(0, 1), parts=st.lists(st.integers(1, 3), min_size=1, max_size=3))
        def split(self, who, parts):
            card = Card.objects.filter(owner=self.accounts[who], state="active").first()
            if card:
                try:
                    made = card_split(
                        card_id=card.id, account=self.accounts[who], parts=[p * HOUR for p in parts]
                    )
                    self.codes += [code for _, code in made]
                except ApplicationError:
                    pass

        @rule(who=st.integers(0, 1))
        def gift(self, who):
            card = Card.objects.filter(owner=self.accounts[who], state="active").first()
            if card:
                with contextlib.suppress(ApplicationError):
                    self.codes.append(card_gift(card_id=card.id, account=self.accounts[who])[1])

        @rule(who=st.integers(0, 1))
        def revoke(self, who):
            part = Card.objects.filter(parent__owner=self.accounts[who], state="gifted").first()
            if part:
                card_revoke(card_id=part.id, account=self.accounts[who])

        @rule(days=st.integers(1, 20))
        def expire(self, days):
            card_expire(now=db_now() + timedelta(days=days))

        @invariant()
        def ledger_holds(self):
            if not hasattr(self, "users"):
                return
            assert_ledger_invariants()
            issued, left, burned, expired = _card_hours_balance()
            assert issued == left + burned + expired

    Ledger.TestCase.settings = settings(
        max_examples=12,
        stateful_step_count=25,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )
    Ledger.TestCase().runTest()
