""" "My environments": the virtualenvs a user keeps in their home and launches with (docs/ENVIRONMENTS.md).

Thin: the provisioner's environment services decide; the node checks the folder when a session starts.
"""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.utils.translation import gettext as _
from django.views.decorators.http import require_POST

from core.errors import ApplicationError
from provisioner import selectors as prov_selectors
from provisioner.services.environments import environment_remove, environment_save


@login_required
def environments(request: HttpRequest) -> HttpResponse:
    published = prov_selectors.catalog()["environments"]
    if request.method == "POST":
        try:
            saved = environment_save(
                user=request.user,
                name=request.POST.get("name", "").strip(),
                home_path=request.POST.get("home_path", ""),
                base=request.POST.get("base", ""),
            )
        except ApplicationError as exc:
            messages.error(request, exc.message)
        else:
            messages.success(request, _("Saved %(name)s: pick it on the launch page.") % {"name": saved.name})
            return redirect("environments")
    context = {
        "own": prov_selectors.environments_own(user=request.user),
        "published": published,
        "form": request.POST if request.method == "POST" else {},
    }
    return render(request, "portal/environments.html", context)


@login_required
@require_POST
def environment_remove_view(request: HttpRequest, environment_id: int) -> HttpResponse:
    try:
        environment_remove(user=request.user, environment_id=environment_id)
    except ApplicationError as exc:
        messages.error(request, exc.message)
    else:
        messages.success(request, _("Removed from the portal; its files stay in your home."))
    return redirect("environments")
