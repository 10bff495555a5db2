"""Single sign-on with OpenID Connect, through mozilla-django-oidc, configured from the environment.

``OIDC_ISSUER`` names the provider; its endpoints come from its discovery document
(``/.well-known/openid-configuration``), fetched on the first sign-in and kept for the process, so an
operator sets one URL, not four. A user is found by their identity at the provider (``issuer#sub``,
``User.sso_subject``), never by a username or email a local user may already have; a new one gets a
user of their own (and, through the ``post_save`` receiver, their account). ``OIDC_ALLOWED_EMAIL_DOMAINS``
limits who may sign in; ``OIDC_TEAM_CLAIM`` joins them to the teams it names. Settings: README.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import requests
from django.conf import settings
from django.contrib import messages
from django.contrib.auth import get_user_model
from django.core.exceptions import SuspiciousOperation
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect
from django.utils import translation
from django.utils.translation import gettext as _
from django.views import View
from mozilla_django_oidc.auth import OIDCAuthenticationBackend
from mozilla_django_oidc.views import OIDCAuthenticationCallbackView, OIDCAuthenticationRequestView

from portal.backends import request_user
from portal.services import team_join_by_claim, user_create_sso

log = logging.getLogger(__name__)

_metadata: dict[str, dict] = {}
_metadata_lock = threading.Lock()


class ProviderUnavailable(Exception):
    """The provider's discovery document could not be read."""


def provider_metadata() -> dict:
    """The provider's discovery document, fetched once per process and issuer."""
    issuer = settings.OIDC_ISSUER
    with _metadata_lock:
        if issuer not in _metadata:
            url = f"{issuer}/.well-known/openid-configuration"
            try:
                response = requests.get(url, timeout=settings.OIDC_TIMEOUT)
                response.raise_for_status()
                document = response.json()
            except (requests.RequestException, ValueError) as exc:
                raise ProviderUnavailable(f"{url}: {exc}") from exc
            if document.get("issuer", "").rstrip("/") != issuer:
                raise ProviderUnavailable(f"{url} names another issuer: {document.get('issuer')!r}")
            _metadata[issuer] = document
        return _metadata[issuer]


def sso_enabled() -> bool:
    return bool(settings.OIDC_ISSUER)


def _refuse(request: HttpRequest, message: str) -> None:
    """Say why a sign-in was refused; the callback view shows it on the login page."""
    request.sso_refusal = message
    raise SuspiciousOperation(message)


class SsoBackend(OIDCAuthenticationBackend):
    """The authorization-code flow's backend. It reads nothing at construction (Django builds every
    backend for every password login too), only when a callback brings a code."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.UserModel = get_user_model()

    def authenticate(self, request: HttpRequest | None, **kwargs: Any):
        if (
            request is None
            or not sso_enabled()
            or not request.GET.get("code")
            or not request.GET.get("state")
        ):
            return None
        try:
            metadata = provider_metadata()
        except ProviderUnavailable as exc:
            log.warning("single sign-on: %s", exc)
            request.sso_refusal = _("The sign-in provider cannot be reached; try again later.")
            return None
        self.OIDC_OP_TOKEN_ENDPOINT = metadata["token_endpoint"]
        self.OIDC_OP_USER_ENDPOINT = metadata["userinfo_endpoint"]
        self.OIDC_OP_JWKS_ENDPOINT = metadata["jwks_uri"]
        self.OIDC_RP_CLIENT_ID = settings.OIDC_RP_CLIENT_ID
        self.OIDC_RP_CLIENT_SECRET = settings.OIDC_RP_CLIENT_SECRET
        self.OIDC_RP_SIGN_ALGO = settings.OIDC_RP_SIGN_ALGO
        self.OIDC_RP_IDP_SIGN_KEY = None
        return super().authenticate(request, **kwargs)

    def _subject(self, claims: dict) -> str:
        return f"{settings.OIDC_ISSUER}#{claims['sub']}"

    def verify_claims(self, claims: dict) -> bool:
        if not claims.get("sub"):
            _refuse(self.request, _("The sign-in provider did not say who you are."))
        domains = settings.OIDC_ALLOWED_EMAIL_DOMAINS
        if domains:
            email = str(claims.get(settings.OIDC_EMAIL_CLAIM) or "")
            domain = email.rpartition("@")[2].lower()
            if not email or domain not in domains or claims.get("email_verified") is False:
                _refuse(
                    self.request,
                    _("Sign-in here is for %(domains)s email addresses.")
                    % {"domains": ", ".join("@" + d for d in domains)},
                )
        return True

    def get_user(self, user_id):
        """The user of a request signed in this way, read with their account (as PasswordBackend does)."""
        user = request_user(user_id)
        return user if user is not None and user.is_active else None

    def filter_users_by_claims(self, claims: dict):
        return self.UserModel.objects.filter(sso_subject=self._subject(claims))

    def create_user(self, claims: dict):
        username = str(claims.get(settings.OIDC_USERNAME_CLAIM) or "")
        email = str(claims.get(settings.OIDC_EMAIL_CLAIM) or "")
        if not username and email:
            username = email.partition("@")[0]
        if not username:
            _refuse(self.request, _("The sign-in provider gave no username."))
        user = user_create_sso(
            subject=self._subject(claims),
            username=username,
            email=email,
            language=translation.get_language() or settings.LANGUAGE_CODE,
        )
        return self._join_teams(user, claims)

    def update_user(self, user, claims: dict):
        email = str(claims.get(settings.OIDC_EMAIL_CLAIM) or "")
        if email and email != user.email:
            user.email = email
            user.save(update_fields=["email"])
        return self._join_teams(user, claims)

    def _join_teams(self, user, claims: dict):
        claim = settings.OIDC_TEAM_CLAIM
        if claim and claims.get(claim):
            value = claims[claim]
            slugs = [value] if isinstance(value, str) else [str(v) for v in value]
            team_join_by_claim(user=user, slugs=slugs)
        return user


class SsoAuthenticateView(OIDCAuthenticationRequestView):
    """Sends the browser to the provider; 404 when single sign-on is off."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        View.__init__(self, *args, **kwargs)  # the endpoint is read per request, from discovery

    def get(self, request: HttpRequest) -> HttpResponse:
        if not sso_enabled():
            raise Http404
        try:
            self.OIDC_OP_AUTH_ENDPOINT = provider_metadata()["authorization_endpoint"]
        except ProviderUnavailable as exc:
            log.warning("single sign-on: %s", exc)
            messages.error(request, _("The sign-in provider cannot be reached; try again later."))
            return redirect("login")
        self.OIDC_RP_CLIENT_ID = settings.OIDC_RP_CLIENT_ID
        return super().get(request)


class SsoCallbackView(OIDCAuthenticationCallbackView):
    """The provider's redirect back; a refusal goes to the login page with the reason."""

    def get(self, request: HttpRequest) -> HttpResponse:
        if not sso_enabled():
            raise Http404
        return super().get(request)

    def login_failure(self) -> HttpResponse:
        reason = getattr(self.request, "sso_refusal", None) or _(
            "Single sign-on did not complete. Try again."
        )
        messages.error(self.request, reason)
        return redirect("login")
