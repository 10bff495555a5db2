"""The billing admin. The ledger is append-only, so ledger accounts, transfers, entries, meters and
top-ups are read-only here; money moves only through the services: a wallet adjustment (with a
reason, leaving an audit row), a new price or burn-rate version, a new card batch (codes shown once,
as a CSV download)."""

from __future__ import annotations

import uuid
from decimal import Decimal

from django import forms
from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils.html import format_html

from billing.codes import codes_csv
from billing.models import (
    Account,
    AuditEntry,
    Card,
    CardBatch,
    CardBurnRate,
    Entry,
    InviteCode,
    LedgerAccount,
    LedgerHold,
    Meter,
    Price,
    StoragePrice,
    StripeEvent,
    TopUp,
    TopUpDispute,
    Transfer,
)
from billing.services.cards import card_batch_issue
from billing.services.ledger import wallet_adjust, wallet_for
from billing.services.pricing import burn_rate_set, price_set
from billing.services.reconcile import ledger_hold_resolve
from billing.services.storage import storage_price_set
from core.admin import ReadOnlyAdmin
from core.errors import ApplicationError
from core.units import hours_to_micros


def _micros(value: int | None) -> str:
    return "—" if value is None else f"{Decimal(value) / 1_000_000:,.6f}".rstrip("0").rstrip(".")


# --- accounts and wallet adjustments ------------------------------------------------------------------


class AdjustForm(forms.Form):
    amount = forms.DecimalField(
        max_digits=18, decimal_places=6, help_text="In the site currency; negative takes money out."
    )
    reason = forms.CharField(
        widget=forms.Textarea(attrs={"rows": 3}), help_text="Required; kept in the audit."
    )
    idempotency_key = forms.CharField(widget=forms.HiddenInput)

    def clean_amount(self):
        amount = self.cleaned_data["amount"]
        if amount == 0:
            raise forms.ValidationError("The adjustment must not be zero.")
        return amount

    def clean_reason(self):
        reason = self.cleaned_data["reason"].strip()
        if not reason:
            raise forms.ValidationError("An adjustment needs a reason.")
        return reason


@admin.register(Account)
class AccountAdmin(admin.ModelAdmin):
    list_display = ("name", "kind", "wallet_balance", "created_at")
    list_filter = ("kind",)
    search_fields = ("name",)
    readonly_fields = ("created_at", "wallet_balance", "adjust_link")

    @admin.display(description="wallet")
    def wallet_balance(self, obj: Account) -> str:
        wallet = obj.ledger_accounts.filter(kind=LedgerAccount.Kind.WALLET).first()
        return _micros(wallet.balance_micros if wallet else 0)

    @admin.display(description="adjust")
    def adjust_link(self, obj: Account) -> str:
        if not obj.pk:
            return "—"
        url = reverse("admin:billing_account_adjust", args=[obj.pk])
        return format_html('<a class="button" href="{}">Adjust the wallet…</a>', url)

    def get_urls(self):
        return [
            path(
                "<int:account_id>/adjust/",
                self.admin_site.admin_view(self.adjust_view),
                name="billing_account_adjust",
            ),
            *super().get_urls(),
        ]

    def adjust_view(self, request: HttpRequest, account_id: int) -> HttpResponse:
        """A wallet adjustment: amount and a required reason; wallet_adjust writes the audit row."""
        if not request.user.has_perm("billing.change_account"):
            raise PermissionDenied
        account = get_object_or_404(Account, pk=account_id)
        form = AdjustForm(request.POST or None, initial={"idempotency_key": uuid.uuid4().hex})
        if request.method == "POST" and form.is_valid():
            try:
                wallet_adjust(
                    account=account,
                    amount_micros=int(form.cleaned_data["amount"] * 1_000_000),
                    actor=request.user,
                    reason=form.cleaned_data["reason"],
                    idempotency_key=f"admin:{form.cleaned_data['idempotency_key']}",
                )
            except ApplicationError as exc:
                form.add_error(None, exc.message)
            else:
                messages.success(request, f"Adjusted the wallet of {account.name}.")
                return redirect("admin:billing_account_change", account.pk)
        wallet = wallet_for(account=account)
        return TemplateResponse(
            request,
            "admin/billing/form.html",
            {
                **self.admin_site.each_context(request),
                "opts": self.model._meta,
                "title": f"Adjust the wallet of {account.name}",
                "intro": f"Balance now: {_micros(wallet.balance_micros)}.",
                "form": form,
                "submit": "Adjust",
            },
        )


