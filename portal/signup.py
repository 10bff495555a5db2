"""Writes of sign-up: the per-address throttle, the optional invite-code-only mode, the optional email
confirmation and the resending of its link. Beside ``portal/services.py`` (which it calls for the user
itself) to keep that module under the size where the style guide splits one.

Settings: ``SIGNUP_RATE_PER_HOUR``, ``SIGNUP_INVITE_REQUIRED``, ``SIGNUP_EMAIL_VERIFICATION``,
``SIGNUP_VERIFY_DAYS`` (README, configuration).
"""

from __future__ import annotations

from dataclasses import dataclass

from django.conf import settings
from django.core import signing
from django.core.mail import send_mail
from django.db import transaction
from django.urls import reverse
from django.utils import translation
from django.utils.translation import gettext as _

from billing.models import Card
from billing.services.cards import card_redeem
from core.errors import ApplicationError, Conflict, NotFound, RateLimited, ValidationFailed
from core.throttle import attempt_count
from portal.models import User
from portal.services import user_create

VERIFY_SALT = "portal.signup.verify"
RATE_WINDOW_SECONDS = 3600
RESEND_PER_HOUR = 3  # confirmation emails resent to one user an hour


def signup_rate_check(*, ip: str) -> None:
    """Count one sign-up attempt from ``ip`` and raise RateLimited ``signup_rate_limited`` past
    ``SIGNUP_RATE_PER_HOUR`` an hour.

    Fails open: when the cache cannot be reached the attempt goes through and a warning is logged. The
    throttle slows down scripted sign-ups; it must not lock every student out while Redis restarts.
    """
    if not ip:
        return
    attempts = attempt_count(f"signup:ip:{ip}", window_seconds=RATE_WINDOW_SECONDS)
    if attempts is not None and attempts > settings.SIGNUP_RATE_PER_HOUR:
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
            _verification_email_send(user)
    return Signup(user=user, card=card, code_error=code_error, verification_sent=verify)


def _verify_token(user: User) -> str:
    return signing.dumps({"user": user.pk, "email": user.email}, salt=VERIFY_SALT)


def _verification_email_send(user: User) -> None:
    """Queue the confirmation email with a fresh link, in the user's language, for after commit."""
    link = settings.SITE_URL.rstrip("/") + reverse("signup_verify", args=[_verify_token(user)])
    with translation.override(user.language):
        message = _(
            "Welcome to Suanli, %(name)s.\n\nOpen this link to confirm your email and finish signing up "
            "(it works for %(days)s days):\n%(link)s\n"
        ) % {"name": user.username, "days": settings.SIGNUP_VERIFY_DAYS, "link": link}
        subject = _("Confirm your email for Suanli")
    address = user.email
    transaction.on_commit(
        lambda: send_mail(subject=subject, message=message, from_email=None, recipient_list=[address])
    )


def _pending_verification(users):
    """The users still waiting on their confirmation link: inactive, never logged in, with an email."""
    return users.filter(is_active=False, last_login__isnull=True).exclude(email="")


def user_awaiting_verification(*, username: str, password: str) -> User | None:
    """The user whose confirmation is pending and whose password this is, so the login page can say
    why it does not let them in (Django's backend refuses every inactive user alike); None otherwise,
    and always None without ``SIGNUP_EMAIL_VERIFICATION``."""
    if not settings.SIGNUP_EMAIL_VERIFICATION or not username or not password:
        return None
    user = _pending_verification(User.objects.filter(username__iexact=username.strip())).first()
    if user is None or not user.check_password(password):
        return None
    return user


def user_verification_resend(*, user_id: int, ip: str = "") -> User:
    """Send the user whose confirmation is pending a fresh confirmation email (after commit), in their
    language. At most ``RESEND_PER_HOUR`` an hour for one user and ``SIGNUP_RATE_PER_HOUR`` from one
    address (the sign-up throttle's window, failing open likewise). Raises Conflict
    ``already_verified``, NotFound ``verification_not_pending``, RateLimited
    ``verification_resend_rate_limited``."""
    user = User.objects.filter(pk=user_id).first()
    if user is not None and user.is_active:
        raise Conflict(_("Your email is already confirmed: log in."), code="already_verified")
    if user is None or user.last_login is not None or not user.email:
        raise NotFound(
            _("There is no sign-up waiting for confirmation here."), code="verification_not_pending"
        )
    limits = {f"signup:resend:user:{user.pk}": RESEND_PER_HOUR}
    if ip:
        limits[f"signup:resend:ip:{ip}"] = settings.SIGNUP_RATE_PER_HOUR
    for key, limit in limits.items():
        attempts = attempt_count(key, window_seconds=RATE_WINDOW_SECONDS)
        if attempts is not None and attempts > limit:
            raise RateLimited(
                _("We have sent several emails already. Wait an hour before asking for another."),
                code="verification_resend_rate_limited",
            )
    _verification_email_send(user)
    return user


def user_email_verify(*, token: str) -> User:
    """Activate the user a confirmation link names: signed, at most ``SIGNUP_VERIFY_DAYS`` old, for the
    email the user still has, and only a user who never logged in (an admin's deactivation is not
    undone by an old link). A conditional update, so two clicks activate once. Raises ValidationFailed
    ``verification_invalid``, Conflict ``already_verified``."""
    invalid = ValidationFailed(
        _(
            "This confirmation link is not valid or has expired. Log in with your username and password "
            "to have a new one sent."
        ),
        code="verification_invalid",
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
