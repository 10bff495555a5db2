"""The files page: a folder of the user's home, download links, deletes (a form that works without
JavaScript), and uploads that resume (static/js/files.js drives the files API in parts)."""

from __future__ import annotations

from urllib.parse import urlencode

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.template.defaultfilters import filesizeformat
from django.urls import reverse
from django.utils.translation import gettext as _
from django.views.decorators.csrf import ensure_csrf_cookie
from django.views.decorators.http import require_POST

from billing.services.storage import storage_cost
from core.errors import ApplicationError
from portal.homes import CHUNK_MAX_BYTES, FilesUnavailable, home_storage
from portal.services import home_file_delete
from provisioner.quotas import home_use_of
from provisioner.selectors import workload_user


@login_required
@ensure_csrf_cookie  # the upload script sends it with each part
def files(request: HttpRequest) -> HttpResponse:
    path = request.GET.get("path", "").strip("/")
    context = {
        "path": path,
        "entries": [],
        "unavailable": None,
        "error": None,
        "chunk_bytes": CHUNK_MAX_BYTES,
        "home": home_use_of(request.user),
    }
    # storage's price, where one is set (cached: no query)
    context["storage"] = context["home"] and storage_cost(home_bytes=context["home"].bytes)
    try:
        context["entries"] = list(home_storage().listing(folder=workload_user(request.user), path=path))
    except FilesUnavailable as exc:
        context["unavailable"] = exc.message
    except ApplicationError as exc:
        context["error"] = exc.message
    parts = [p for p in path.split("/") if p]
    context["crumbs"] = [("/".join(parts[: i + 1]), part) for i, part in enumerate(parts)]
    return render(request, "portal/files.html", context, status=404 if context["error"] else 200)


@login_required
@require_POST
def files_delete(request: HttpRequest) -> HttpResponse:
    """The Delete button of a row: delete it, then back to the folder it was in, with what it freed."""
    path = request.POST.get("path", "")
    parts = [p for p in path.split("/") if p not in ("", ".")]
    folder = "" if ".." in parts else "/".join(parts[:-1])
    try:
        removed = home_file_delete(user=request.user, path=path)
    except ApplicationError as exc:
        messages.error(request, exc.message)
    else:
        name = removed.path.rsplit("/", 1)[-1]
        messages.success(
            request, _("Deleted %(name)s (%(size)s).") % {"name": name, "size": filesizeformat(removed.bytes)}
        )
    target = reverse("files")
    return redirect(f"{target}?{urlencode({'path': folder})}" if folder else target)