@admin.register(AuditEntry)
class AuditEntryAdmin(ReadOnlyAdmin):
    """The audit trail is appended by the services, never edited."""

    list_display = ("created_at", "actor", "action", "target_type", "target_id", "reason")
    list_filter = ("action", "target_type")
    search_fields = ("action", "target_id", "reason", "actor__username")
    date_hierarchy = "created_at"


# --- the ledger (append-only) -------------------------------------------------------------------------


@admin.register(LedgerAccount)
class LedgerAccountAdmin(ReadOnlyAdmin):
    list_display = ("id", "kind", "unit", "owner", "balance", "version", "created_at")
    list_filter = ("kind", "unit")
    search_fields = ("owner__name", "=id")
    list_select_related = ("owner",)

    @admin.display(description="balance", ordering="balance_micros")
    def balance(self, obj: LedgerAccount) -> str:
        return _micros(obj.balance_micros)


class EntryInline(admin.TabularInline):
    model = Entry
    extra = 0
    can_delete = False
    readonly_fields = ("account", "amount_micros", "balance_after_micros")

    def has_add_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return False


@admin.register(Transfer)
class TransferAdmin(ReadOnlyAdmin):
    list_display = ("id", "created_at", "kind", "amount", "unit", "debit", "credit", "actor", "memo")
    list_filter = ("kind", "unit")
    search_fields = ("idempotency_key", "memo", "=id", "meter__session_ref", "actor__username")
    date_hierarchy = "created_at"
    list_select_related = ("debit__owner", "credit__owner", "actor")
    inlines = [EntryInline]

    @admin.display(description="amount", ordering="amount_micros")
    def amount(self, obj: Transfer) -> str:
        return _micros(obj.amount_micros)


@admin.register(Entry)
class EntryAdmin(ReadOnlyAdmin):
    list_display = ("id", "transfer", "account", "amount_micros", "balance_after_micros")
    list_filter = ("account__kind", "account__unit")
    search_fields = ("account__owner__name", "=transfer__id")
    list_select_related = ("transfer", "account__owner")


# --- pricing (versions are added, never edited) -------------------------------------------------------


class VersionedAdmin(admin.ModelAdmin):
    """A new version is added through the pricing service (which writes the audit row); existing
    versions are read-only, so what a running session was quoted stays on record."""

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


@admin.register(Price)
class PriceAdmin(VersionedAdmin):
    list_display = ("gpu_model", "profile", "price", "interruptible_price", "effective_from", "created_by")
    list_filter = ("profile", "gpu_model")
    search_fields = ("gpu_model", "profile")
    fields = (
        "gpu_model",
        "profile",
        "price_micros_per_hour",
        "interruptible_price_micros_per_hour",
        "effective_from",
    )

    @admin.display(description="price / hour", ordering="price_micros_per_hour")
    def price(self, obj: Price) -> str:
        return _micros(obj.price_micros_per_hour)

    @admin.display(description="interruptible / hour")
    def interruptible_price(self, obj: Price) -> str:
        lower = obj.interruptible_price_micros_per_hour
        return "—" if lower is None else _micros(lower)

    def save_model(self, request, obj: Price, form, change) -> None:
        created = price_set(
            gpu_model=obj.gpu_model,
            profile=obj.profile,
            price_micros_per_hour=obj.price_micros_per_hour,
            interruptible_price_micros_per_hour=obj.interruptible_price_micros_per_hour,
            actor=request.user,
            reason="admin",
            effective_from=form.cleaned_data.get("effective_from"),
        )
        obj.pk = created.pk


@admin.register(CardBurnRate)
class CardBurnRateAdmin(VersionedAdmin):
    list_display = ("gpu_model", "multiplier", "effective_from", "created_at")
    search_fields = ("gpu_model",)
    fields = ("gpu_model", "multiplier_milli")

    @admin.display(description="multiplier", ordering="multiplier_milli")
    def multiplier(self, obj: CardBurnRate) -> str:
        return f"×{obj.multiplier_milli / 1000:g}"

    def save_model(self, request, obj: CardBurnRate, form, change) -> None:
        obj.pk = burn_rate_set(
            gpu_model=obj.gpu_model, multiplier_milli=obj.multiplier_milli, actor=request.user, reason="admin"
        ).pk


