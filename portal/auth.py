"""API authentication with personal access tokens, the scopes a token needs per endpoint, and the rate
limits of the API (per token; launches are limited by ``session_launch`` itself, whoever calls it)."""

from __future__ import annotations

import hashlib
import secrets
from datetime import timedelta

from django.utils import timezone, translation
from drf_spectacular.extensions import OpenApiAuthenticationExtension
from rest_framework import authentication, exceptions, permissions, throttling
from rest_framework.settings import api_settings

from core.compiled import Lookup
from portal.models import AccessToken

TOKEN_PREFIX = "sl_"
LAST_USED_RESOLUTION = timedelta(minutes=1)

# The scope a token needs, by API path prefix; reads need "read" or the area's own scope. Paths not
# listed (the staff endpoints, the teams, and views without a ``token_scope``) take read-only tokens for
# reads and no token at all for writes: a leaked token never enrols a node, changes a quota or removes a
# team's member.
SCOPE_BY_PREFIX = (
    ("/api/v1/sessions", "sessions"),
    ("/api/v1/catalog", "sessions"),
    ("/api/v1/quota", "sessions"),
    ("/api/v1/cards", "cards"),
    ("/api/v1/files", "files"),
    ("/api/v1/wallet", "billing"),
    ("/api/v1/ledger", "billing"),
)


# Every API call reads its token, with its user: compiled once (core.compiled).
_TOKEN_BY_HASH = Lookup(
    lambda digest: AccessToken.objects.select_related("user").filter(token_hash=digest), key_types=(str,)
)

# A view's ``token_scope`` that no token carries: the endpoint takes a browser session only.
NO_TOKEN = "browser-session-only"


def token_hash(raw: str) -> str:
    return hashlib.sha256(raw.encode()).hexdigest()


def token_generate() -> str:
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


class BearerTokenAuthentication(authentication.BaseAuthentication):
    """``Authorization: Bearer sl_…``. Unknown, revoked and expired tokens all get the same 401.

    The token's scopes are checked here too, not only by ``TokenScopePermission``: a view that sets its
    own ``permission_classes`` (the staff endpoints do) drops the default permissions, but every view
    that accepts a token authenticates through this class, so no view can forget the scope check.
    """

    keyword = "bearer"

    def authenticate(self, request):
        header = authentication.get_authorization_header(request).decode("latin-1")
        kind, _, raw = header.partition(" ")
        raw = raw.strip()
        if kind.lower() != self.keyword or not raw.startswith(TOKEN_PREFIX):
            return None
        token = _TOKEN_BY_HASH.first(token_hash(raw))
        if token is None or not token.active or not token.user.is_active:
            raise exceptions.AuthenticationFailed("The token is unknown, expired or revoked.")
        view = (request.parser_context or {}).get("view")
        if view is not None and not token_may(token, scope=view_scope(view, request), method=request.method):
            raise exceptions.PermissionDenied(TokenScopePermission.message)
        if not request.headers.get("Accept-Language") and token.user.language:
            # The preferences middleware ran before the token was known: a script that names no
            # language gets answers in the one its user chose, as their browser does.
            translation.activate(token.user.language)
        now = timezone.now()
        if token.last_used_at is None or now - token.last_used_at > LAST_USED_RESOLUTION:
            AccessToken.objects.filter(pk=token.pk).update(last_used_at=now)
        return token.user, token

    def authenticate_header(self, request) -> str:
        return 'Bearer realm="api"'


class BearerTokenScheme(OpenApiAuthenticationExtension):
    """Names the token scheme in the OpenAPI document (drf-spectacular finds it by subclassing)."""

    target_class = BearerTokenAuthentication
    name = "tokenAuth"

    def get_security_definition(self, auto_schema) -> dict:
        return {
            "type": "http",
            "scheme": "bearer",
            "description": "A personal access token (`sl_…`): the profile page or `manage.py create_token`.",
        }


def required_scope(path: str) -> str | None:
    for prefix, scope in SCOPE_BY_PREFIX:
        if path.startswith(prefix):
            return scope
    return None


def view_scope(view, request) -> str | None:
    return getattr(view, "token_scope", None) or required_scope(request.path)


def token_may(token: AccessToken, *, scope: str | None, method: str) -> bool:
    """Whether ``token`` may make a ``method`` call to an endpoint that needs ``scope``."""
    if scope == NO_TOKEN:
        return False
    if method in permissions.SAFE_METHODS and "read" in token.scopes:
        return True
    return scope is not None and scope in token.scopes


class TokenScopePermission(permissions.BasePermission):
    """Session-authenticated callers are not limited; a token must carry the endpoint's scope (or
    ``read`` for safe methods). Staff endpoints need a staff user whatever the token."""

    message = "This token does not have the scope this call needs."

    def has_permission(self, request, view) -> bool:
        token = request.auth
        if not isinstance(token, AccessToken):
            return True
        return token_may(token, scope=view_scope(view, request), method=request.method)


class _SettingsRateThrottle(throttling.SimpleRateThrottle):
    """Reads its rate when asked, not at import, so a changed REST_FRAMEWORK setting takes effect."""

    def get_rate(self) -> str | None:
        return api_settings.DEFAULT_THROTTLE_RATES.get(self.scope)


class TokenRateThrottle(_SettingsRateThrottle):
    """Calls made with one personal access token (rate ``token``), whoever's browser session is open."""

    scope = "token"

    def get_cache_key(self, request, view) -> str | None:
        if not isinstance(request.auth, AccessToken):
            return None
        return self.cache_format % {"scope": self.scope, "ident": request.auth.pk}
