from __future__ import annotations

from django.conf import settings
from django.db import models
from django.db.models.functions import Coalesce, Now
from django.utils.translation import gettext_lazy as _

from core.choices import ChoiceLabels


class Account(ChoiceLabels, models.Model):
    """Who pays: every user has one, every team has one."""

    class Kind(models.TextChoices):
        USER = "user", _("User")
        TEAM = "team", _("Team")

    kind = models.CharField(max_length=8, choices=Kind.choices)
    name = models.CharField(max_length=150)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        indexes = [models.Index(fields=["kind", "name"])]

    def __str__(self) -> str:
        return f"{self.get_kind_display()} account {self.name}"


class AuditEntry(models.Model):
    """One admin or money action: who did what to which object, with the state before and after."""

    actor = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    action = models.CharField(max_length=64)
    target_type = models.CharField(max_length=64)
    target_id = models.CharField(max_length=64)
    before = models.JSONField(null=True, blank=True)
    after = models.JSONField(null=True, blank=True)
    reason = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)

    class Meta:
        verbose_name_plural = "audit entries"
        indexes = [models.Index(fields=["target_type", "target_id"])]

    def __str__(self) -> str:
        return f"{self.action} on {self.target_type}:{self.target_id} by {self.actor_id}"


# --- the ledger ---------------------------------------------------------------------------------------

CARD_UNIT = "CARD_H"  # micro card-hours of the reference GPU


class LedgerAccount(ChoiceLabels, models.Model):
    """One balance in one unit. Changed only by transfers; ``balance_micros`` caches the sum of its entries.

    Wallets and cards never go below zero (the database refuses it); an account's overdraft never goes
    above zero: it is what the account owes, recovered from its next top-up.
    """

    class Kind(models.TextChoices):
        WALLET = "wallet", _("Wallet")
        CARD = "card", _("Compute card")
        OVERDRAFT = "overdraft", _("Overdraft")
        REVENUE = "revenue", _("Revenue")
        PAYMENT_CLEARING = "payment_clearing", _("Payment clearing")
        ADJUSTMENTS = "adjustments", _("Adjustments")
        PROMOTIONS = "promotions", _("Promotions")
        CARD_BURN = "card_burn", _("Card burn")
        CARD_EXPIRY = "card_expiry", _("Card expiry")
        DISPUTES = "disputes", _("Disputed payments held")

    FLOOR_ZERO = (Kind.WALLET, Kind.CARD)
    CEILING_ZERO = (Kind.OVERDRAFT,)
    OWNED = (Kind.WALLET, Kind.OVERDRAFT)

    kind = models.CharField(max_length=24, choices=Kind.choices)
    owner = models.ForeignKey(
        Account, null=True, blank=True, on_delete=models.PROTECT, related_name="ledger_accounts"
    )
    unit = models.CharField(max_length=8)
    balance_micros = models.BigIntegerField(default=0)
    version = models.BigIntegerField(default=0)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [
            models.CheckConstraint(
                condition=~models.Q(kind__in=["wallet", "card"]) | models.Q(balance_micros__gte=0),
                name="ledger_floor_zero",
            ),
            models.CheckConstraint(
                condition=~models.Q(kind="overdraft") | models.Q(balance_micros__lte=0),
                name="ledger_overdraft_ceiling_zero",
            ),
            models.CheckConstraint(
                condition=~models.Q(kind__in=["wallet", "overdraft"]) | models.Q(owner__isnull=False),
                name="ledger_wallet_has_owner",
            ),
            models.UniqueConstraint(
                fields=["owner", "kind", "unit"],
                condition=models.Q(kind__in=["wallet", "overdraft"]),
                name="ledger_one_wallet_per_unit",
            ),
            models.UniqueConstraint(
                fields=["kind", "unit"],
                condition=models.Q(owner__isnull=True) & ~models.Q(kind="card"),
                name="ledger_one_system_account_per_unit",
            ),
        ]
        indexes = [models.Index(fields=["owner", "kind"])]

    def __str__(self) -> str:
        who = self.owner.name if self.owner_id else "system"
        return f"{self.get_kind_display()} {self.unit} ({who})"


