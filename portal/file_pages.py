"""The files page: a folder of the user's home, download links, and uploads that resume
(static/js/files.js drives the files API in parts)."""

from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.views.decorators.csrf import ensure_csrf_cookie

from billing.services.storage import storage_cost
from core.errors import ApplicationError
from portal.homes import CHUNK_MAX_BYTES, FilesUnavailable, home_storage
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
