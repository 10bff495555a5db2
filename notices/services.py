"""Telling people things: a notice per person, shown under the bell, and an email in their language."""

from __future__ import annotations

from collections.abc import Iterable

from django.conf import settings
from django.core.mail import send_mail
from django.db import transaction
from django.db.models import Q
from django.db.models.functions import Now
from django.utils import translation
from django.utils.translation import gettext as _

from core.errors import NotFound, ValidationFailed
from core.messages import message, message_columns
from notices.kinds import KINDS
from notices.models import Notice, NoticePreference


def notify(
    *, users: Iterable, kind: str, key: str, params: dict | None = None, dedupe_key: str, url: str = ""
) -> int:
    """Tell each of ``users`` (users or their ids; None is skipped) the message ``key`` with ``params``
    (values may be nested ``Message``s); ``url`` is a path on the site (a session's page) or empty.

    Idempotent per (user, ``dedupe_key``): a repeat makes nothing and sends nothing. After commit, each
    new notice is emailed to its recipient in their language unless they have no address or opted out
    of ``kind``. Raises ValueError for an unknown kind, key or parameters. Returns notices made."""
    if kind not in KINDS:
        raise ValueError(f"unknown notice kind {kind!r}")
    message_key, message_params, english = message_columns(message(key, **(params or {})))
    user_ids = sorted({getattr(user, "pk", user) for user in users if user is not None})
    made: list[int] = []
    with transaction.atomic():
        for user_id in user_ids:
            notice, created = Notice.objects.get_or_create(
                user_id=user_id,
                dedupe_key=dedupe_key[:200],
                defaults={
                    "kind": kind,
                    "message_key": message_key,
                    "message_params": message_params,
                    "message": english[:500],
                    "url": url,
                },
            )
            if created:
                made.append(notice.id)
        if made:
            transaction.on_commit(lambda: notices_email(notice_ids=made))
    return len(made)


def notices_email(*, notice_ids: list[int]) -> int:
    """Email these notices to their recipients who have an address and did not opt out of the kind,
    each in the recipient's language; a notice is emailed at most once (``emailed_at`` is claimed by a
    conditional update before sending). Returns emails sent."""
    sent = 0
    notices = Notice.objects.filter(id__in=notice_ids, emailed_at__isnull=True).select_related("user")
    opted = _email_choices(notices)
    for notice in notices:
        user = notice.user
        wanted = opted.get((user.pk, notice.kind), KINDS[notice.kind].email_default)
        if not (wanted and user.email and user.is_active):
            continue
        if not Notice.objects.filter(id=notice.id, emailed_at__isnull=True).update(emailed_at=Now()):
            continue
        with translation.override(getattr(user, "language", "") or settings.LANGUAGE_CODE):
            subject, body = str(KINDS[notice.kind].title), _email_body(notice)
        sent += send_mail(subject, body, None, [user.email], fail_silently=True)
    return sent


def _email_choices(notices) -> dict[tuple[int, str], bool]:
    pairs = Q()
    for notice in notices:
        pairs |= Q(user_id=notice.user_id, kind=notice.kind)
    if not pairs:
        return {}
    return {(p.user_id, p.kind): p.email for p in NoticePreference.objects.filter(pairs)}


def _email_body(notice: Notice) -> str:
    if not notice.url:
        return notice.text
    base = getattr(settings, "PORTAL_BASE_URL", "") or getattr(settings, "SITE_URL", "")
    return f"{notice.text}\n\n{base.rstrip('/')}{notice.url}"


def _owned(*, user, notice_id: int):
    notices = Notice.objects.filter(id=notice_id, user_id=user.pk)
    if not notices.exists():
        raise NotFound(_("No such notice."), code="notice_unknown")
    return notices


def notice_read(*, user, notice_id: int) -> Notice:
    """Mark one of ``user``'s notices read. Idempotent (the first read time stays); NotFound for a
    notice that is not theirs."""
    _owned(user=user, notice_id=notice_id).filter(read_at__isnull=True).update(read_at=Now())
    return Notice.objects.get(id=notice_id)


def notice_dismiss(*, user, notice_id: int) -> Notice:
    """Take one of ``user``'s notices off their list (and count it read). Idempotent; NotFound for a
    notice that is not theirs."""
    notices = _owned(user=user, notice_id=notice_id)
    notices.filter(read_at__isnull=True).update(read_at=Now())
    notices.filter(dismissed_at__isnull=True).update(dismissed_at=Now())
    return Notice.objects.get(id=notice_id)


def notices_mark_all_read(*, user) -> int:
    """Mark all of ``user``'s unread notices read; returns how many changed."""
    return Notice.objects.filter(user_id=user.pk, read_at__isnull=True).update(read_at=Now())


def notice_preference_set(*, user, kind: str, email: bool) -> None:
    """Whether ``user`` is emailed about ``kind``; a row is kept only where it differs from the default.
    Raises ValidationFailed for an unknown kind."""
    if kind not in KINDS:
        raise ValidationFailed(_("Unknown notice kind."), fields={"kind": "unknown"})
    if email == KINDS[kind].email_default:
        NoticePreference.objects.filter(user_id=user.pk, kind=kind).delete()
    else:
        NoticePreference.objects.update_or_create(user_id=user.pk, kind=kind, defaults={"email": email})
