"""REST endpoints of the portal app: the caller, their teams and their personal access tokens."""

from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status
from rest_framework.response import Response
from rest_framework.views import APIView

from portal import services
from portal.auth import NO_TOKEN
from portal.models import AccessToken, Membership


class MeSerializer(serializers.Serializer):
    id = serializers.IntegerField()
    username = serializers.CharField()
    email = serializers.EmailField()
    language = serializers.CharField()
    time_zone = serializers.CharField()
    account_id = serializers.IntegerField()
    teams = serializers.ListField(child=serializers.DictField())


class MeView(APIView):
    token_scope = "read"

    @extend_schema(responses=MeSerializer)
    def get(self, request):
        user = request.user
        teams = [
            {"slug": m.team.slug, "name": m.team.name, "role": m.role, "account_id": m.team.account_id}
            for m in Membership.objects.select_related("team").filter(user=user).order_by("team__name")
        ]
        return Response(
            MeSerializer(
                {
                    "id": user.pk,
                    "username": user.username,
                    "email": user.email,
                    "language": user.language,
                    "time_zone": user.time_zone,
                    "account_id": user.account_id,
                    "teams": teams,
                }
            ).data
        )


class TokenSerializer(serializers.ModelSerializer):
    class Meta:
        model = AccessToken
        fields = ["id", "name", "prefix", "scopes", "created_at", "expires_at", "last_used_at", "revoked_at"]


class TokenCreateSerializer(serializers.Serializer):
    name = serializers.CharField(max_length=100)
    scopes = serializers.ListField(
        child=serializers.ChoiceField(choices=AccessToken.Scope.values), min_length=1
    )
    expires_in_days = serializers.IntegerField(min_value=1, max_value=366, required=False, default=90)


class TokenCreatedSerializer(TokenSerializer):
    token = serializers.CharField(help_text="Shown only in this answer.")

    class Meta(TokenSerializer.Meta):
        fields = [*TokenSerializer.Meta.fields, "token"]


class TokenListView(APIView):
    """Personal access tokens can only be managed from a logged-in browser session, not with a token."""

    token_scope = NO_TOKEN

    @extend_schema(responses=TokenSerializer(many=True))
    def get(self, request):
        tokens = AccessToken.objects.filter(user=request.user).order_by("-created_at")
        return Response(TokenSerializer(tokens, many=True).data)

    @extend_schema(request=TokenCreateSerializer, responses={201: TokenCreatedSerializer})
    def post(self, request):
        payload = TokenCreateSerializer(data=request.data)
        payload.is_valid(raise_exception=True)
        token, raw = services.access_token_create(user=request.user, **payload.validated_data)
        body = TokenSerializer(token).data | {"token": raw}
        return Response(body, status=status.HTTP_201_CREATED)


class TokenDetailView(APIView):
    token_scope = NO_TOKEN

    @extend_schema(request=None, responses={204: None})
    def delete(self, request, token_id: int):
        services.access_token_revoke(user=request.user, token_id=token_id)
        return Response(status=status.HTTP_204_NO_CONTENT)
