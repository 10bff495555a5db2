"""The pages around GPU sessions: launch (with the price, card burn and runway before anything starts),
the sessions list, one session's live page, the operators' view of the fleet, and the landing prices.

Views stay thin: provisioner selectors and services decide; billing tells what things cost.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.contrib import messages
from django.contrib.admin.views.decorators import staff_member_required
from django.contrib.auth.decorators import login_required
from django.db.models import Count, Sum
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.utils import timezone
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy
from django.views.decorators.http import require_POST

from billing import selectors as billing_selectors
from billing.models import Account, Entry, LedgerAccount
from billing.services.pricing import PriceQuote, quote_with_surcharge
from core.compiled import Lookup
from core.errors import ApplicationError, NotFound, ValidationFailed
from portal.selectors import accounts_payable_by
from portal.shortcuts import account_or_404
from provisioner import selectors as prov_selectors
from provisioner.budgets import Budget, budgets_of
from provisioner.messages import message
from provisioner.models import Device, Node, Session
from provisioner.services.environments import OWN_PREFIX
from provisioner.services.keepalive import session_keep_alive
from provisioner.services.sessions import session_launch, session_stop
from provisioner.session_view import Limits, SessionView, session_view, session_views

S = Session.State
PROGRESS = [
    (S.QUEUED, gettext_lazy("Queued")),
    (S.PLACING, gettext_lazy("Placing")),
    (S.STARTING, gettext_lazy("Starting")),
    (S.RUNNING, gettext_lazy("Running")),
]


@dataclass(frozen=True)
class LaunchQuote:
    """What the launch page shows before anything starts."""

    price_micros_per_hour: int
    card_burn_micros_per_hour: int
    runway_seconds: int | None  # at this price alone, from the cards it may use then the wallet
    available_now: int  # how many more of these fit now
    queue_ahead: int  # sessions already waiting for this GPU model
    budgets: tuple[BudgetLeft, ...] = ()  # the monthly budgets this session would count against
    interruptible: Rate | None = None  # the lower price an on-demand launch may preempt; None: not offered
    surcharge_micros_per_hour: int = 0  # the environment's price tier, included in the prices above


@dataclass(frozen=True)
class BudgetLeft:
    """A monthly budget beside the runway: how much is used, and how long this price runs within it."""

    budget: Budget
    seconds: int  # at this price (money) or card burn (card-hours), until the budget is reached


def _budgets_left(*, user, account: Account, quote) -> tuple[BudgetLeft, ...]:
    lines = []
    for budget in budgets_of({(user.id, account.id)}):
        if not budget.covers(user.id, account.id):
            continue
        left = [
            max(0, cap - used) * 3600 // rate
            for used, cap, rate in (
                (budget.spent_micros, budget.spend_cap_micros, quote.price_micros_per_hour),
                (budget.card_micros, budget.card_cap_micros, quote.card_burn_micros_per_hour),
            )
            if cap is not None and rate
        ]
        lines.append(BudgetLeft(budget, min(left, default=0)))
    return tuple(lines)


@dataclass(frozen=True)
class Rate:
    """An hour's price and card burn, as the catalog lists them."""

    price_micros_per_hour: int
    card_burn_micros_per_hour: int


def _offer(catalog: dict, *, gpu_model: str, profile: str) -> dict | None:
    """The catalog's entry for a choice (its price and how many fit now), None when it is not offered."""
    if profile == "cpu":
        return catalog["cpu"]
    model = next((m for m in catalog["gpu_models"] if m["name"] == gpu_model), None)
    return next((p for p in model["profiles"] if p["profile"] == profile), None) if model else None


def _with_surcharge(price: dict, surcharge_micros_per_hour: int) -> Rate:
    """A catalog price with an environment's tier added, as the launch prices it (billing's rule)."""
    quote = quote_with_surcharge(
        PriceQuote(0, price["price_micros_per_hour"], price["card_burn_micros_per_hour"]),
        surcharge_micros_per_hour=surcharge_micros_per_hour,
    )
    return Rate(quote.price_micros_per_hour, quote.card_burn_micros_per_hour)


