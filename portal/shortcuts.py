"""View shortcuts the portal's pages share, in the manner of ``django.shortcuts``."""

from __future__ import annotations

from dataclasses import dataclass

from django.db.models import QuerySet
from django.http import Http404, HttpRequest

from billing.models import Account
from portal.selectors import account_chosen


def account_or_404(request: HttpRequest) -> Account:
    """The account the page is about: ``?account=<id>`` (or the posted ``account``) among those the caller
    may pay with, their own when none is named; any other is a 404."""
    wanted = request.GET.get("account") or request.POST.get("account")
    account = account_chosen(user=request.user, wanted=wanted)
    if account is None:
        raise Http404
    return account


@dataclass(frozen=True)
class NewerOlder:
    """One page of a list read newest first, for "Newer" and "Older" links: the page's rows and whether
    an older page exists, in one query (a row past the page tells), where Django's ``Paginator`` counts
    the whole list first to number its pages."""

    rows: list
    number: int
    has_next: bool

    def __iter__(self):
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def has_previous(self) -> bool:
        return self.number > 1

    @property
    def previous_page_number(self) -> int:
        return self.number - 1

    @property
    def next_page_number(self) -> int:
        return self.number + 1


def newer_older_page(queryset: QuerySet, wanted: str | None, *, size: int) -> NewerOlder:
    """Page ``wanted`` (``?page=``; the first for anything that is not a page number) of ``queryset``,
    ``size`` rows; a page past the end is the first."""
    number = int(wanted) if wanted and wanted.isascii() and wanted.isdigit() and int(wanted) > 0 else 1
    rows = list(queryset[(number - 1) * size : number * size + 1])
    if not rows and number > 1:
        return newer_older_page(queryset, None, size=size)
    return NewerOlder(rows=rows[:size], number=number, has_next=len(rows) > size)