class Transfer(ChoiceLabels, models.Model):
    """One movement: ``amount_micros`` leaves ``debit`` and arrives at ``credit``. Never edited."""

    class Kind(models.TextChoices):
        TOPUP = "topup", _("Top-up")
        USAGE = "usage", _("Usage")
        CARD_BURN = "card_burn", _("Card burn")
        OVERDRAFT_RECOVERY = "overdraft_recovery", _("Overdraft recovery")
        ADJUSTMENT = "adjustment", _("Adjustment")
        PROMOTION = "promotion", _("Promotion")
        CARD_ISSUE = "card_issue", _("Card issue")
        CARD_SPLIT = "card_split", _("Card split")
        CARD_REVOKE = "card_revoke", _("Card revoke")
        CARD_EXPIRE = "card_expire", _("Card expiry")
        CARD_GRANT = "card_grant", _("Daily grant")
        REFUND = "refund", _("Refund")
        DISPUTE_HOLD = "dispute_hold", _("Disputed payment held")
        DISPUTE_RELEASE = "dispute_release", _("Dispute won, payment released")
        DISPUTE_LOST = "dispute_lost", _("Dispute lost")
        STORAGE = "storage", _("Home storage")

    debit = models.ForeignKey(LedgerAccount, on_delete=models.PROTECT, related_name="debits")
    credit = models.ForeignKey(LedgerAccount, on_delete=models.PROTECT, related_name="credits")
    amount_micros = models.BigIntegerField()
    unit = models.CharField(max_length=8)
    kind = models.CharField(max_length=24, choices=Kind.choices)
    memo = models.CharField(max_length=200, blank=True)
    actor = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    meter = models.ForeignKey(
        "billing.Meter", null=True, blank=True, on_delete=models.PROTECT, related_name="transfers"
    )
    idempotency_key = models.CharField(max_length=200, unique=True)
    created_at = models.DateTimeField(db_default=Now())

    class Meta:
        constraints = [
            models.CheckConstraint(condition=models.Q(amount_micros__gt=0), name="transfer_amount_positive"),
            models.CheckConstraint(condition=~models.Q(debit=models.F("credit")), name="transfer_two_sides"),
        ]
        indexes = [models.Index(fields=["kind", "created_at"])]

    def __str__(self) -> str:
        return f"{self.kind} {self.amount_micros} {self.unit} #{self.pk}"


class Entry(models.Model):
    """One side of a transfer on one ledger account: signed amount and the balance right after it."""

    transfer = models.ForeignKey(Transfer, on_delete=models.PROTECT, related_name="entries")
    account = models.ForeignKey(LedgerAccount, on_delete=models.PROTECT, related_name="entries")
    amount_micros = models.BigIntegerField()
    balance_after_micros = models.BigIntegerField()

    class Meta:
        verbose_name_plural = "entries"
        indexes = [models.Index(fields=["account", "-id"])]

    def __str__(self) -> str:
        return f"{self.amount_micros:+d} on {self.account_id}"


# --- pricing ------------------------------------------------------------------------------------------


class Price(models.Model):
    """What one hour of ``profile`` on ``gpu_model`` costs from ``effective_from`` on, in micros.

    Slices without their own row cost their fraction of the whole card's price. ``gpu_model`` is empty
    for the GPU-less ``cpu`` profile's site-wide token price. ``interruptible_price_micros_per_hour`` is
    the lower price of the interruptible tier (sessions an on-demand launch may preempt); none: that
    tier is not offered for this profile.
    """

    gpu_model = models.CharField(max_length=64, blank=True)
    profile = models.CharField(max_length=32)
    price_micros_per_hour = models.BigIntegerField()
    interruptible_price_micros_per_hour = models.BigIntegerField(null=True, blank=True)
    effective_from = models.DateTimeField(db_default=Now())
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [
            models.CheckConstraint(
                condition=models.Q(price_micros_per_hour__gte=0), name="price_nonnegative"
            ),
            models.CheckConstraint(
                condition=models.Q(interruptible_price_micros_per_hour__isnull=True)
                | models.Q(
                    interruptible_price_micros_per_hour__gte=0,
                    interruptible_price_micros_per_hour__lte=models.F("price_micros_per_hour"),
                ),
                name="price_interruptible_not_above_on_demand",
            ),
        ]
        indexes = [models.Index(fields=["gpu_model", "profile", "-effective_from"])]

    def __str__(self) -> str:
        return f"{self.gpu_model or 'cpu'} {self.profile}: {self.price_micros_per_hour}/h"