def launch_quote(
    *, user, account: Account, catalog: dict, gpu_model: str, profile: str, surcharge_micros_per_hour: int = 0
) -> LaunchQuote | None:
    """The price (with the environment's surcharge), card burn, runway and whether it starts now; None
    when that choice has no price. Prices and what is free come from the (cached) catalog; the funds,
    queue and budgets are the user's."""
    offer = _offer(catalog, gpu_model=gpu_model, profile=profile)
    if offer is None or offer["price"] is None:
        return None
    price = offer["price"]
    quote = _with_surcharge(price, surcharge_micros_per_hour)
    funds = billing_selectors.account_funds(account=account, gpu_model=gpu_model or None)
    seconds = 0.0
    if quote.card_burn_micros_per_hour and funds.cards_micros > 0:
        seconds += funds.cards_micros / quote.card_burn_micros_per_hour * 3600
    if quote.price_micros_per_hour and funds.available_micros > 0:
        seconds += funds.available_micros / quote.price_micros_per_hour * 3600
    runway = int(seconds) if quote.price_micros_per_hour or quote.card_burn_micros_per_hour else None
    waiting = Session.objects.filter(state=S.QUEUED)
    if profile == "cpu":
        ahead = waiting.filter(gpu_model__isnull=True).count()
    else:
        ahead = waiting.filter(gpu_model__name=gpu_model).count()
    lower = price.get("interruptible")
    return LaunchQuote(
        price_micros_per_hour=quote.price_micros_per_hour,
        card_burn_micros_per_hour=quote.card_burn_micros_per_hour,
        runway_seconds=runway,
        available_now=offer["available"] if not ahead else 0,
        queue_ahead=ahead,
        budgets=_budgets_left(user=user, account=account, quote=quote),
        interruptible=_with_surcharge(lower, surcharge_micros_per_hour) if lower else None,
        surcharge_micros_per_hour=surcharge_micros_per_hour,
    )


def launch_environments(*, user, catalog: dict) -> list[dict]:
    """What the launch page offers: the published environments some node has (the catalog's), then the
    user's own venvs whose base is one of them (``mine:<name>``), each with its hourly surcharge."""
    published = {e["name"]: e for e in catalog["environments"]}
    offered = [
        {
            "value": e["name"],
            "name": e["name"],
            "own": None,
            "surcharge_micros_per_hour": e["surcharge_micros_per_hour"],
        }
        for e in published.values()
    ]
    for env in prov_selectors.environments_own(user=user):
        base = published.get(env.base.name)
        if base is not None:
            offered.append(
                {
                    "value": f"{OWN_PREFIX}{env.name}",
                    "name": env.name,
                    "own": {"home_path": env.home_path, "base": env.base.name},
                    "surcharge_micros_per_hour": base["surcharge_micros_per_hour"],
                }
            )
    return offered


def _launch_choice(request: HttpRequest, catalog: dict, environments: list[dict]) -> dict:
    """The model/profile/environment picked in the form, defaulting to the first offered."""
    data = request.POST if request.method == "POST" else request.GET
    models = {m["name"]: m for m in catalog["gpu_models"]}
    gpu_model = data.get("gpu_model") or (catalog["gpu_models"][0]["name"] if models else "")
    offered = [p["profile"] for p in models[gpu_model]["profiles"]] if gpu_model in models else []
    gpu_counts = {p["profile"]: p["gpu_count"] for p in models[gpu_model]["profiles"]} if offered else {}
    if catalog["cpu"]:
        offered.append("cpu")
    profile = data.get("profile") if data.get("profile") in offered else (offered[0] if offered else "")
    by_value = {e["value"]: e for e in environments}
    asked = data.get("environment") or ""
    picked = by_value.get(asked) or (environments[0] if environments else None)
    # A launch names what was asked, offered or not (the service says why not); a look picks one offered.
    launched = asked if request.method == "POST" and asked else None
    return {
        "gpu_model": gpu_model,
        "profile": profile,
        "offered": offered,
        "options": [(name, gpu_counts.get(name, 1)) for name in offered],  # (profile, whole GPUs it takes)
        "gpu_count": gpu_counts.get(profile, 1),
        "environment": launched or (picked["value"] if picked else ""),
        "surcharge_micros_per_hour": picked["surcharge_micros_per_hour"] if picked else 0,
        "max_hours": data.get("max_hours", ""),
        "idle_minutes": data.get("idle_minutes", ""),
        "tier": "interruptible" if data.get("tier") == "interruptible" else "on_demand",
        "resume": data.get("resume") == "on",
    }


