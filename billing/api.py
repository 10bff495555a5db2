"""The billing REST API: thin views over the services and selectors."""

from __future__ import annotations

import logging

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.utils.dateparse import parse_datetime
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST
from rest_framework import serializers
from rest_framework.pagination import LimitOffsetPagination
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from billing.errors import ApplicationError, ValidationFailed
from billing.models import Card
from billing.selectors import account_for_user, account_funds, card_detail, cards_for_account, ledger_entries
from billing.services.cards import card_gift, card_redeem, card_revoke, card_split
from billing.services.topups import amount_parse, topup_create, topup_webhook_handle

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
    amount_micros = serializers.JSONField(required=False)
    amount = serializers.JSONField(required=False)
    currency = serializers.CharField(required=False, max_length=8)


class TopUpView(APIView):
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


def _client_ip(request: Request) -> str:
    return request.META.get("REMOTE_ADDR", "")


class CardRedeemView(APIView):
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
    def get(self, request: Request) -> Response:
        cards = cards_for_account(account=_account(request))
        return Response([CardOut(c).data for c in cards])


class CardDetailView(APIView):
    def get(self, request: Request, card_id: int) -> Response:
        return Response(card_detail(account=_account(request), card_id=card_id))


class SplitInput(serializers.Serializer):
    parts = serializers.ListField(
        child=serializers.DecimalField(max_digits=12, decimal_places=6), max_length=50
    )


def _part_out(part: Card, code: str) -> dict:
    return {"card": CardOut(part).data, "code": code}


class CardSplitView(APIView):
    def post(self, request: Request, card_id: int) -> Response:
        data = SplitInput(data=request.data)
        data.is_valid(raise_exception=True)
        parts = [int(hours * 1_000_000) for hours in data.validated_data["parts"]]
        made = card_split(card_id=card_id, account=_account(request), parts=parts, actor=request.user)
        return Response({"parts": [_part_out(p, c) for p, c in made]}, status=201)


class CardGiftView(APIView):
    def post(self, request: Request, card_id: int) -> Response:
        part, code = card_gift(card_id=card_id, account=_account(request), actor=request.user)
        return Response(_part_out(part, code), status=201)


class CardRevokeView(APIView):
    def post(self, request: Request, card_id: int) -> Response:
        part = card_revoke(card_id=card_id, account=_account(request), actor=request.user)
        return Response(CardOut(part).data)
