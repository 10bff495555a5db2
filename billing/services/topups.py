"""Wallet top-ups by card payment through Stripe Checkout, and promotional credits.

The Checkout Session is created before anything is written (never a lock held across the network
call); the wallet is credited only by the signed webhook, exactly once per Checkout Session: the
transfer's idempotency key is the session id, and the TopUp row is locked while it is credited.
A credit first pays back the account's overdraft.
"""

from __future__ import annotations

import json
import logging
from decimal import Decimal, InvalidOperation
from functools import partial

import stripe
from django.conf import settings
from django.db import connection, transaction
from django.db.models.functions import Now
from django.urls import reverse
from django.utils.translation import gettext as _

from billing.audit import audit_record
from billing.models import Account, LedgerAccount, StripeEvent, TopUp, TopUpDispute, Transfer
from billing.permissions import topup_manager_require
from billing.rules import account_managers
from billing.services.ledger import (
    Leg,
    lock_accounts,
    money_unit,
    overdraft_for,
    overdraft_recover_locked,
    post_legs_locked,
    system_account,
    wallet_for,
)
from core.errors import ValidationFailed
from notices.services import notify

log = logging.getLogger(__name__)

ZERO_DECIMAL = {"JPY"}


def minor_units_per_major(currency: str) -> int:
    return 1 if currency.upper() in ZERO_DECIMAL else 100


def amount_parse(*, amount_micros: object = None, amount: object = None, currency: str | None = None) -> int:
    """Micros from either an integer ``amount_micros`` or a decimal string ``amount`` in the site
    currency. Raises ValidationFailed for anything else (floats, fractions of a micro, other currencies)."""
    if currency is not None and str(currency).upper() != money_unit():
        raise ValidationFailed(
            _("Amounts are in %(unit)s.") % {"unit": money_unit()},
            fields={"currency": f"only {money_unit()} is accepted"},
        )
    if amount_micros is not None and amount is not None:
        raise ValidationFailed(_("Give amount_micros or amount, not both."))
    if amount_micros is not None:
        if isinstance(amount_micros, bool) or not isinstance(amount_micros, int):
            raise ValidationFailed(
                _("amount_micros must be a whole number."), fields={"amount_micros": "not a whole number"}
            )
        return amount_micros
    if not isinstance(amount, str) or len(amount) > 32:
        raise ValidationFailed(
            _("Give the amount as a decimal string."), fields={"amount": "not a decimal string"}
        )
    try:
        value = Decimal(amount.strip())
    except InvalidOperation:
        raise ValidationFailed(_("The amount is not a number."), fields={"amount": "not a number"})
    if not value.is_finite():
        raise ValidationFailed(_("The amount is not a number."), fields={"amount": "not a number"})
    micros = value * 1_000_000
    if micros != micros.to_integral_value():
        raise ValidationFailed(
            _("The amount has more decimals than a micro-unit."), fields={"amount": "too precise"}
        )
    return int(micros)


def _stripe_client() -> None:
    if settings.STRIPE_API_BASE:
        stripe.api_base = settings.STRIPE_API_BASE
    stripe.api_key = settings.STRIPE_SECRET_KEY