def _number(text: str, *, field: str) -> float | None:
    if not text.strip():
        return None
    try:
        value = float(text)
    except ValueError:
        raise ValidationFailed(_("%(field)s must be a number.") % {"field": field}) from None
    return value


@login_required
def launch(request: HttpRequest) -> HttpResponse:
    account = account_or_404(request)
    catalog = prov_selectors.catalog()
    environments = launch_environments(user=request.user, catalog=catalog)
    choice = _launch_choice(request, catalog, environments)
    if request.method == "POST":
        try:
            max_hours = _number(choice["max_hours"], field=_("Longest duration"))
            idle = _number(choice["idle_minutes"], field=_("Idle stop"))
            launched = session_launch(
                user=request.user,
                account=account,
                gpu_model="" if choice["profile"] == "cpu" else choice["gpu_model"],
                profile=choice["profile"],
                environment=choice["environment"],
                max_hours=max_hours,
                idle_minutes=int(idle) if idle is not None else None,
                idempotency_key=request.POST.get("idempotency_key") or None,
                tier=choice["tier"],
                resume=choice["resume"],
            )
        except ApplicationError as exc:
            messages.error(request, exc.message)
        else:
            return redirect("session_detail", session_id=launched.session.id)
    quote = None
    if choice["profile"]:
        quote = launch_quote(
            user=request.user,
            account=account,
            catalog=catalog,
            gpu_model="" if choice["profile"] == "cpu" else choice["gpu_model"],
            profile=choice["profile"],
            surcharge_micros_per_hour=choice["surcharge_micros_per_hour"],
        )
    context = {
        "account": account,
        "accounts": accounts_payable_by(user=request.user),
        "catalog": catalog,
        "environments": environments,
        "choice": choice,
        "quote": quote,
        "new_key": uuid.uuid4().hex,
        "defaults": _defaults(),
        "grace_seconds": settings.SESSION_PREEMPT_GRACE_SECONDS,
    }
    return render(request, "portal/launch.html", context)


def _defaults() -> dict:
    return {
        "max_hours": settings.SESSION_DEFAULT_MAX_HOURS,
        "idle_minutes": settings.SESSION_DEFAULT_IDLE_MINUTES,
        "large_reserve_minutes": settings.QUEUE_LARGE_RESERVE_SECONDS // 60,
    }


@login_required
def session_list(request: HttpRequest) -> HttpResponse:
    sessions = prov_selectors.session_list_for_user(user=request.user)
    state = request.GET.get("state", "")
    if state == "live":
        sessions = sessions.filter(state__in=Session.LIVE)
    elif state == "ended":
        sessions = sessions.filter(state__in=Session.ENDED)
    return render(request, "portal/session_list.html", {"sessions": sessions[:200], "state": state})


def _session(request: HttpRequest, session_id) -> Session:
    try:
        return prov_selectors.session_get_for_user(user=request.user, session_id=session_id)
    except NotFound:
        raise Http404 from None


ENFORCED_WHY = {
    "device-nodes": gettext_lazy("the sandbox's /dev holds only this GPU"),
    "device-request": gettext_lazy("the container was given this GPU alone"),
    "environment": gettext_lazy("only CUDA_VISIBLE_DEVICES names it, which code in the notebook can change"),
    "whole-device": gettext_lazy("the whole device is yours"),
    "mig": gettext_lazy("a MIG device: the GPU partitions it in hardware"),
    "mps": gettext_lazy("the NVIDIA MPS daemon caps it"),
    "libvgpu": gettext_lazy("HAMi-core (libvgpu.so) is preloaded by the system, not by a variable"),
    "ld-preload-variable": gettext_lazy(
        "HAMi-core is preloaded through LD_PRELOAD only, which code can unset"
    ),
    "no-libvgpu": gettext_lazy("HAMi-core (libvgpu.so) is not installed on this node"),
    "time-slicing": gettext_lazy("time-sliced with the other sessions on this GPU"),
}