class StoragePrice(models.Model):
    """What one GB (10^9 bytes) of a home above ``free_gb`` costs a month from ``effective_from`` on,
    charged daily (a thirtieth a day). No row: storage is free. ``card_micros_per_gb_month``: card-hour
    micros a GB-month burns from cards not tied to a GPU model, which pay before the wallet; none:
    cards do not pay for storage."""

    price_micros_per_gb_month = models.BigIntegerField()
    card_micros_per_gb_month = models.BigIntegerField(null=True, blank=True)
    free_gb = models.BigIntegerField(default=0)
    effective_from = models.DateTimeField(db_default=Now())
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [
            models.CheckConstraint(
                condition=models.Q(price_micros_per_gb_month__gte=0, free_gb__gte=0)
                & (
                    models.Q(card_micros_per_gb_month__isnull=True)
                    | models.Q(card_micros_per_gb_month__gte=0)
                ),
                name="storage_price_nonnegative",
            ),
        ]
        indexes = [models.Index(fields=["-effective_from"], name="storage_price_current")]

    def __str__(self) -> str:
        return f"storage: {self.price_micros_per_gb_month}/GB-month over {self.free_gb} GB"


class CardBurnRate(models.Model):
    """How many card-hours one hour of a whole ``gpu_model`` burns, in thousandths (T4 500, A100 2000)."""

    gpu_model = models.CharField(max_length=64)
    multiplier_milli = models.PositiveIntegerField()
    effective_from = models.DateTimeField(db_default=Now())
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        indexes = [models.Index(fields=["gpu_model", "-effective_from"])]

    def __str__(self) -> str:
        return f"{self.gpu_model} ×{self.multiplier_milli / 1000:g}"


# --- metering -----------------------------------------------------------------------------------------


def billed_now_sql(
    now: str = "statement_timestamp()",
    *,
    billed: str = "billed_seconds",
    alive: str = "alive_until",
    started: str = "started_at",
    state: str = "state",
) -> str:
    """SQL for the whole seconds a meter has billed as of ``now``: an open meter's run from ``started``
    to min(``now``, ``alive``), never less than what it stored; a closed meter's stored seconds. The
    arguments are SQL: the meter's columns (as named in billing_meter by default, or compiled
    expressions) and the time."""
    return (
        f"(CASE WHEN {state} = 'open' THEN GREATEST({billed}, "
        f"floor(extract(epoch FROM (LEAST({now}, {alive}) - {started})))::bigint) ELSE {billed} END)"
    )


def accrued_now_sql(
    now: str = "statement_timestamp()",
    *,
    price: str = "price_micros_per_hour",
    posted: str = "posted_seconds",
    **columns: str,
) -> str:
    """SQL for the money-equivalent of a meter's seconds billed as of ``now`` but not posted."""
    return f"({price} * {billed_now_sql(now, **columns)} / 3600 - {price} * {posted} / 3600)"


class _MeterNow(models.Func):
    """A meter's figure as of the statement's time, from its columns (see ``billed_now_sql``)."""

    output_field = models.BigIntegerField()
    columns = ("billed_seconds", "alive_until", "started_at", "state")

    def __init__(self) -> None:
        super().__init__(*(models.F(column) for column in self.columns))

    def as_sql(self, compiler, connection, **extra_context):
        sqls, params = [], []
        for expression in self.get_source_expressions():
            sql, more = compiler.compile(expression)
            sqls.append(sql)
            params.extend(more)
        return self.sql_from(*sqls), params


class BilledNow(_MeterNow):
    """``Meter.objects.annotate(billed=BilledNow())``: whole seconds billed as of now."""

    def sql_from(self, billed, alive, started, state) -> str:
        return billed_now_sql(billed=billed, alive=alive, started=started, state=state)


