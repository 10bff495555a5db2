"""The billing REST API: thin views over the services and selectors."""

from __future__ import annotations

import logging
from decimal import Decimal

from django.db.models import Count, Q
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.utils.dateparse import parse_datetime
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers
from rest_framework.pagination import LimitOffsetPagination
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.settings import api_settings
from rest_framework.views import APIView

from billing.models import Card, CardBatch, Price
from billing.selectors import account_for_user, account_funds, card_detail, cards_for_account, ledger_entries
from billing.services.cards import (
    MAX_BATCH,
    card_batch_issue,
    card_gift,
    card_redeem,
    card_revoke,
    card_split,
)
from billing.services.pricing import price_set
from billing.services.topups import amount_parse, topup_create, topup_webhook_handle
from core.errors import ApplicationError, NotFound, ValidationFailed
from core.permissions import StaffOnly
from core.units import hours_to_micros

ACCOUNT = OpenApiParameter(
    "account", int, description="A team account you belong to; your own account when omitted."
)
PAGE = [
    OpenApiParameter("limit", int, description="Entries per page."),
    OpenApiParameter("offset", int, description="Entries to skip."),
]


def _idempotency_key(effect: str) -> OpenApiParameter:
    return OpenApiParameter("Idempotency-Key", str, OpenApiParameter.HEADER, description=effect)


class AccountRefOut(serializers.Serializer):
    id = serializers.IntegerField()
    name = serializers.CharField()
    kind = serializers.CharField()


class EntryOut(serializers.Serializer):
    id = serializers.IntegerField()
    at = serializers.DateTimeField()
    kind = serializers.CharField(help_text="The transfer's kind: topup, metering, card_split, …")
    ledger = serializers.CharField(help_text="wallet, overdraft or card")
    unit = serializers.CharField(help_text="The site currency, or card-hours")
    amount_micros = serializers.IntegerField()
    balance_after_micros = serializers.IntegerField()
    memo = serializers.CharField()
    session_ref = serializers.CharField(allow_null=True)


class WalletOut(serializers.Serializer):
    account = AccountRefOut()
    balance_micros = serializers.IntegerField()
    overdraft_micros = serializers.IntegerField()
    cards_micros = serializers.IntegerField()
    accrued_micros = serializers.IntegerField()
    available_micros = serializers.IntegerField()
    burn_micros_per_hour = serializers.IntegerField()
    runway_seconds = serializers.IntegerField(allow_null=True)
    recent_entries = EntryOut(many=True)


class EntryPageOut(serializers.Serializer):
    """A page of ledger entries (limit/offset)."""

    count = serializers.IntegerField()
    next = serializers.URLField(allow_null=True)
    previous = serializers.URLField(allow_null=True)
    results = EntryOut(many=True)


log = logging.getLogger(__name__)


def _account(request: Request):
    return account_for_user(user=request.user, account_id=request.query_params.get("account"))


def _entry_row(entry) -> dict:
    return {
        "id": entry.id,
        "at": entry.transfer.created_at,
        "kind": entry.transfer.kind,
        "ledger": entry.account.kind,
        "unit": entry.account.unit,
        "amount_micros": entry.amount_micros,
        "balance_after_micros": entry.balance_after_micros,
        "memo": entry.transfer.memo,
        "session_ref": entry.transfer.meter.session_ref if entry.transfer.meter_id else None,
    }


def _date(value: str | None, name: str):
    if not value:
        return None
    parsed = parse_datetime(value) if len(value) > 10 else parse_datetime(value + "T00:00:00+00:00")
    if parsed is None:
        raise ValidationFailed(f"{name} is not a date.", fields={name: "not a date"})
    return parsed


class WalletView(APIView):
    @extend_schema(
        operation_id="wallet_retrieve",
        summary="Balance, cards, what is accrued, burn rate and runway",
        parameters=[ACCOUNT],
        responses={200: WalletOut},
    )
    def get(self, request: Request) -> Response:
        account = _account(request)
        funds = account_funds(account=account)
        recent = ledger_entries(account=account)[:10]
        return Response(
            {
                "account": {"id": account.id, "name": account.name, "kind": account.kind},
                "balance_micros": funds.wallet_micros,
                "overdraft_micros": funds.overdraft_micros,
                "cards_micros": funds.cards_micros,
                "accrued_micros": funds.accrued_micros,
                "available_micros": funds.available_micros,
                "burn_micros_per_hour": funds.burn_micros_per_hour,
                "runway_seconds": funds.runway_seconds,
                "recent_entries": [_entry_row(e) for e in recent],
            }
        )


