"""billing.demo.seed: idempotent demo data for ``make run``."""

from __future__ import annotations

import pytest

from billing import demo
from billing.models import Card, CardBatch, Transfer
from billing.services.cards import card_redeem
from billing.services.ledger import wallet_for
from billing.services.pricing import burn_multiplier_milli
from portal.models import Team
from portal.services import team_create, user_create
from tests.billing.conftest import assert_ledger_invariants

pytestmark = pytest.mark.django_db


def test_seed_is_idempotent_and_leaves_a_consistent_ledger(tmp_path):
    student = user_create(username="student", email="", password="a-long-pass-phrase-9")
    lead = user_create(username="teamlead", email="", password="a-long-pass-phrase-9")
    team = team_create(creator=lead, name="Vision Lab")
    first = demo.seed(data_dir=tmp_path)
    second = demo.seed(data_dir=tmp_path)
    assert first["codes"] == second["codes"] and len(first["codes"]) == demo.COURSE_CODES - 1
    assert (tmp_path / "demo-codes.txt").read_text().count("-") >= 4 * len(first["codes"])
    assert CardBatch.objects.filter(label=demo.COURSE).count() == 1
    card = Card.objects.get(redeemed_by=student)
    assert card.ledger_account.balance_micros == 10_000_000 and card.owner == student.account
    assert wallet_for(account=Team.objects.get(pk=team.pk).account).balance_micros == 200_000_000
    assert Transfer.objects.filter(kind="promotion").count() == 1
    assert {m: burn_multiplier_milli(gpu_model=m) for m in ("T4", "A100-SXM4-80GB", "H200")} == {
        "T4": 500,
        "A100-SXM4-80GB": 2000,
        "H200": 4000,
    }
    other = user_create(username="classmate", email="", password="a-long-pass-phrase-9")
    assert card_redeem(user=other, account=other.account, code=first["codes"][0]).state == "active"
    assert_ledger_invariants()
