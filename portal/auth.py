"""API authentication with personal access tokens, and the scopes a token needs per endpoint."""

from __future__ import annotations

import hashlib
import secrets
from datetime import timedelta

from django.utils import timezone
from rest_framework import authentication, exceptions, permissions

from portal.models import AccessToken

TOKEN_PREFIX = "sl_"
LAST_USED_RESOLUTION = timedelta(minutes=1)

# The scope a token needs, by API path prefix; reads need "read" or the area's own scope.
SCOPE_BY_PREFIX = (
    ("/api/v1/sessions", "sessions"),
    ("/api/v1/catalog", "sessions"),
    ("/api/v1/quota", "sessions"),
    ("/api/v1/cards", "cards"),
    ("/api/v1/wallet", "billing"),
    ("/api/v1/ledger", "billing"),
)


def token_hash(raw: str) -> str:
    return hashlib.sha256(raw.encode()).hexdigest()


def token_generate() -> str:
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


class BearerTokenAuthentication(authentication.BaseAuthentication):
    """``Authorization: Bearer sl_…``. Unknown, revoked and expired tokens all get the same 401."""

    keyword = "bearer"

    def authenticate(self, request):
        header = authentication.get_authorization_header(request).decode("latin-1")
        kind, _, raw = header.partition(" ")
        if kind.lower() != self.keyword or not raw.startswith(TOKEN_PREFIX):
            return None
        token = AccessToken.objects.select_related("user").filter(token_hash=token_hash(raw.strip())).first()
        if token is None or not token.active or not token.user.is_active:
            raise exceptions.AuthenticationFailed("The token is unknown, expired or revoked.")
        now = timezone.now()
        if token.last_used_at is None or now - token.last_used_at > LAST_USED_RESOLUTION:
            AccessToken.objects.filter(pk=token.pk).update(last_used_at=now)
        return token.user, token

    def authenticate_header(self, request) -> str:
        return 'Bearer realm="api"'


def required_scope(path: str) -> str | None:
    for prefix, scope in SCOPE_BY_PREFIX:
        if path.startswith(prefix):
            return scope
    return None


class TokenScopePermission(permissions.BasePermission):
    """Session-authenticated callers are not limited; a token must carry the endpoint's scope (or
    ``read`` for safe methods). Staff endpoints need a staff user whatever the token."""

    message = "This token does not have the scope this call needs."

    def has_permission(self, request, view) -> bool:
        token = request.auth
        if not isinstance(token, AccessToken):
            return True
        scope = getattr(view, "token_scope", None) or required_scope(request.path)
        if scope is None:
            return "read" in token.scopes and request.method in permissions.SAFE_METHODS
        if request.method in permissions.SAFE_METHODS and "read" in token.scopes:
            return True
        return scope in token.scopes