class AccruedNow(_MeterNow):
    """``Meter.objects.annotate(accrued=AccruedNow())``: money for seconds billed as of now, not posted."""

    columns = (*_MeterNow.columns, "price_micros_per_hour", "posted_seconds")

    def sql_from(self, billed, alive, started, state, price, posted) -> str:
        columns = {"billed": billed, "alive": alive, "started": started, "state": state}
        return accrued_now_sql(price=price, posted=posted, **columns)


class Meter(ChoiceLabels, models.Model):
    """The billing side of one session, at the price it launched at.

    Seconds are counted from ``started_at``: ``billed_seconds`` up to the watermark ``billed_until``
    (never past ``alive_until``), ``posted_seconds`` of them posted to the ledger, split into
    ``card_seconds`` (burning cards) and ``wallet_seconds`` (money). Each source's total is
    cumulative: ``charged_micros == price × wallet_seconds // 3600`` and
    ``card_charged_micros == card_burn × card_seconds // 3600``, so rounding never drifts.

    The watermark moves when the meter is posted (once a posting interval) and when it closes; in
    between, what an open meter has run is computed when read (``BilledNow``, ``AccruedNow``), so the
    metering tick writes only the meters it posts.
    """

    class State(models.TextChoices):
        OPEN = "open", _("Open")
        CLOSED = "closed", _("Closed")

    account = models.ForeignKey(Account, on_delete=models.PROTECT, related_name="meters")
    session_ref = models.CharField(max_length=64, unique=True)
    gpu_model = models.CharField(max_length=64, blank=True)
    profile = models.CharField(max_length=32)
    price_id = models.BigIntegerField(null=True, blank=True)
    price_micros_per_hour = models.BigIntegerField()
    card_burn_micros_per_hour = models.BigIntegerField()
    started_at = models.DateTimeField()
    alive_until = models.DateTimeField()
    billed_until = models.DateTimeField()
    ended_at = models.DateTimeField(null=True, blank=True)
    billed_seconds = models.BigIntegerField(default=0)
    posted_seconds = models.BigIntegerField(default=0)
    card_seconds = models.BigIntegerField(default=0)
    wallet_seconds = models.BigIntegerField(default=0)
    charged_micros = models.BigIntegerField(default=0)
    card_charged_micros = models.BigIntegerField(default=0)
    last_posted_at = models.DateTimeField(null=True, blank=True)
    runway_warned_at = models.DateTimeField(null=True, blank=True)
    exhausted_at = models.DateTimeField(null=True, blank=True)
    state = models.CharField(max_length=8, choices=State.choices, default=State.OPEN)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [
            models.CheckConstraint(
                condition=models.Q(posted_seconds__lte=models.F("billed_seconds")),
                name="meter_posted_le_billed",
            ),
            models.CheckConstraint(
                condition=models.Q(posted_seconds=models.F("card_seconds") + models.F("wallet_seconds")),
                name="meter_posted_split",
            ),
            models.CheckConstraint(
                condition=models.Q(price_micros_per_hour__gte=0, card_burn_micros_per_hour__gte=0),
                name="meter_rates_nonnegative",
            ),
        ]
        indexes = [
            models.Index(fields=["account"], condition=models.Q(state="open"), name="meter_open_by_account"),
            # the tick's two look-ups: the meters due for a posting, and the accounts it watches every tick
            # (told their runway is short or gone, or with a meter not yet posted: a new launch)
            models.Index(
                Coalesce("last_posted_at", "started_at"),
                condition=models.Q(state="open"),
                name="meter_open_posted",
            ),
            models.Index(
                fields=["account"],
                condition=models.Q(state="open")
                & (
                    models.Q(runway_warned_at__isnull=False)
                    | models.Q(exhausted_at__isnull=False)
                    | models.Q(last_posted_at__isnull=True)
                ),
                name="meter_open_watched",
            ),
        ]

    def __str__(self) -> str:
        return f"meter {self.session_ref} ({self.gpu_model} {self.profile})"


# --- Stripe top-ups -----------------------------------------------------------------------------------


