"""Reads of the billing app: funds, wallets, ledger history, prices, cards."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from django.conf import settings
from django.db import connection
from django.db.models import Q, QuerySet
from django.db.models.functions import Now
from django.utils.translation import gettext as _

from billing.models import (
    Account,
    Card,
    Entry,
    LedgerHold,
    StripeEvent,
    TopUp,
    TopUpDispute,
    accrued_now_sql,
)
from billing.rules import accounts_payable_by
from core.errors import NotFound


@dataclass(frozen=True)
class Funds:
    wallet_micros: int
    overdraft_micros: int  # ≤ 0: what the account owes
    cards_micros: int  # card-hour micros on active, unexpired cards (usable for gpu_model, when given)
    accrued_micros: int  # billed but not yet posted, on open meters
    burn_micros_per_hour: int  # money rate of the account's open meters
    card_burn_micros_per_hour: int
    cards_count: int = 0  # how many cards ``cards_micros`` sums

    @property
    def money_micros(self) -> int:
        return self.wallet_micros + self.overdraft_micros

    @property
    def available_micros(self) -> int:
        return self.money_micros - self.accrued_micros

    @property
    def runway_seconds(self) -> int | None:
        """Seconds until the account's running sessions exhaust cards and wallet; None when nothing runs."""
        if self.burn_micros_per_hour <= 0:
            return None
        card_seconds = (
            self.cards_micros * 3600 // self.card_burn_micros_per_hour
            if self.card_burn_micros_per_hour
            else 0
        )
        return max(0, card_seconds + self.available_micros * 3600 // self.burn_micros_per_hour)


def usable_cards(*, account: Account, gpu_model: str | None = None) -> QuerySet[Card]:
    cards = Card.objects.filter(owner=account, state=Card.State.ACTIVE).filter(
        Q(expires_at__isnull=True) | Q(expires_at__gt=Now())
    )
    if gpu_model is not None:
        cards = cards.filter(Q(gpu_models=[]) | Q(gpu_models__contains=[gpu_model]))
    return cards


# ``usable_cards`` and the wallet and meter sums in one statement, written out: the ORM takes ~7 ms of
# Python to compile them as subqueries, many times what the query costs, and this runs inside every
# launch's transaction. tests/billing/test_funds.py holds it equal to ``usable_cards``.
_FUNDS = f"""
SELECT
    COALESCE((SELECT balance_micros FROM billing_ledgeraccount
              WHERE owner_id = %(account)s AND unit = %(unit)s AND kind = 'wallet'), 0),
    COALESCE((SELECT balance_micros FROM billing_ledgeraccount
              WHERE owner_id = %(account)s AND unit = %(unit)s AND kind = 'overdraft'), 0),
    COALESCE((SELECT SUM(ledger.balance_micros)::bigint
              FROM billing_card card JOIN billing_ledgeraccount ledger ON ledger.id = card.ledger_account_id
              WHERE card.owner_id = %(account)s AND card.state = 'active'
                AND (card.expires_at IS NULL OR card.expires_at > statement_timestamp())
                AND (%(gpu_model)s::text IS NULL OR card.gpu_models = '[]'::jsonb
                     OR card.gpu_models @> jsonb_build_array(%(gpu_model)s::text))), 0),
    COALESCE(SUM({accrued_now_sql()}), 0)::bigint,
    COALESCE(SUM(price_micros_per_hour), 0)::bigint,
    COALESCE(SUM(card_burn_micros_per_hour), 0)::bigint,
    (SELECT count(*) FROM billing_card card
     WHERE card.owner_id = %(account)s AND card.state = 'active'
       AND (card.expires_at IS NULL OR card.expires_at > statement_timestamp())
       AND (%(gpu_model)s::text IS NULL OR card.gpu_models = '[]'::jsonb
            OR card.gpu_models @> jsonb_build_array(%(gpu_model)s::text)))
FROM billing_meter
WHERE account_id = %(account)s AND state = 'open'
"""  # noqa: S608 (no input in the f-string: billing.models' SQL for accruals as of now)


def account_funds(*, account: Account, gpu_model: str | None = None) -> Funds:
    """What ``account`` has and spends now, in one query; cards only those usable for ``gpu_model``."""
    with connection.cursor() as cursor:
        cursor.execute(
            _FUNDS, {"account": account.pk, "unit": settings.SITE_CURRENCY, "gpu_model": gpu_model}
        )
        wallet, overdraft, cards, accrued, price, burn, cards_count = cursor.fetchone()
    return Funds(
        wallet_micros=wallet,
        overdraft_micros=overdraft,
        cards_micros=cards,
        accrued_micros=accrued,
        burn_micros_per_hour=price,
        card_burn_micros_per_hour=burn,
        cards_count=cards_count,
    )


def account_for_user(*, user, account_id: int | str | None = None) -> Account:
    """The caller's own account, or a team account they belong to; anything else is NotFound."""
    if account_id in (None, ""):
        if not getattr(user, "account_id", None):
            raise NotFound(_("No such account."))
        return user.account
    try:
        wanted = int(account_id)
    except (TypeError, ValueError):
        raise NotFound(_("No such account."))
    for account in accounts_payable_by(user=user):
        if account.id == wanted:
            return account
    raise NotFound(_("No such account."))


def ledger_entries(
    *,
    account: Account,
    kind: str | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
) -> QuerySet[Entry]:
    """An account's ledger history (wallet, overdraft and its cards), newest first."""
    entries = (
        Entry.objects.filter(account__owner=account)
        .select_related("transfer", "account", "transfer__meter")
        .order_by("-transfer__created_at", "-id")
    )
    if kind:
        entries = entries.filter(transfer__kind=kind)
    if since:
        entries = entries.filter(transfer__created_at__gte=since)
    if until:
        entries = entries.filter(transfer__created_at__lt=until)
    return entries


def cards_for_account(*, account: Account) -> QuerySet[Card]:
    """The account's cards and the unredeemed parts it made from them."""
    return (
        Card.objects.filter(Q(owner=account) | Q(parent__owner=account, state=Card.State.GIFTED))
        .select_related("ledger_account")
        .order_by("expires_at", "id")
    )


def card_lineage(*, card: Card) -> list[dict]:
    """Where a card came from, root first: batch, parent, who gifted and redeemed it (usernames only)."""
    chain = []
    current: Card | None = card
    while current is not None:
        chain.append(
            {
                "card_id": current.id,
                "batch": current.batch.label or f"batch {current.batch_id}",
                "parent_id": current.parent_id,
                "gifted_by": current.gifted_by.get_username() if current.gifted_by_id else None,
                "redeemed_by": current.redeemed_by.get_username() if current.redeemed_by_id else None,
                "redeemed_at": current.redeemed_at,
            }
        )
        current = current.parent
    return list(reversed(chain))


def card_detail(*, account: Account, card_id: int) -> dict:
    card = cards_for_account(account=account).select_related("batch", "parent", "gifted_by", "redeemed_by")
    card = card.filter(id=card_id).first()
    if card is None:
        raise NotFound(_("No such card."))
    return {
        "id": card.id,
        "state": card.state,
        "hours_micros": card.hours_micros,
        "hours_left_micros": card.ledger_account.balance_micros,
        "gpu_models": card.gpu_models,
        "expires_at": card.expires_at,
        "max_parts": card.max_parts,
        "parts": [
            {"id": p.id, "state": p.state, "hours_micros": p.hours_micros} for p in card.parts.order_by("id")
        ],
        "lineage": card_lineage(card=card),
    }


@dataclass(frozen=True)
class TopUpRow:
    """A top-up as its payer sees it: what Stripe last said, in words."""

    topup: TopUp
    status: str  # pending, paid, expired, failed, refunded, partly_refunded, disputed, dispute_lost
    label: str
    note: str


def _topup_row(topup: TopUp) -> TopUpRow:
    disputes = {d.state for d in topup.disputes.all()}
    refunded = topup.refunded_micros
    if topup.state == TopUp.State.PENDING:
        return TopUpRow(topup, "pending", _("Pending"), _("Waiting for the payment to be confirmed."))
    if topup.state == TopUp.State.EXPIRED:
        note = _("The payment page closed or timed out before paying; nothing was charged.")
        return TopUpRow(topup, "expired", _("Expired"), note)
    if topup.state == TopUp.State.FAILED:
        note = _("The bank did not confirm the payment; nothing was credited.")
        return TopUpRow(topup, "failed", _("Payment failed"), note)
    if TopUpDispute.State.OPEN in disputes:
        note = _("The card holder disputed this payment; the amount is held until the dispute closes.")
        return TopUpRow(topup, "disputed", _("Disputed"), note)
    if TopUpDispute.State.LOST in disputes:
        note = _("The dispute was lost; the amount went back to the card holder.")
        return TopUpRow(topup, "dispute_lost", _("Dispute lost"), note)
    if refunded and refunded >= topup.amount_micros:
        note = _("Refunded to the card; the amount left the wallet.")
        return TopUpRow(topup, "refunded", _("Refunded"), note)
    if refunded:
        note = _("%(amount)s %(unit)s was refunded to the card and left the wallet.") % {
            "amount": f"{refunded / 1_000_000:.2f}",
            "unit": topup.currency,
        }
        return TopUpRow(topup, "partly_refunded", _("Partly refunded"), note)
    return TopUpRow(topup, "paid", _("Paid"), _("Credited to the wallet."))


def topups_recent(*, account: Account, limit: int = 10) -> list[TopUpRow]:
    """The account's latest top-ups with their state in words, newest first (two queries)."""
    topups = TopUp.objects.filter(account=account).prefetch_related("disputes").order_by("-created_at", "-id")
    return [_topup_row(t) for t in topups[:limit]]


@dataclass(frozen=True)
class LedgerHealth:
    holds_by_kind: dict[str, int]
    stripe_events_waiting: int


def ledger_health() -> LedgerHealth:
    """What the reconciliation left open and the Stripe events still waiting for their payment."""
    counts = dict.fromkeys(LedgerHold.Kind.values, 0)
    open_holds = LedgerHold.objects.filter(resolved_at__isnull=True).values_list("kind", flat=True)
    for kind in open_holds:
        counts[kind] += 1
    waiting = StripeEvent.objects.filter(applied_at__isnull=True).count()
    return LedgerHealth(holds_by_kind=counts, stripe_events_waiting=waiting)
