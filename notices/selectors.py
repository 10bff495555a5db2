"""What the bell, the notices page and the API read."""

from __future__ import annotations

from django.db.models import Count, Q, QuerySet, Window

from core.compiled import Lookup
from notices.kinds import KINDS, Kind
from notices.models import Notice, NoticePreference

BELL_ROWS = 10  # the newest notices the bell reads (it shows five; the dashboard the unread among them)


def notices_unread_count(*, user) -> int:
    """How many of ``user``'s notices are unread and not dismissed (one COUNT, on a partial index)."""
    return Notice.objects.filter(user_id=user.pk, read_at__isnull=True, dismissed_at__isnull=True).count()


# Every page's bell: compiled once per process.
_BELL = Lookup(
    lambda user_id: (
        Notice.objects.filter(user_id=user_id, dismissed_at__isnull=True)
        .annotate(unread_total=Window(Count("id", filter=Q(read_at__isnull=True))))
        .order_by("-created_at", "-id")[:BELL_ROWS]
    ),
    key_types=(int,),
    many=True,
)


def notices_bell(*, user) -> tuple[int, list[Notice]]:
    """How many of ``user``'s notices are unread, and the newest ``BELL_ROWS`` not dismissed, in one
    query (the count is a window over every notice not dismissed, taken before the limit)."""
    rows = _BELL.all(user.pk)
    return (rows[0].unread_total if rows else 0), rows


def notices_recent(*, user, limit: int = 20, unread_only: bool = False) -> QuerySet[Notice]:
    """``user``'s notices not dismissed, newest first, at most ``limit``."""
    notices = Notice.objects.filter(user_id=user.pk, dismissed_at__isnull=True)
    if unread_only:
        notices = notices.filter(read_at__isnull=True)
    return notices.order_by("-created_at", "-id")[:limit]


def notice_email_choices(*, user) -> list[tuple[Kind, bool]]:
    """Each kind with whether ``user`` is emailed about it (their choice, else the kind's default)."""
    chosen = dict(NoticePreference.objects.filter(user_id=user.pk).values_list("kind", "email"))
    return [(kind, chosen.get(kind.name, kind.email_default)) for kind in KINDS.values()]