def _compute_line(limits: Limits) -> str:
    percent = limits.compute_percent or 0
    if limits.policy == "exclusive":
        return _("the whole device")
    if limits.policy == "fixed-share":
        return _("%(percent)d%% of the SMs (HAMi-core)") % {"percent": percent}
    if limits.policy == "equal-share":
        return _("%(percent)d%% of the SMs (NVIDIA MPS)") % {"percent": percent}
    if limits.policy == "best-effort":
        return _("time-sliced with the others on the GPU, no guarantee")
    return limits.policy


def limits_shown(limits: Limits) -> dict | None:
    """The view's limits in the reader's words: per limit, enforced or advisory and why (as the node
    reported it; nothing reported reads as advisory). None without a device."""
    if limits.device is None:
        return None
    return {
        "enforcement": {
            key: {
                "enforced": row.enforced,
                "why": ENFORCED_WHY.get(row.by, _("the node has not reported how it enforces this")),
            }
            for key, row in limits.enforced.items()
        },
        "device": limits.device,
        "devices": limits.devices,
        "slots": limits.slot_range,
        "memory_cap_mib": limits.memory_cap_mib,
        "compute": _compute_line(limits),
        "policy": limits.policy,
    }


CHART_SAMPLES = 120


def chart_series(view: SessionView) -> dict[str, list[float | None]]:
    """The view's last samples for the chart: GPU utilisation, and memory use as % of the cap; nothing
    before it runs on a device."""
    if view.limits.device is None or view.elapsed_seconds is None:
        return {}
    samples = (view.metrics.samples or ())[-CHART_SAMPLES:]
    cap = max(1, view.limits.memory_cap_mib or 1)
    return {
        _("GPU %"): [s.gpu_util_percent for s in samples],
        _("Memory %"): [
            None if s.memory_used_mib is None else min(100.0, s.memory_used_mib * 100 / cap) for s in samples
        ],
    }


def _session_context(request: HttpRequest, session: Session) -> dict:
    view = session_view(session)
    order = [state for state, _label in PROGRESS]
    reached = order.index(view.state) if view.state in order else len(order)
    if view.state in Session.ENDED or view.state == S.STOPPING:
        reached = len(order) if session.running_at else order.index(S.STARTING)
    steps = [
        {"state": state, "label": label, "done": i < reached, "current": view.state == state}
        for i, (state, label) in enumerate(PROGRESS)
    ]
    return {
        "session": session,
        "view": view,
        "steps": steps,
        "queue": view.queue,
        "large_reserve_minutes": settings.QUEUE_LARGE_RESERVE_SECONDS // 60,
        "limits": limits_shown(view.limits),
        "metrics": chart_series(view),
        "events": session.events.order_by("-at")[:50],
        "live": view.live,
        "live_seconds": live_seconds(session),
        "jupyter_url": view.lab_url,
    }


@login_required
def session_detail(request: HttpRequest, session_id) -> HttpResponse:
    session = _session(request, session_id)
    return render(request, "portal/session_detail.html", _session_context(request, session))


@login_required
def session_live(request: HttpRequest, session_id) -> HttpResponse:
    session = _session(request, session_id)
    response = render(request, "portal/includes/session_state.html", _session_context(request, session))
    response["X-Live-Seconds"] = live_seconds(session)
    return response


def live_seconds(session: Session) -> str:
    """How soon the session page asks again: quickly while the session is on its way to running."""
    return "0.5" if session.state in (S.QUEUED, S.PLACING, S.STARTING) else "2"


@login_required
@require_POST
def session_stop_view(request: HttpRequest, session_id) -> HttpResponse:
    session = _session(request, session_id)
    try:
        session_stop(session=session, actor=request.user, reason=message("from_session_page"))
    except ApplicationError as exc:
        messages.error(request, exc.message)
    else:
        messages.success(request, _("Stopping: billing ends when the workload is gone."))
    return redirect("session_detail", session_id=session.id)


@login_required
@require_POST
def session_still_here_view(request: HttpRequest, session_id) -> HttpResponse:
    """ "I'm still here" on the session page: its idle clock restarts and its idle warning goes."""
    session = _session(request, session_id)
    try:
        session_keep_alive(session_id=session.id)
    except ApplicationError as exc:
        messages.error(request, exc.message)
    else:
        messages.success(request, _("The idle clock starts again."))
    return redirect("session_detail", session_id=session.id)