class TopUp(ChoiceLabels, models.Model):
    """One Stripe Checkout payment into a wallet, and what Stripe said about it afterwards."""

    class State(models.TextChoices):
        PENDING = "pending", _("Pending")
        PAID = "paid", _("Paid")
        EXPIRED = "expired", _("Expired")
        FAILED = "failed", _("Payment failed")

    account = models.ForeignKey(Account, on_delete=models.PROTECT, related_name="topups")
    amount_micros = models.BigIntegerField()
    currency = models.CharField(max_length=3)
    checkout_session_id = models.CharField(max_length=255, unique=True)
    checkout_url = models.URLField(max_length=2000, blank=True)
    state = models.CharField(max_length=8, choices=State.choices, default=State.PENDING)
    # Known once the session completes; refunds and disputes name the payment, not the session.
    payment_intent_id = models.CharField(max_length=255, blank=True, db_index=True)
    refunded_micros = models.BigIntegerField(default=0)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    paid_at = models.DateTimeField(null=True, blank=True)
    closed_at = models.DateTimeField(null=True, blank=True)  # expired or failed

    class Meta:
        constraints = [
            models.CheckConstraint(condition=models.Q(amount_micros__gt=0), name="topup_amount_positive"),
            models.CheckConstraint(
                condition=models.Q(refunded_micros__gte=0, refunded_micros__lte=models.F("amount_micros")),
                name="topup_refund_within_amount",
            ),
        ]

    def __str__(self) -> str:
        return f"top-up {self.amount_micros} {self.currency} ({self.state})"


class TopUpDispute(ChoiceLabels, models.Model):
    """A chargeback on a top-up: the amount is held while it is open, then released or lost."""

    class State(models.TextChoices):
        OPEN = "open", _("Disputed")
        WON = "won", _("Dispute won")
        LOST = "lost", _("Dispute lost")

    dispute_id = models.CharField(max_length=255, unique=True)
    topup = models.ForeignKey(TopUp, on_delete=models.PROTECT, related_name="disputes")
    amount_micros = models.BigIntegerField()
    state = models.CharField(max_length=8, choices=State.choices, default=State.OPEN)
    held = models.BooleanField(default=False)
    created_at = models.DateTimeField(auto_now_add=True)
    closed_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [
            models.CheckConstraint(condition=models.Q(amount_micros__gt=0), name="dispute_amount_positive")
        ]

    def __str__(self) -> str:
        return f"dispute {self.dispute_id} ({self.state})"


class StripeEvent(models.Model):
    """Every signed Stripe event received, once by id. An event about a payment not yet known (a refund
    that overtook its checkout) waits here, unapplied, until the checkout links the payment."""

    event_id = models.CharField(max_length=255, unique=True)
    type = models.CharField(max_length=100)
    payment_intent_id = models.CharField(max_length=255, blank=True)
    payload = models.JSONField()
    outcome = models.CharField(max_length=64, blank=True)
    received_at = models.DateTimeField(auto_now_add=True)
    applied_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        indexes = [
            models.Index(
                fields=["payment_intent_id"],
                condition=models.Q(applied_at__isnull=True),
                name="stripe_waiting",
            )
        ]

    def __str__(self) -> str:
        return f"{self.type} {self.event_id}"


# --- reconciliation -----------------------------------------------------------------------------------


class LedgerHold(ChoiceLabels, models.Model):
    """A mismatch the reconciliation found. While open, the account it names cannot launch; a system
    ledger account's mismatch (no owner) is shown to staff but blocks nobody."""

    class Kind(models.TextChoices):
        BALANCE = "balance", _("Cached balance differs from its entries")
        FLOOR = "floor", _("Balance beyond its floor")
        UNIT = "unit", _("Entries do not sum to zero in a unit")
        TRANSFER = "transfer", _("Transfer without two balancing entries")

    kind = models.CharField(max_length=12, choices=Kind.choices)
    account = models.ForeignKey(
        Account, null=True, blank=True, on_delete=models.PROTECT, related_name="ledger_holds"
    )
    ledger_account = models.ForeignKey(
        LedgerAccount, null=True, blank=True, on_delete=models.PROTECT, related_name="holds"
    )
    subject = models.CharField(max_length=100)  # what is wrong, as a key: "la:12", "unit:CNY", "transfer:7"
    detail = models.JSONField(default=dict)
    found_at = models.DateTimeField(auto_now_add=True)
    resolved_at = models.DateTimeField(null=True, blank=True)
    resolved_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    resolution = models.TextField(blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["kind", "subject"], condition=models.Q(resolved_at__isnull=True), name="one_open_hold"
            )
        ]
        indexes = [
            models.Index(fields=["account"], condition=models.Q(resolved_at__isnull=True), name="hold_open")
        ]

    def __str__(self) -> str:
        return f"{self.kind} hold on {self.subject}"