class LedgerView(APIView):
    @extend_schema(
        operation_id="ledger_list",
        summary="The account's ledger history (wallet, overdraft, cards), newest first",
        parameters=[
            ACCOUNT,
            OpenApiParameter("kind", str, description="Only transfers of this kind."),
            OpenApiParameter("since", OpenApiTypes.DATETIME, description="From (a date or a date-time)."),
            OpenApiParameter("until", OpenApiTypes.DATETIME, description="Before (a date or a date-time)."),
            *PAGE,
        ],
        responses={200: EntryPageOut},
    )
    def get(self, request: Request) -> Response:
        account = _account(request)
        entries = ledger_entries(
            account=account,
            kind=request.query_params.get("kind") or None,
            since=_date(request.query_params.get("since"), "since"),
            until=_date(request.query_params.get("until"), "until"),
        )
        paginator = LimitOffsetPagination()
        page = paginator.paginate_queryset(entries, request, view=self)
        return paginator.get_paginated_response([_entry_row(e) for e in page])


class TopUpInput(serializers.Serializer):
    amount_micros = serializers.JSONField(required=False, help_text="An integer of micro-units.")
    amount = serializers.JSONField(required=False, help_text='A decimal string such as "50.00".')
    currency = serializers.CharField(required=False, max_length=8, help_text="The site currency.")


class TopUpOut(serializers.Serializer):
    checkout_url = serializers.URLField(help_text="Stripe Checkout: send the payer here.")
    topup_id = serializers.IntegerField()


class TopUpView(APIView):
    @extend_schema(
        operation_id="wallet_topup_create",
        summary="Start a card payment into the wallet (credited when Stripe confirms it)",
        parameters=[ACCOUNT, _idempotency_key("The same key returns the same top-up and Checkout page.")],
        request=TopUpInput,
        responses={201: TopUpOut},
    )
    def post(self, request: Request) -> Response:
        account = _account(request)
        data = TopUpInput(data=request.data)
        data.is_valid(raise_exception=True)
        fields = data.validated_data
        if "amount_micros" not in fields and "amount" not in fields:
            raise ValidationFailed("Give amount_micros or amount.", fields={"amount": "required"})
        micros = amount_parse(
            amount_micros=fields.get("amount_micros"),
            amount=fields.get("amount"),
            currency=fields.get("currency"),
        )
        key = request.headers.get("Idempotency-Key")
        topup = topup_create(
            account=account,
            amount_micros=micros,
            actor=request.user,
            idempotency_key=f"topup:{account.id}:{key}" if key else None,
        )
        return Response({"checkout_url": topup.checkout_url, "topup_id": topup.id}, status=201)


@csrf_exempt
@require_POST
def stripe_webhook(request: HttpRequest) -> HttpResponse:
    """Stripe's only door: the signature on the raw body is the authentication (hence CSRF-exempt)."""
    try:
        outcome = topup_webhook_handle(
            payload=request.body, signature=request.headers.get("Stripe-Signature", "")
        )
    except ApplicationError as exc:
        return JsonResponse(exc.as_body(), status=exc.status)
    log.info("stripe webhook: %s", outcome)
    return JsonResponse({"received": True, "outcome": outcome})


class CardOut(serializers.ModelSerializer):
    hours_left_micros = serializers.IntegerField(source="ledger_account.balance_micros")

    class Meta:
        model = Card
        fields = [
            "id",
            "state",
            "hours_micros",
            "hours_left_micros",
            "gpu_models",
            "expires_at",
            "redeemed_at",
            "max_parts",
            "splittable",
            "parent_id",
        ]


class RedeemInput(serializers.Serializer):
    code = serializers.CharField(max_length=20_000, allow_blank=True, trim_whitespace=False)


class PartRefOut(serializers.Serializer):
    id = serializers.IntegerField()
    state = serializers.CharField()
    hours_micros = serializers.IntegerField()


class CardDetailOut(serializers.Serializer):
    id = serializers.IntegerField()
    state = serializers.CharField()
    hours_micros = serializers.IntegerField()
    hours_left_micros = serializers.IntegerField()
    gpu_models = serializers.ListField(child=serializers.CharField())
    expires_at = serializers.DateTimeField(allow_null=True)
    max_parts = serializers.IntegerField()
    parts = PartRefOut(many=True)
    lineage = serializers.ListField(child=serializers.DictField(), help_text="From the root card down.")


def _client_ip(request: Request) -> str:
    return request.META.get("REMOTE_ADDR", "")


class CardRedeemView(APIView):
    @extend_schema(
        operation_id="cards_redeem",
        summary="Redeem an invite code: its card becomes the account's",
        parameters=[ACCOUNT],
        request=RedeemInput,
        responses={201: CardOut},
    )
    def post(self, request: Request) -> Response:
        account = _account(request)
        data = RedeemInput(data=request.data)
        if not data.is_valid():
            raise ValidationFailed(
                "That is not an invite code.", code="code_invalid", fields={"code": "invalid"}
            )
        card = card_redeem(
            user=request.user, account=account, code=data.validated_data["code"], ip=_client_ip(request)
        )
        return Response(CardOut(card).data, status=201)


