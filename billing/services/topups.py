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

import stripe
from django.conf import settings
from django.db import transaction
from django.db.models.functions import Now
from django.utils.translation import gettext as _

from billing.errors import ValidationFailed
from billing.models import Account, LedgerAccount, TopUp, Transfer
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

log = logging.getLogger(__name__)

PAID_EVENTS = ("checkout.session.completed", "checkout.session.async_payment_succeeded")
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
    idempotency key. Raises ValidationFailed (bounds, amount not in whole minor units, Stripe not set up).
    """
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
    return topup


def topup_webhook_handle(*, payload: bytes, signature: str) -> str:
    """Verify a Stripe webhook on its raw body and apply it. Returns what happened (for logs).

    Raises ValidationFailed on a missing, bad or stale signature. Unknown events change nothing.
    """
    if not settings.STRIPE_WEBHOOK_SECRET:
        raise ValidationFailed("Webhooks are not configured.")
    try:
        event = stripe.Webhook.construct_event(
            payload,
            signature or "",
            settings.STRIPE_WEBHOOK_SECRET,
            tolerance=settings.STRIPE_WEBHOOK_TOLERANCE_SECONDS,
        )
    except (ValueError, stripe.SignatureVerificationError):
        raise ValidationFailed("Bad webhook signature.", code="bad_signature")
    event = json.loads(payload)  # verified above; plain dicts from here on
    if event.get("type") not in PAID_EVENTS:
        return "ignored"
    session = event.get("data", {}).get("object", {})
    if session.get("payment_status") != "paid":
        return "not paid"
    return topup_credit(checkout_session_id=session["id"], amount_total=session.get("amount_total"))


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
    return "credited"


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