@admin.register(StoragePrice)
class StoragePriceAdmin(VersionedAdmin):
    """Home storage per GB-month above a free allowance, charged daily (docs/STORAGE.md)."""

    list_display = ("price", "card_rate", "free_gb", "effective_from", "created_by")
    fields = ("price_micros_per_gb_month", "free_gb", "card_micros_per_gb_month", "effective_from")

    @admin.display(description="price / GB-month", ordering="price_micros_per_gb_month")
    def price(self, obj: StoragePrice) -> str:
        return _micros(obj.price_micros_per_gb_month)

    @admin.display(description="card-hours / GB-month")
    def card_rate(self, obj: StoragePrice) -> str:
        return _micros(obj.card_micros_per_gb_month)

    def save_model(self, request, obj: StoragePrice, form, change) -> None:
        obj.pk = storage_price_set(
            price_micros_per_gb_month=obj.price_micros_per_gb_month,
            free_gb=obj.free_gb,
            card_micros_per_gb_month=obj.card_micros_per_gb_month,
            effective_from=form.cleaned_data.get("effective_from"),
            actor=request.user,
            reason="admin",
        ).pk


# --- metering and top-ups -----------------------------------------------------------------------------


@admin.register(Meter)
class MeterAdmin(ReadOnlyAdmin):
    list_display = (
        "session_ref",
        "account",
        "gpu_model",
        "profile",
        "state",
        "billed_seconds",
        "charged_micros",
        "card_charged_micros",
        "billed_until",
    )
    list_filter = ("state", "gpu_model", "profile")
    search_fields = ("session_ref", "account__name")
    list_select_related = ("account",)
    date_hierarchy = "started_at"


@admin.register(TopUp)
class TopUpAdmin(ReadOnlyAdmin):
    list_display = ("created_at", "account", "amount", "currency", "state", "paid_at", "created_by")
    list_filter = ("state", "currency")
    search_fields = ("checkout_session_id", "account__name", "created_by__username")
    list_select_related = ("account", "created_by")
    date_hierarchy = "created_at"

    @admin.display(description="amount", ordering="amount_micros")
    def amount(self, obj: TopUp) -> str:
        return _micros(obj.amount_micros)


@admin.register(TopUpDispute)
class TopUpDisputeAdmin(ReadOnlyAdmin):
    list_display = ("created_at", "dispute_id", "topup", "amount", "state", "held", "closed_at")
    list_filter = ("state",)
    search_fields = ("dispute_id", "topup__checkout_session_id", "topup__account__name")

    @admin.display(description="amount", ordering="amount_micros")
    def amount(self, obj: TopUpDispute) -> str:
        return _micros(obj.amount_micros)


@admin.register(StripeEvent)
class StripeEventAdmin(ReadOnlyAdmin):
    list_display = ("received_at", "event_id", "type", "outcome", "applied_at")
    list_filter = ("type", "outcome")
    search_fields = ("event_id", "payment_intent_id")


# --- reconciliation -----------------------------------------------------------------------------------


class HoldResolveForm(forms.ModelForm):
    rebuild = forms.BooleanField(
        required=False, help_text="Balance holds: set the cached balance back to the sum of its entries."
    )

    class Meta:
        model = LedgerHold
        fields = ["resolution", "rebuild"]


@admin.register(LedgerHold)
class LedgerHoldAdmin(admin.ModelAdmin):
    """What the ledger check found. Resolving needs a note (what was wrong, which reversing transfer
    corrected it); it unblocks the account's launches and leaves an audit row. Nothing else changes."""

    form = HoldResolveForm
    list_display = ("found_at", "kind", "subject", "account", "resolved_at", "resolved_by")
    list_filter = ("kind", ("resolved_at", admin.EmptyFieldListFilter))
    readonly_fields = ("kind", "subject", "account", "ledger_account", "detail", "found_at", "resolved_at")
    list_select_related = ("account", "resolved_by")

    def has_add_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return super().has_change_permission(request, obj) and (obj is None or obj.resolved_at is None)

    def save_model(self, request, obj, form, change):
        try:
            ledger_hold_resolve(
                hold=obj,
                actor=request.user,
                resolution=form.cleaned_data["resolution"],
                rebuild=form.cleaned_data.get("rebuild", False),
            )
        except ApplicationError as exc:
            self.message_user(request, exc.message, level=messages.ERROR)


# --- compute cards ------------------------------------------------------------------------------------