class CardListView(APIView):
    @extend_schema(
        operation_id="cards_list",
        summary="The account's compute cards, soonest expiry first",
        parameters=[ACCOUNT],
        responses={200: CardOut(many=True)},
    )
    def get(self, request: Request) -> Response:
        cards = cards_for_account(account=_account(request))
        return Response([CardOut(c).data for c in cards])


class CardDetailView(APIView):
    @extend_schema(
        operation_id="cards_retrieve",
        summary="One card with its parts and lineage",
        parameters=[ACCOUNT],
        responses={200: CardDetailOut},
    )
    def get(self, request: Request, card_id: int) -> Response:
        return Response(card_detail(account=_account(request), card_id=card_id))


class SplitInput(serializers.Serializer):
    parts = serializers.ListField(
        child=serializers.DecimalField(max_digits=12, decimal_places=6), max_length=50
    )


class PartOut(serializers.Serializer):
    card = CardOut()
    code = serializers.CharField(help_text="The part's invite code, shown once (empty once redeemed).")


class SplitOut(serializers.Serializer):
    parts = PartOut(many=True)


def _part_out(part: Card, code: str) -> dict:
    return {"card": CardOut(part).data, "code": code}


class CardSplitView(APIView):
    @extend_schema(
        operation_id="cards_split",
        summary="Split a card into parts of the given hours, each with a code to give away",
        parameters=[
            ACCOUNT,
            _idempotency_key(
                "The same key splits once: a replay returns the same parts (200), each not yet redeemed "
                "with a fresh code that replaces the first."
            ),
        ],
        request=SplitInput,
        responses={201: SplitOut, 200: SplitOut},
    )
    def post(self, request: Request, card_id: int) -> Response:
        data = SplitInput(data=request.data)
        data.is_valid(raise_exception=True)
        parts = [hours_to_micros(hours) for hours in data.validated_data["parts"]]
        key = request.headers.get("Idempotency-Key") or None
        account = _account(request)
        replay = (
            bool(key)
            and Card.objects.filter(parent_id=card_id, parent__owner=account, split_key=key).exists()
        )
        made = card_split(
            card_id=card_id, account=account, parts=parts, actor=request.user, idempotency_key=key
        )
        return Response({"parts": [_part_out(p, c) for p, c in made]}, status=200 if replay else 201)


class CardGiftView(APIView):
    @extend_schema(
        operation_id="cards_gift",
        summary="Give away everything a card holds as one part with a code",
        parameters=[ACCOUNT],
        request=None,
        responses={201: PartOut},
    )
    def post(self, request: Request, card_id: int) -> Response:
        part, code = card_gift(card_id=card_id, account=_account(request), actor=request.user)
        return Response(_part_out(part, code), status=201)


class CardRevokeView(APIView):
    @extend_schema(
        operation_id="cards_revoke",
        summary="Take back a part not yet redeemed: its hours return to the card",
        parameters=[ACCOUNT],
        request=None,
        responses={200: CardOut},
    )
    def post(self, request: Request, card_id: int) -> Response:
        part = card_revoke(card_id=card_id, account=_account(request), actor=request.user)
        return Response(CardOut(part).data)


# --- staff: prices and card batches --------------------------------------------------------------------

STAFF = [*api_settings.DEFAULT_PERMISSION_CLASSES, StaffOnly]  # token scopes still apply


class PriceVersionOut(serializers.ModelSerializer):
    created_by = serializers.CharField(source="created_by.username", allow_null=True, default=None)

    class Meta:
        model = Price
        fields = [
            "id",
            "gpu_model",
            "profile",
            "price_micros_per_hour",
            "interruptible_price_micros_per_hour",
            "effective_from",
            "created_by",
        ]


class PriceIn(serializers.Serializer):
    gpu_model = serializers.CharField(max_length=64, allow_blank=True, help_text='"" for the cpu profile.')
    profile = serializers.CharField(max_length=32)
    price_micros_per_hour = serializers.IntegerField(min_value=0, max_value=10**15)
    interruptible_price_micros_per_hour = serializers.IntegerField(
        min_value=0,
        max_value=10**15,
        required=False,
        allow_null=True,
        help_text="The lower price of the interruptible tier; omitted: that tier is not offered.",
    )
    effective_from = serializers.DateTimeField(required=False, help_text="Now when omitted.")
    reason = serializers.CharField(max_length=200, required=False, allow_blank=True, default="")