def topup_create(
    *, account: Account, amount_micros: int, actor=None, idempotency_key: str | None = None
) -> TopUp:
    """Start a top-up: create a Stripe Checkout Session (mode=payment) for ``amount_micros`` and record
    it as a pending TopUp. Nothing is credited here (the webhook does). The Stripe call carries an
    idempotency key. Raises ValidationFailed (bounds, amount not in whole minor units, Stripe not set up),
    Forbidden ``team_role_required`` (a plain member of the team whose account it is). A team's top-up
    leaves an audit row.
    """
    topup_manager_require(actor=actor, account=account)
    if isinstance(amount_micros, bool) or not isinstance(amount_micros, int) or amount_micros <= 0:
        raise ValidationFailed(_("The amount must be more than zero."), fields={"amount": "must be > 0"})
    if not settings.TOPUP_MIN_MICROS <= amount_micros <= settings.TOPUP_MAX_MICROS:
        low, high = settings.TOPUP_MIN_MICROS / 1e6, settings.TOPUP_MAX_MICROS / 1e6
        raise ValidationFailed(
            _("A top-up is between %(low)s and %(high)s %(unit)s.")
            % {"low": f"{low:g}", "high": f"{high:g}", "unit": money_unit()},
            fields={"amount": "out of bounds"},
        )
    currency = money_unit()
    per_minor = 1_000_000 // minor_units_per_major(currency)
    if amount_micros % per_minor:
        raise ValidationFailed(_("Card payments go in whole cents."), fields={"amount": "not whole cents"})
    if not settings.STRIPE_SECRET_KEY:
        raise ValidationFailed(
            _("Card payments are not configured on this site."), code="payments_unavailable"
        )
    _stripe_client()
    wallet_url = settings.SITE_URL.rstrip("/") + "/wallet/"
    try:
        session = stripe.checkout.Session.create(
            mode="payment",
            line_items=[
                {
                    "quantity": 1,
                    "price_data": {
                        "currency": currency.lower(),
                        "unit_amount": amount_micros // per_minor,
                        "product_data": {"name": f"Suanli wallet top-up ({account.name})"},
                    },
                }
            ],
            success_url=wallet_url + "?topup=success&session_id={CHECKOUT_SESSION_ID}",
            cancel_url=wallet_url + "?topup=cancelled",
            client_reference_id=str(account.id),
            metadata={"account_id": str(account.id), "amount_micros": str(amount_micros)},
            idempotency_key=idempotency_key,
        )
    except stripe.StripeError as exc:
        log.warning("stripe checkout creation failed: %s", exc)
        raise ValidationFailed(
            _("The payment provider refused the top-up; try again later."), code="payment_error"
        )
    session = session.to_dict()
    with transaction.atomic():
        topup, _created = TopUp.objects.get_or_create(
            checkout_session_id=session["id"],
            defaults={
                "account": account,
                "amount_micros": amount_micros,
                "currency": currency,
                "checkout_url": session.get("url") or "",
                "created_by": actor if getattr(actor, "pk", None) else None,
            },
        )
        if _created and account.kind == Account.Kind.TEAM:
            audit_record(
                actor=actor,
                action="wallet.topup_create",
                target=account,
                after={"topup_id": topup.id, "amount_micros": amount_micros, "currency": currency},
            )
    return topup


def topup_webhook_handle(*, payload: bytes, signature: str) -> str:
    """Verify a Stripe webhook on its raw body and apply it, once per event id. Returns what happened
    (for logs and the response body).

    Raises ValidationFailed on a missing, bad or stale signature. Events outside ``EVENT_HANDLERS`` are
    acknowledged and logged and change nothing; so is a handled event with no object to act on.
    """
    if not settings.STRIPE_WEBHOOK_SECRET:
        raise ValidationFailed("Webhooks are not configured.")
    try:
        stripe.Webhook.construct_event(
            payload,
            signature or "",
            settings.STRIPE_WEBHOOK_SECRET,
            tolerance=settings.STRIPE_WEBHOOK_TOLERANCE_SECONDS,
        )
    except (ValueError, stripe.SignatureVerificationError):
        raise ValidationFailed("Bad webhook signature.", code="bad_signature")
    event = json.loads(payload)  # verified above; plain dicts from here on
    kind = event.get("type")
    handler = EVENT_HANDLERS.get(kind)
    if handler is None:
        log.info("stripe event %s of type %s acknowledged, not handled", event.get("id"), kind)
        return "ignored"
    obj = (event.get("data") or {}).get("object")
    event_id = event.get("id")
    if not isinstance(obj, dict) or not isinstance(obj.get("id"), str) or not isinstance(event_id, str):
        log.warning("stripe event %s of type %s has no object to act on", event_id, kind)
        return "malformed"
    with transaction.atomic():
        record, created = StripeEvent.objects.get_or_create(
            event_id=event_id,
            defaults={"type": kind, "payment_intent_id": _payment_intent(obj), "payload": event},
        )
        if not created:
            return "duplicate"
        outcome = handler(obj)
        record.outcome = outcome
        if outcome != WAITING:
            record.applied_at = Now()
        record.save(update_fields=["outcome", "applied_at"])
    return outcome


WAITING = "waiting for its payment"


