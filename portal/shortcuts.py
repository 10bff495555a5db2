"""View shortcuts the portal's pages share, in the manner of ``django.shortcuts``."""

from __future__ import annotations

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