class AdminPriceView(APIView):
    permission_classes = STAFF

    @extend_schema(
        operation_id="admin_prices_list",
        summary="Every price version, newest first (staff)",
        responses={200: PriceVersionOut(many=True)},
    )
    def get(self, request: Request) -> Response:
        prices = Price.objects.select_related("created_by").order_by("-effective_from", "-id")
        return Response(PriceVersionOut(prices, many=True).data)

    @extend_schema(
        operation_id="admin_prices_create",
        summary="Publish a new price version for a GPU model and profile (staff; audited)",
        description="Prices are never edited: a new version applies to launches from its effective time; "
        "running sessions keep the price locked at their launch.",
        request=PriceIn,
        responses={201: PriceVersionOut},
    )
    def post(self, request: Request) -> Response:
        data = PriceIn(data=request.data)
        data.is_valid(raise_exception=True)
        fields = data.validated_data
        price = price_set(
            gpu_model=fields["gpu_model"],
            profile=fields["profile"],
            price_micros_per_hour=fields["price_micros_per_hour"],
            interruptible_price_micros_per_hour=fields.get("interruptible_price_micros_per_hour"),
            effective_from=fields.get("effective_from"),
            actor=request.user,
            reason=fields["reason"],
        )
        price.refresh_from_db()
        return Response(PriceVersionOut(price).data, status=201)


class CardBatchOut(serializers.ModelSerializer):
    cards = serializers.IntegerField(source="cards_count", help_text="Cards issued in the batch.")
    redeemed = serializers.IntegerField(source="redeemed_count", help_text="Of them, redeemed.")

    class Meta:
        model = CardBatch
        fields = [
            "id",
            "label",
            "hours_micros",
            "valid_days",
            "valid_until",
            "gpu_models",
            "splittable",
            "max_parts",
            "one_per_user",
            "created_at",
            "cards",
            "redeemed",
        ]


class CardBatchIn(serializers.Serializer):
    hours = serializers.DecimalField(max_digits=12, decimal_places=6, min_value=Decimal("0.000001"))
    count = serializers.IntegerField(min_value=1, max_value=MAX_BATCH)
    valid_days = serializers.IntegerField(min_value=1, max_value=3660, required=False)
    valid_until = serializers.DateTimeField(required=False)
    gpu_models = serializers.ListField(
        child=serializers.CharField(max_length=64), max_length=50, required=False, default=list
    )
    splittable = serializers.BooleanField(required=False, default=True)
    max_parts = serializers.IntegerField(min_value=0, max_value=50, required=False, default=3)
    one_per_user = serializers.BooleanField(required=False, default=True)
    label = serializers.CharField(max_length=100, required=False, allow_blank=True, default="")


class CardBatchIssuedOut(serializers.Serializer):
    batch = CardBatchOut()
    codes = serializers.ListField(
        child=serializers.CharField(), help_text="Shown once: only hashes are kept."
    )


def _batches():
    return CardBatch.objects.annotate(
        cards_count=Count("cards", filter=Q(cards__parent__isnull=True)),
        redeemed_count=Count("cards", filter=Q(cards__parent__isnull=True, cards__redeemed_at__isnull=False)),
    ).order_by("-created_at", "-id")


class AdminCardBatchListView(APIView):
    permission_classes = STAFF

    @extend_schema(
        operation_id="admin_card_batches_list",
        summary="Card batches with how many of their cards were redeemed (staff)",
        responses={200: CardBatchOut(many=True)},
    )
    def get(self, request: Request) -> Response:
        return Response(CardBatchOut(_batches(), many=True).data)

    @extend_schema(
        operation_id="admin_card_batches_create",
        summary="Issue a batch of compute cards; the answer carries their codes, once (staff; audited)",
        request=CardBatchIn,
        responses={201: CardBatchIssuedOut},
    )
    def post(self, request: Request) -> Response:
        data = CardBatchIn(data=request.data)
        data.is_valid(raise_exception=True)
        fields = data.validated_data
        batch, codes = card_batch_issue(
            hours_micros=hours_to_micros(fields["hours"]),
            count=fields["count"],
            valid_days=fields.get("valid_days"),
            valid_until=fields.get("valid_until"),
            gpu_models=fields["gpu_models"],
            max_parts=fields["max_parts"],
            splittable=fields["splittable"],
            one_per_user=fields["one_per_user"],
            label=fields["label"],
            actor=request.user,
        )
        return Response({"batch": CardBatchOut(_batches().get(id=batch.id)).data, "codes": codes}, status=201)


class AdminCardBatchDetailView(APIView):
    permission_classes = STAFF

    @extend_schema(
        operation_id="admin_card_batches_retrieve",
        summary="One card batch (staff)",
        responses={200: CardBatchOut},
    )
    def get(self, request: Request, batch_id: int) -> Response:
        batch = _batches().filter(id=batch_id).first()
        if batch is None:
            raise NotFound("No such card batch.")
        return Response(CardBatchOut(batch).data)