class BatchIssueForm(forms.Form):
    label = forms.CharField(max_length=100, required=False, help_text="The course or promotion.")
    hours = forms.DecimalField(max_digits=12, decimal_places=6, min_value=Decimal("0.000001"))
    count = forms.IntegerField(min_value=1, max_value=10_000)
    valid_days = forms.IntegerField(min_value=1, required=False, help_text="Counted from redemption.")
    valid_until = forms.DateTimeField(required=False, help_text="Or a fixed end (YYYY-MM-DD HH:MM).")
    gpu_models = forms.CharField(
        required=False, help_text="Comma-separated GPU models the cards may pay for; empty: any."
    )
    max_parts = forms.IntegerField(min_value=0, max_value=50, initial=3, help_text="0: cannot be split.")
    one_per_user = forms.BooleanField(required=False, initial=True)

    def clean(self):
        data = super().clean()
        if not data.get("valid_days") and not data.get("valid_until"):
            raise forms.ValidationError("Give a validity: days after redemption, or a fixed date.")
        return data


class CardInline(admin.TabularInline):
    model = Card
    fk_name = "batch"
    extra = 0
    can_delete = False
    fields = ("id", "state", "owner", "hours_micros", "expires_at", "redeemed_by", "parent")
    readonly_fields = fields
    show_change_link = True
    max_num = 0


@admin.register(CardBatch)
class CardBatchAdmin(admin.ModelAdmin):
    """Batches are issued here through ``card_batch_issue``: the codes come back once, as a CSV."""

    list_display = ("id", "label", "hours", "valid_days", "valid_until", "max_parts", "one_per_user", "cards")
    search_fields = ("label",)
    list_filter = ("one_per_user", "splittable")
    date_hierarchy = "created_at"
    readonly_fields = (
        "label",
        "hours_micros",
        "valid_days",
        "valid_until",
        "gpu_models",
        "splittable",
        "max_parts",
        "one_per_user",
        "created_by",
        "created_at",
    )
    inlines = [CardInline]

    @admin.display(description="hours")
    def hours(self, obj: CardBatch) -> str:
        return _micros(obj.hours_micros)

    @admin.display(description="cards")
    def cards(self, obj: CardBatch) -> int:
        return obj.cards.filter(parent__isnull=True).count()

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False

    def add_view(self, request: HttpRequest, form_url: str = "", extra_context=None) -> HttpResponse:
        """Issue a batch; the response is the CSV of its codes (the only time they are shown)."""
        if not self.has_add_permission(request):
            raise PermissionDenied
        form = BatchIssueForm(request.POST or None)
        if request.method == "POST" and form.is_valid():
            data = form.cleaned_data
            try:
                batch, codes = card_batch_issue(
                    hours_micros=hours_to_micros(data["hours"]),
                    count=data["count"],
                    valid_days=data["valid_days"],
                    valid_until=data["valid_until"],
                    gpu_models=[m for m in data["gpu_models"].split(",") if m.strip()],
                    max_parts=data["max_parts"],
                    splittable=data["max_parts"] > 0,
                    one_per_user=data["one_per_user"],
                    label=data["label"],
                    actor=request.user,
                )
            except ApplicationError as exc:
                form.add_error(None, exc.message)
            else:
                response = HttpResponse(codes_csv(batch=batch, codes=codes), content_type="text/csv")
                response["Content-Disposition"] = f'attachment; filename="card-batch-{batch.pk}-codes.csv"'
                response["Cache-Control"] = "no-store"
                return response
        return TemplateResponse(
            request,
            "admin/billing/form.html",
            {
                **self.admin_site.each_context(request),
                "opts": self.model._meta,
                "title": "Issue a card batch",
                "intro": "The invite codes download once as CSV when you issue; only their hashes are kept.",
                "form": form,
                "submit": "Issue and download the codes",
            },
        )


@admin.register(Card)
class CardAdmin(ReadOnlyAdmin):
    list_display = ("id", "batch", "state", "owner", "hours_left", "hours_micros", "expires_at", "parent")
    list_filter = ("state", "batch__label")
    search_fields = ("=id", "owner__name", "redeemed_by__username", "gifted_by__username", "batch__label")
    list_select_related = ("batch", "owner", "ledger_account", "parent")
    date_hierarchy = "created_at"

    @admin.display(description="hours left")
    def hours_left(self, obj: Card) -> str:
        return _micros(obj.ledger_account.balance_micros)


@admin.register(InviteCode)
class InviteCodeAdmin(ReadOnlyAdmin):
    """Only the keyed hash is stored: a code cannot be looked up or shown again here."""

    list_display = ("id", "card", "created_at", "used_at", "expires_at", "revoked_at")
    list_filter = ("used_at", "revoked_at")
    search_fields = ("=card__id",)
    exclude = ("code_hash",)
