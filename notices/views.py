"""The notices pages: the list (works without JavaScript: every button is a POST form) and email choices."""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.utils.http import url_has_allowed_host_and_scheme
from django.utils.translation import gettext as _
from django.views.decorators.http import require_POST

from core.errors import NotFound
from notices.kinds import KINDS
from notices.selectors import notice_email_choices, notices_recent
from notices.services import notice_dismiss, notice_preference_set, notice_read, notices_mark_all_read

PAGE_SIZE = 50


@login_required
def notice_list(request: HttpRequest) -> HttpResponse:
    notices = notices_recent(user=request.user, limit=PAGE_SIZE)
    return render(request, "notices/list.html", {"notices": notices})


def _back(request: HttpRequest) -> HttpResponse:
    """Back where the button was (the bell sits on every page), else the notices page."""
    next_url = request.POST.get("next", "")
    if next_url and url_has_allowed_host_and_scheme(next_url, allowed_hosts={request.get_host()}):
        return redirect(next_url)
    return redirect("notice_list")


@login_required
@require_POST
def notice_read_view(request: HttpRequest, notice_id: int) -> HttpResponse:
    try:
        notice_read(user=request.user, notice_id=notice_id)
    except NotFound:
        raise Http404 from None
    return _back(request)


@login_required
@require_POST
def notice_dismiss_view(request: HttpRequest, notice_id: int) -> HttpResponse:
    try:
        notice_dismiss(user=request.user, notice_id=notice_id)
    except NotFound:
        raise Http404 from None
    return _back(request)


@login_required
@require_POST
def notices_read_all_view(request: HttpRequest) -> HttpResponse:
    notices_mark_all_read(user=request.user)
    return _back(request)


@login_required
def notice_settings(request: HttpRequest) -> HttpResponse:
    if request.method == "POST":
        for kind in KINDS:
            notice_preference_set(user=request.user, kind=kind, email=f"email_{kind}" in request.POST)
        messages.success(request, _("Your email choices are saved."))
        return redirect("notice_settings")
    return render(request, "notices/settings.html", {"choices": notice_email_choices(user=request.user)})