def running_sessions(*, user) -> list[SessionView]:
    """The user's live sessions, for the dashboard."""
    return session_views(prov_selectors.live_sessions_of(user=user))


# --- operations --------------------------------------------------------------------------------------


# The operations page's reads, polled while an operator has it open: compiled once per process.
_NODES = Lookup(lambda: Node.objects.order_by("name"), key_types=(), many=True)
_DEVICES = Lookup(
    lambda: Device.objects.select_related("gpu_model").order_by("node_id", "index", "uuid"),
    key_types=(),
    many=True,
)
_QUEUE = Lookup(
    lambda: (
        Session.objects.filter(state=S.QUEUED)
        .select_related("owner", "gpu_model", "profile")
        .order_by("-queue_priority", "queued_at")[:100]
    ),
    key_types=(),
    many=True,
)
_SESSIONS_BY_STATE = Lookup(
    lambda: (
        Session.objects.filter(state__in=[S.RUNNING, S.QUEUED, S.PLACING, S.STARTING])
        .values("state")
        .annotate(n=Count("id"))
        .order_by()
        .values_list("state", "n")
    ),
    key_types=(),
    many=True,
)
_REVENUE_SINCE = Lookup(
    lambda since: (
        Entry.objects.filter(account__kind=LedgerAccount.Kind.REVENUE, transfer__created_at__gte=since)
        .values("account__kind")
        .annotate(total=Sum("amount_micros"))
        .order_by()
        .values_list("total", flat=True)
    ),
    key_types=(datetime,),
    many=True,
)


def fleet_compute(devices: list[Device], nodes: dict[int, Node]) -> dict:
    """Effective compute Q = C · N · u over the healthy whole ``devices`` (read with their GPU models) of
    active ``nodes`` (by id): C the peak TFLOPS of each GPU, N the GPUs, u their utilisation now (last
    heartbeat)."""
    counted = [
        device
        for device in devices
        if nodes[device.node_id].state == Node.State.ACTIVE
        and device.health == Device.Health.OK
        and device.parent_id is None
    ]
    peak = used = 0.0
    for device in counted:
        tflops = device.gpu_model.peak_tflops if device.gpu_model else 0.0
        util = (device.last_metrics or {}).get("gpu_util_percent")
        peak += tflops
        used += tflops * (util or 0) / 100
    return {
        "gpus": len(counted),
        "peak_tflops": peak,
        "utilisation": (used / peak) if peak else None,
        "effective_tflops": used,
    }


def revenue_today() -> int:
    start = timezone.localtime().replace(hour=0, minute=0, second=0, microsecond=0)
    return sum(_REVENUE_SINCE.all(start))


@staff_member_required
def operations(request: HttpRequest) -> HttpResponse:
    nodes = {node.id: node for node in _NODES.all()}
    devices = [
        device for device in _DEVICES.all() if device.node_id in nodes
    ]  # one enrolled since: next time
    held = prov_selectors.slot_maps()
    rows = {node_id: {"node": node, "devices": []} for node_id, node in nodes.items()}
    for device in devices:
        cells = held[device.id]
        rows[device.node_id]["devices"].append(
            {
                "device": device,
                "metrics": device.last_metrics or {},
                "cells": ["free" if cell is None else cell for cell in cells],
                "used": sum(cell is not None for cell in cells),
            }
        )
    by_state = dict(_SESSIONS_BY_STATE.all())
    context = {
        "nodes": list(rows.values()),  # by name
        "queue": _QUEUE.all(),
        "fleet": fleet_compute(devices, nodes),
        "revenue_today": revenue_today(),
        "counts": {
            "running": by_state.get(S.RUNNING, 0),
            "queued": by_state.get(S.QUEUED, 0),
            "starting": by_state.get(S.PLACING, 0) + by_state.get(S.STARTING, 0),
        },
        "since": timezone.now() - timedelta(minutes=1),
    }
    template = "portal/includes/ops_live.html" if request.GET.get("live") else "portal/operations.html"
    return render(request, template, context)


def landing_prices() -> dict:
    """Live prices and what is free now, for the landing page (anyone may see them)."""
    return prov_selectors.catalog()


@login_required
def running_live(request: HttpRequest) -> HttpResponse:
    return render(request, "includes/running.html", {"running": running_sessions(user=request.user)})