# --- compute cards ------------------------------------------------------------------------------------


class CardBatch(models.Model):
    """A run of cards issued together (a course, a promotion)."""

    label = models.CharField(max_length=100, blank=True)
    hours_micros = models.BigIntegerField()
    valid_days = models.PositiveIntegerField(null=True, blank=True)  # counted from redemption
    valid_until = models.DateTimeField(null=True, blank=True)  # or a fixed date
    gpu_models = models.JSONField(default=list, blank=True)  # empty: any model
    splittable = models.BooleanField(default=True)
    max_parts = models.PositiveIntegerField(default=3)
    one_per_user = models.BooleanField(default=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        verbose_name_plural = "card batches"
        constraints = [
            models.CheckConstraint(condition=models.Q(hours_micros__gt=0), name="batch_hours_positive"),
            models.CheckConstraint(
                condition=models.Q(valid_days__isnull=False) | models.Q(valid_until__isnull=False),
                name="batch_has_validity",
            ),
        ]

    def __str__(self) -> str:
        return f"batch {self.label or self.pk}"


class Card(ChoiceLabels, models.Model):
    """A compute card: card-hours on its own ledger account, owned by an account once redeemed."""

    class State(models.TextChoices):
        UNREDEEMED = "unredeemed", _("Not redeemed")
        ACTIVE = "active", _("Active")
        GIFTED = "gifted", _("Gifted, waiting for redemption")
        EXPIRED = "expired", _("Expired")
        REVOKED = "revoked", _("Revoked")
        SPENT = "spent", _("Given away")

    ledger_account = models.OneToOneField(LedgerAccount, on_delete=models.PROTECT, related_name="card")
    batch = models.ForeignKey(CardBatch, on_delete=models.PROTECT, related_name="cards")
    parent = models.ForeignKey("self", null=True, blank=True, on_delete=models.PROTECT, related_name="parts")
    owner = models.ForeignKey(Account, null=True, blank=True, on_delete=models.PROTECT, related_name="cards")
    hours_micros = models.BigIntegerField()  # what it held when it was made
    gpu_models = models.JSONField(default=list, blank=True)
    max_parts = models.PositiveIntegerField(default=3)
    splittable = models.BooleanField(default=True)
    gifted_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    redeemed_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    redeemed_at = models.DateTimeField(null=True, blank=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    state = models.CharField(max_length=12, choices=State.choices, default=State.UNREDEEMED)
    reminded_days = models.JSONField(default=list, blank=True)
    # The Idempotency-Key of the split that made this part: a replay returns the same parts.
    split_key = models.CharField(max_length=200, null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        indexes = [
            models.Index(fields=["owner", "state", "expires_at"]),
            models.Index(fields=["state", "expires_at"]),
            models.Index(fields=["parent", "split_key"], name="card_split_key"),
        ]

    def __str__(self) -> str:
        return f"card #{self.pk} ({self.state})"


class InviteCode(models.Model):
    """The code that redeems one card. Only a keyed hash is stored; the code is shown once."""

    code_hash = models.CharField(max_length=64, unique=True)
    card = models.ForeignKey(Card, on_delete=models.PROTECT, related_name="codes")
    used_at = models.DateTimeField(null=True, blank=True)
    expires_at = models.DateTimeField(null=True, blank=True)  # an unredeemed gift goes back after this
    revoked_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"code for card #{self.card_id}"