def _payment_intent(obj: dict) -> str:
    """The PaymentIntent id a checkout session, charge or dispute names (expanded or not)."""
    value = obj.get("payment_intent")
    if isinstance(value, dict):
        value = value.get("id")
    return value if isinstance(value, str) else ""


def _micros(topup: TopUp, minor: object) -> int | None:
    if isinstance(minor, bool) or not isinstance(minor, int) or minor < 0:
        return None
    return minor * (1_000_000 // minor_units_per_major(topup.currency))


def _checkout_paid(session: dict) -> str:
    """``checkout.session.completed`` / ``…async_payment_succeeded``: credit the wallet once it is paid
    (a completed session paid by a delayed method stays pending until its async event)."""
    with transaction.atomic():
        payment_intent = _payment_intent(session)
        if payment_intent:
            _lock_payment(payment_intent)  # lock order: payment, top-up, ledger accounts
        topup = TopUp.objects.select_for_update().filter(checkout_session_id=session["id"]).first()
        if topup is None:
            log.warning("checkout session %s matches no top-up", session["id"])
            return "unknown session"
        if payment_intent and not topup.payment_intent_id:
            topup.payment_intent_id = payment_intent
            topup.save(update_fields=["payment_intent_id"])
        if session.get("payment_status") != "paid":
            return "not paid"
        outcome = topup_credit(checkout_session_id=session["id"], amount_total=session.get("amount_total"))
        if outcome == "credited" and topup.payment_intent_id:
            _apply_waiting(topup.payment_intent_id)
        return outcome


def _checkout_closed(session: dict, *, state: str) -> str:
    """``checkout.session.expired`` / ``…async_payment_failed``: the top-up will never be paid."""
    topup = TopUp.objects.select_for_update().filter(checkout_session_id=session["id"]).first()
    if topup is None:
        log.warning("checkout session %s matches no top-up", session["id"])
        return "unknown session"
    if topup.state == TopUp.State.PAID:
        return "already paid"  # the money arrived; a stale close changes nothing
    if topup.state == state:
        return f"already {state}"
    topup.state = state
    topup.closed_at = Now()
    topup.save(update_fields=["state", "closed_at"])
    return state


def _lock_payment(payment_intent: str) -> None:
    """Serialise everything about one payment (transaction-scoped advisory lock). Without it a refund
    could look for its top-up just before a concurrent checkout links it, and wait forever."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", [f"stripe:{payment_intent}"])


def _paid_topup(obj: dict) -> TopUp | None:
    """The paid top-up a charge or dispute is about, locked; None while it is not (yet) known as paid."""
    payment_intent = _payment_intent(obj)
    if not payment_intent:
        return None
    _lock_payment(payment_intent)
    topup = TopUp.objects.select_for_update().filter(payment_intent_id=payment_intent).first()
    return topup if topup is not None and topup.state == TopUp.State.PAID else None


def _charge_refunded(charge: dict) -> str:
    """``charge.refunded``: take back what Stripe refunded so far (``amount_refunded`` is cumulative,
    so a replay or an older event moves nothing), from the wallet and, past it, into overdraft."""
    topup = _paid_topup(charge)
    if topup is None:
        return WAITING
    total = _micros(topup, charge.get("amount_refunded"))
    if total is None:
        log.warning("charge %s has no amount_refunded", charge["id"])
        return "malformed"
    total = min(total, topup.amount_micros)
    delta = total - topup.refunded_micros
    if delta <= 0:
        return "already refunded"
    _reverse_locked(
        account=topup.account,
        amount_micros=delta,
        target_kind=LedgerAccount.Kind.PAYMENT_CLEARING,
        transfer_kind=Transfer.Kind.REFUND,
        key=f"refund:{topup.checkout_session_id}:{total}",
        memo="card payment refunded",
    )
    topup.refunded_micros = total
    topup.save(update_fields=["refunded_micros"])
    return "refunded"


def _dispute_amount(topup: TopUp, dispute: dict) -> int:
    amount = _micros(topup, dispute.get("amount"))
    return min(amount or topup.amount_micros, topup.amount_micros)


def _dispute_created(dispute: dict) -> str:
    """``charge.dispute.created``: hold the disputed amount out of the wallet until the dispute closes."""
    topup = _paid_topup(dispute)
    if topup is None:
        return WAITING
    record, created = TopUpDispute.objects.get_or_create(
        dispute_id=dispute["id"], defaults={"topup": topup, "amount_micros": _dispute_amount(topup, dispute)}
    )
    if not created:
        return "already known"
    _reverse_locked(
        account=topup.account,
        amount_micros=record.amount_micros,
        target_kind=LedgerAccount.Kind.DISPUTES,
        transfer_kind=Transfer.Kind.DISPUTE_HOLD,
        key=f"dispute:{record.dispute_id}:hold",
        memo="card payment disputed: held",
    )
    record.held = True
    record.save(update_fields=["held"])
    return "held"


DISPUTE_WON = ("won", "warning_closed")


def _dispute_closed(dispute: dict) -> str:
    """``charge.dispute.closed``: a won dispute releases the hold to the wallet; a lost one gives the
    held amount back to the payer (taken from the wallet directly if the hold never happened)."""
    status = dispute.get("status")
    if status not in (*DISPUTE_WON, "lost"):
        log.warning("dispute %s closed with status %r; nothing to do", dispute["id"], status)
        return "not closed"
    topup = _paid_topup(dispute)
    if topup is None:
        return WAITING
    record, _created = TopUpDispute.objects.get_or_create(
        dispute_id=dispute["id"], defaults={"topup": topup, "amount_micros": _dispute_amount(topup, dispute)}
    )
    if record.state != TopUpDispute.State.OPEN:
        return "already closed"
    key = f"dispute:{record.dispute_id}"
    if status in DISPUTE_WON:
        if record.held:
            _credit_locked(
                account=topup.account,
                amount_micros=record.amount_micros,
                source_kind=LedgerAccount.Kind.DISPUTES,
                transfer_kind=Transfer.Kind.DISPUTE_RELEASE,
                key=f"{key}:release",
                memo="dispute won: payment released",
            )
        record.state = TopUpDispute.State.WON
    else:
        if record.held:
            pool = system_account(kind=LedgerAccount.Kind.DISPUTES)
            clearing = system_account(kind=LedgerAccount.Kind.PAYMENT_CLEARING)
            locked = lock_accounts([pool.id, clearing.id])
            amount, kind = record.amount_micros, Transfer.Kind.DISPUTE_LOST
            leg = Leg(pool.id, clearing.id, amount, kind, f"{key}:lost", "dispute lost")
            post_legs_locked(legs=[leg], locked=locked)
        else:
            _reverse_locked(
                account=topup.account,
                amount_micros=record.amount_micros,
                target_kind=LedgerAccount.Kind.PAYMENT_CLEARING,
                transfer_kind=Transfer.Kind.DISPUTE_LOST,
                key=f"{key}:lost",
                memo="dispute lost",
            )
        record.state = TopUpDispute.State.LOST
    record.closed_at = Now()
    record.save(update_fields=["state", "closed_at"])
    return record.state


EVENT_HANDLERS = {
    "checkout.session.completed": _checkout_paid,
    "checkout.session.async_payment_succeeded": _checkout_paid,
    "checkout.session.expired": partial(_checkout_closed, state=TopUp.State.EXPIRED),
    "checkout.session.async_payment_failed": partial(_checkout_closed, state=TopUp.State.FAILED),
    "charge.refunded": _charge_refunded,
    "charge.dispute.created": _dispute_created,
    "charge.dispute.closed": _dispute_closed,
}


def _apply_waiting(payment_intent: str) -> None:
    """Apply, in arrival order, the events that overtook their payment's checkout (locked first)."""
    waiting = StripeEvent.objects.select_for_update().filter(
        payment_intent_id=payment_intent, applied_at__isnull=True
    )
    for record in waiting.order_by("id"):
        handler = EVENT_HANDLERS[record.type]
        record.outcome = handler(record.payload["data"]["object"])
        if record.outcome != WAITING:
            record.applied_at = Now()
        record.save(update_fields=["outcome", "applied_at"])


def topup_credit(*, checkout_session_id: str, amount_total: int | None) -> str:
    """Credit a paid Checkout Session's top-up to its wallet, once: payment_clearing → wallet, then the
    overdraft is paid back. Locks the TopUp row, then the ledger accounts (id order)."""
    with transaction.atomic():
        topup = TopUp.objects.select_for_update().filter(checkout_session_id=checkout_session_id).first()
        if topup is None:
            log.warning("paid checkout session %s matches no top-up", checkout_session_id)
            return "unknown session"
        if topup.state == TopUp.State.PAID:
            return "already credited"
        per_minor = 1_000_000 // minor_units_per_major(topup.currency)
        if amount_total is not None and int(amount_total) * per_minor != topup.amount_micros:
            log.error(
                "checkout session %s paid %s, expected %s",
                checkout_session_id,
                amount_total,
                topup.amount_micros,
            )
            return "amount mismatch"
        _credit_locked(
            account=topup.account,
            amount_micros=topup.amount_micros,
            source_kind=LedgerAccount.Kind.PAYMENT_CLEARING,
            transfer_kind=Transfer.Kind.TOPUP,
            key=f"topup:{checkout_session_id}",
            memo="card top-up",
        )
        topup.state = TopUp.State.PAID
        topup.paid_at = Now()
        topup.save(update_fields=["state", "paid_at"])
        _credited_notify(topup)
    return "credited"


def _credited_notify(topup: TopUp) -> None:
    """Whoever paid and the account's managers are told the money arrived (``topup_credited``)."""
    notify(
        users=[*account_managers(account=topup.account), topup.created_by_id],
        kind="topup_credited",
        key="topup_credited",
        params={
            "amount": f"{Decimal(topup.amount_micros) / 1_000_000:.2f}",
            "currency": topup.currency.upper(),
            "account": topup.account.name,
        },
        dedupe_key=f"topup:{topup.id}:credited",
        url=reverse("wallet"),
    )


def _credit_locked(
    *,
    account: Account,
    amount_micros: int,
    source_kind: str,
    transfer_kind: str,
    key: str,
    memo: str,
    actor=None,
) -> Transfer | None:
    source = system_account(kind=source_kind)
    wallet, overdraft = wallet_for(account=account), overdraft_for(account=account)
    locked = lock_accounts([source.id, wallet.id, overdraft.id])
    if Transfer.objects.filter(idempotency_key=key).exists():
        return None
    (transfer,) = post_legs_locked(
        legs=[Leg(source.id, wallet.id, amount_micros, transfer_kind, key, memo)], locked=locked, actor=actor
    )
    overdraft_recover_locked(account_id=account.id, locked=locked, key=f"{key}:overdraft")
    return transfer


def _reverse_locked(
    *, account: Account, amount_micros: int, target_kind: str, transfer_kind: str, key: str, memo: str
) -> None:
    """Take ``amount_micros`` back out of an account into the system account ``target_kind``: from
    the wallet as far as it goes, the rest into overdraft (which blocks launches until it is paid)."""
    target = system_account(kind=target_kind)
    wallet, overdraft = wallet_for(account=account), overdraft_for(account=account)
    locked = lock_accounts([target.id, wallet.id, overdraft.id])
    if Transfer.objects.filter(idempotency_key__in=[f"{key}:wallet", f"{key}:overdraft"]).exists():
        return
    from_wallet = min(locked[wallet.id].balance_micros, amount_micros)
    legs = [
        Leg(wallet.id, target.id, from_wallet, transfer_kind, f"{key}:wallet", memo),
        Leg(overdraft.id, target.id, amount_micros - from_wallet, transfer_kind, f"{key}:overdraft", memo),
    ]
    post_legs_locked(legs=legs, locked=locked)


def wallet_credit_promotion(
    *, account: Account, amount_micros: int, idempotency_key: str, memo: str = "", actor=None
) -> Transfer | None:
    """Credit promotional money (demo seeds, goodwill) to a wallet, once per key; pays back the
    overdraft first. Raises ValidationFailed for a non-positive amount."""
    if isinstance(amount_micros, bool) or not isinstance(amount_micros, int) or amount_micros <= 0:
        raise ValidationFailed(_("The amount must be more than zero."))
    with transaction.atomic():
        return _credit_locked(
            account=account,
            amount_micros=amount_micros,
            source_kind=LedgerAccount.Kind.PROMOTIONS,
            transfer_kind=Transfer.Kind.PROMOTION,
            key=f"promo:{idempotency_key}",
            memo=memo or "promotion",
            actor=actor,
        )
