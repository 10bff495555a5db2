"""Billing's part of the demo (``make run``): card burn multipliers per GPU model, a course's card batch
with a few unredeemed codes in ``<data_dir>/demo-codes.txt``, a redeemed 10-hour card for the student,
and 200.00 in the team "Vision Lab"'s wallet through a real ledger transfer (a promotion, memo "demo").

Idempotent: a second run changes nothing that is already right. Everything is keyed by names (GPU
model names, usernames, the team's account name), so billing needs neither the portal nor the
provisioner here.
"""

from __future__ import annotations

from pathlib import Path

from django.contrib.auth import get_user_model

from billing.models import Account, Card, CardBatch
from billing.services.cards import card_batch_issue, card_redeem
from billing.services.ledger import wallet_for
from billing.services.pricing import burn_multiplier_milli, burn_rate_set
from billing.services.topups import wallet_credit_promotion
from core.units import micros_to_hours

# card-hours burned per hour of a whole card, in thousandths (names as the provisioner's GPU models)
BURN_RATES = [("T4", 500), ("A100-SXM4-80GB", 2000), ("H200", 4000)]
COURSE = "Intro to Deep Learning"
COURSE_HOURS_MICROS = 10_000_000
COURSE_CODES = 6  # one for the student, the rest written to demo-codes.txt
TEAM = "Vision Lab"
TEAM_WALLET_MICROS = 200_000_000
CODES_FILE = "demo-codes.txt"


def seed(*, data_dir: Path | str) -> dict:
    """Create or refresh billing's demo data; returns what is there (for the lines the demo prints)."""
    data_dir = Path(data_dir)
    done: dict = {"burn_rates": {}, "codes_file": str(data_dir / CODES_FILE)}
    for gpu_model, milli in BURN_RATES:
        if burn_multiplier_milli(gpu_model=gpu_model) != milli:
            burn_rate_set(gpu_model=gpu_model, multiplier_milli=milli, reason="demo")
        done["burn_rates"][gpu_model] = milli / 1000

    codes_file = data_dir / CODES_FILE
    student = get_user_model().objects.filter(username="student").first()
    if not CardBatch.objects.filter(label=COURSE).exists() or not codes_file.exists():
        # codes are stored only as hashes: a batch whose codes file is gone gets a fresh one
        _, codes = card_batch_issue(
            hours_micros=COURSE_HOURS_MICROS, count=COURSE_CODES, valid_days=90, max_parts=3, label=COURSE
        )
        if student is not None and not _has_course_card(student):
            card_redeem(user=student, account=student.account, code=codes.pop(0))
        data_dir.mkdir(parents=True, exist_ok=True)
        codes_file.write_text(
            f"# unredeemed invite codes of the card batch “{COURSE}” "
            f"({micros_to_hours(COURSE_HOURS_MICROS)} h each); redeem one at /cards/\n"
            + "\n".join(codes)
            + "\n"
        )
        codes_file.chmod(0o600)
    done["codes"] = [line for line in codes_file.read_text().splitlines() if line and line[0] != "#"]
    done["student_card"] = bool(student and _has_course_card(student))

    team = Account.objects.filter(kind=Account.Kind.TEAM, name=TEAM).order_by("id").first()
    if team is not None:
        wallet_credit_promotion(
            account=team,
            amount_micros=TEAM_WALLET_MICROS,
            idempotency_key=f"demo:team-wallet:{team.pk}",
            memo="demo",
        )
        done["team_wallet_micros"] = wallet_for(account=team).balance_micros
    return done


def _has_course_card(user) -> bool:
    return Card.objects.filter(batch__label=COURSE, redeemed_by=user, parent__isnull=True).exists()


def demo_billing(*, url: str, data_dir: Path) -> list[str]:
    """The lines ``make run`` prints about what this step seeded (idempotent)."""
    done = seed(data_dir=data_dir)
    rates = ", ".join(f"{model} ×{multiplier:g}" for model, multiplier in done["burn_rates"].items())
    lines = [f"card burn rates:    {rates}"]
    if done["student_card"]:
        lines.append(
            f"student:            a redeemed {micros_to_hours(COURSE_HOURS_MICROS)}-hour card “{COURSE}”"
        )
    lines.append(
        f"invite codes:       {len(done['codes'])} unredeemed in {done['codes_file']} ({url}/cards/)"
    )
    if "team_wallet_micros" in done:
        lines.append(f"team wallet:        {TEAM} {done['team_wallet_micros'] / 1_000_000:.2f}")
    return lines
