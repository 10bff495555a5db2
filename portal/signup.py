"""Writes of sign-up: the per-address throttle, the optional invite-code-only mode, the optional email
confirmation. Beside ``portal/services.py`` (which it calls for the user itself) to keep that module
under the size where the style guide splits one.

Settings: ``SIGNUP_RATE_PER_HOUR``, ``SIGNUP_INVITE_REQUIRED``, ``SIGNUP_EMAIL_VERIFICATION``,
``SIGNUP_VERIFY_DAYS`` (README, configuration).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from django.conf import settings
from django.core import signing
from django.core.cache import cache
from django.core.mail import send_mail
from django.db import transaction
from django.urls import reverse
from django.utils.translation import gettext as _

from billing.errors import ApplicationError, Conflict, RateLimited, ValidationFailed
from billing.models import Card
from billing.services.cards import card_redeem
from portal.models import User
from portal.services import user_create

log = logging.getLogger(__name__)

VERIFY_SALT = "portal.signup.verify"
RATE_WINDOW_SECONDS = 3600


def signup_rate_check(*, ip: str) -> None:
    """Count one sign-up attempt from ``ip`` in the cache (a fixed window of an hour, add then incr, so
    concurrent attempts from one address all count) and raise RateLimited ``signup_rate_limited`` past
    ``SIGNUP_RATE_PER_HOUR``.

    Fails open: when the cache cannot be reached the attempt goes through and a warning is logged. The
    throttle slows down scripted sign-ups; it must not lock every student out while Redis restarts.
    """
    if not ip:
        return
    key = f"signup:ip:{ip}"
    try:
        cache.add(key, 0, timeout=RATE_WINDOW_SECONDS)
        try:
            attempts = cache.incr(key)
        except ValueError:  # the window expired between add and incr
            cache.set(key, 1, timeout=RATE_WINDOW_SECONDS)
            attempts = 1
    except Exception:  # any failure of the cache backend (redis-py's errors, a timeout): fail open
        log.warning("sign-up throttle skipped: the cache is unreachable (address %s)", ip, exc_info=True)
        return
    if attempts > settings.SIGNUP_RATE_PER_HOUR:
        raise RateLimited(
            _("Too many sign-ups from your network. Try again in an hour."), code="signup_rate_limited"
        )


@dataclass(frozen=True)
class Signup:
    user: User
    card: Card | None  # the compute card the invite code redeemed, if any
    code_error: str  # why an optional invite code was not redeemed; "" when it was or none was given
    verification_sent: bool  # the user is inactive until they follow the emailed link


def user_signup(
    *, username: str, email: str, password: str, language: str, invite_code: str = "", ip: str = ""
) -> Signup:
    """Sign a visitor up: a user with their own account (``user_create``), the invite code redeemed onto
    it, and, with ``SIGNUP_EMAIL_VERIFICATION``, an inactive user and a confirmation email (sent after
    commit).

    With ``SIGNUP_INVITE_REQUIRED`` the code must redeem: the user and the redemption are one
    transaction, so a bad, used or expired code makes nothing. Without it a code that fails leaves the
    user made and says why in ``code_error``. Raises ValidationFailed (username, password, email, or
    the code's own error with ``fields["invite_code"]``), Conflict, NotFound, RateLimited."""
    invite_code = invite_code.strip()
    required = settings.SIGNUP_INVITE_REQUIRED
    verify = settings.SIGNUP_EMAIL_VERIFICATION
    if required and not invite_code:
        raise ValidationFailed(
            _("Signing up here takes an invite code."),
            code="invite_required",
            fields={"invite_code": _("This field is required.")},
        )
    if verify and not email.strip():
        raise ValidationFailed(
            _("Give your email: we send a link to confirm it."),
            code="email_required",
            fields={"email": _("This field is required.")},
        )
    card, code_error = None, ""
    with transaction.atomic():
        user = user_create(username=username, email=email.strip(), password=password, language=language)
        if verify:
            user.is_active = False
            user.save(update_fields=["is_active"])
        if invite_code:
            try:
                card = card_redeem(user=user, account=user.account, code=invite_code, ip=ip or None)
            except ApplicationError as exc:
                if required:
                    raise type(exc)(exc.message, code=exc.code, fields={"invite_code": exc.message}) from exc
                code_error = exc.message
        if verify:
            link = settings.SITE_URL.rstrip("/") + reverse("signup_verify", args=[_verify_token(user)])
            message = _(
                "Welcome to Suanli, %(name)s.\n\nOpen this link to confirm your email and finish signing up "
                "(it works for %(days)s days):\n%(link)s\n"
            ) % {"name": user.username, "days": settings.SIGNUP_VERIFY_DAYS, "link": link}
            subject = _("Confirm your email for Suanli")
            address = user.email
            transaction.on_commit(
                lambda: send_mail(subject=subject, message=message, from_email=None, recipient_list=[address])
            )
    return Signup(user=user, card=card, code_error=code_error, verification_sent=verify)


def _verify_token(user: User) -> str:
    return signing.dumps({"user": user.pk, "email": user.email}, salt=VERIFY_SALT)


def user_email_verify(*, token: str) -> User:
    """Activate the user a confirmation link names: signed, at most ``SIGNUP_VERIFY_DAYS`` old, for the
    email the user still has, and only a user who never logged in (an admin's deactivation is not
    undone by an old link). A conditional update, so two clicks activate once. Raises ValidationFailed
    ``verification_invalid``, Conflict ``already_verified``."""
    invalid = ValidationFailed(
        _("This confirmation link is not valid or has expired. Sign up again."), code="verification_invalid"
    )
    try:
        data = signing.loads(token, salt=VERIFY_SALT, max_age=settings.SIGNUP_VERIFY_DAYS * 86400)
    except signing.BadSignature:
        raise invalid from None
    user = User.objects.filter(pk=data.get("user"), email__iexact=data.get("email", "")).first()
    if user is None:
        raise invalid
    if user.is_active:
        raise Conflict(_("Your email is already confirmed: log in."), code="already_verified")
    if user.last_login is not None:
        raise invalid
    updated = User.objects.filter(pk=user.pk, is_active=False, last_login__isnull=True).update(is_active=True)
    if updated != 1:
        raise Conflict(_("Your email is already confirmed: log in."), code="already_verified")
    user.is_active = True
    return user
