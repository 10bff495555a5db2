"""Reads of the provisioner: catalog, sessions, queue positions, quota usage, desired workloads."""

from __future__ import annotations

import re
import statistics
import uuid
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime

from django.conf import settings
from django.core.cache import cache
from django.db.models import Count, F, Q, QuerySet, Window
from django.db.models.functions import RowNumber
from django.utils import timezone
from django.utils.translation import gettext as _

from billing.models import Account, CardBurnRate, Price
from billing.rules import accounts_payable_by
from billing.services.pricing import INTERRUPTIBLE, ON_DEMAND, price_quote
from core.compiled import Lookup
from core.errors import NotFound
from provisioner import quotas
from provisioner.catalog_cache import catalog_version
from provisioner.models import (
    SLOTS_PER_GPU,
    Allocation,
    AllocationSlot,
    Device,
    Environment,
    GpuModel,
    HomeUsage,
    Node,
    Profile,
    Session,
    StopWarning,
)
from provisioner.placement import free_index, node_gpus_most, request_for
from provisioner.preemption import Preemptible
from provisioner.sealing import unseal

_USER_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


def workload_user(user) -> str:
    """The agent's name for a user's home directory: readable and unique (the id is part of it)."""
    name = _USER_UNSAFE.sub("_", user.get_username())[:40] or "user"
    if not re.match(r"[A-Za-z0-9_]", name[0]):
        name = f"_{name}"
    return f"{name}-{user.pk}"


def workload_spec(session: Session) -> dict:
    """The workload spec of docs/AGENT_PROTOCOL.md for one placed session (a multi-GPU one lists every
    GPU in ``device_uuids``, and a session that mounts team folders names them in ``teams``)."""
    env = session.environment
    allocation = None
    if session.device_id is not None:
        allocation = {
            "device_uuid": session.device.uuid,
            "profile": session.profile.name,
            "slot_start": session.slot_start,
            "slot_count": session.slot_count,
            "sharing_policy": session.sharing_policy,
        }
        devices = session.gpu_devices()
        if len(devices) > 1:
            allocation["device_uuids"] = [d.uuid for d in devices]
    spec = {
        "session_id": str(session.id),
        "user": workload_user(session.owner),
        "token": unseal(session.jupyter_token_sealed),
        "base_url": session.base_url,
        "environment": _environment_spec(env),
        "allocation": allocation,
        "limits": {"cpu_cores": float(env.cpu_cores), "memory_mib": int(env.memory_mib)},
    }
    if session.team_folders:  # absent otherwise: the spec (and its fingerprint) of agents before them
        spec["teams"] = list(session.team_folders)
    return spec


def _environment_spec(env: Environment) -> dict:
    """The spec's environment: a user's own runs on the published one it came from, with its prefix in
    the home (``home_prefix``); ``interface`` only for VS Code (a JupyterLab spec is the one agents before
    the interface knew, so its fingerprint is unchanged)."""
    runs_on = env.runs_on
    spec = {"name": env.name, "python": runs_on.python or None, "image": runs_on.image or None}
    if env.home_path:
        spec["home_prefix"] = env.home_path
    if runs_on.interface != Environment.Interface.JUPYTERLAB:
        spec["interface"] = runs_on.interface
    return spec


def desired_workloads(*, node: Node) -> list[dict]:
    """What the node's agent should run: its sessions in placing, starting or running."""
    sessions = (
        Session.objects.filter(node=node, state__in=Session.ON_NODE)
        .select_related("environment__base", "owner", "device", "profile")
        .prefetch_related("devices")
        .order_by("created_at")
    )
    return [workload_spec(s) for s in sessions]


HOMES_LABEL = ("homes", "shared")  # a node's label: it mounts the pool's shared homes root (docs/STORAGE.md)


def home_nodes(*, user_id) -> frozenset[int]:
    """The active nodes where this user's files are, for placement to prefer (empty: any node will do).
    With shared homes: every node labelled ``homes: shared``. Otherwise the node that last measured the
    user's home, or all the shared ones when that node is one of them. One or two queries."""
    shared = Node.objects.filter(state=Node.State.ACTIVE, **{f"labels__{HOMES_LABEL[0]}": HOMES_LABEL[1]})
    if settings.HOMES_BACKEND == "shared":
        return frozenset(shared.values_list("id", flat=True))
    measured = HomeUsage.objects.filter(user_id=user_id, node__state=Node.State.ACTIVE)
    where = measured.values_list("node_id", "node__labels").first()
    if where is None:
        return frozenset()
    node_id, labels = where
    if isinstance(labels, dict) and labels.get(HOMES_LABEL[0]) == HOMES_LABEL[1]:
        return frozenset(shared.values_list("id", flat=True))
    return frozenset({node_id})


# What every reader of a session shows besides the row (session_view); a multi-GPU session's devices are
# read when shown (Session.gpu_devices).
SESSION_SHOWN = ("gpu_model", "profile", "environment", "node", "device", "account")
LIVE_LISTED = 20  # the live sessions the dashboard lists

# A user's session by id (every API answer about a session, every proxied Jupyter request) and a user's
# live sessions (the dashboard, at every look): lookups compiled once (core.compiled).
_SESSION_OF_USER = Lookup(
    lambda sid, owner_id: Session.objects.select_related(*SESSION_SHOWN).filter(id=sid, owner_id=owner_id),
    key_types=(uuid.UUID, int),
)
_LIVE_SESSIONS_OF_USER = Lookup(
    lambda owner_id: (
        Session.objects.select_related(*SESSION_SHOWN)
        .filter(owner_id=owner_id, state__in=Session.LIVE)
        .order_by("-created_at")[:LIVE_LISTED]
    ),
    key_types=(int,),
    many=True,
)


def session_get_for_user(*, user, session_id) -> Session:
    """A session of this user; anyone else's (or a malformed id) is NotFound."""
    session = _SESSION_OF_USER.first(session_id, user.pk)
    if session is None:
        raise NotFound(_("No such session."))
    return session


def session_list_for_user(*, user) -> QuerySet[Session]:
    return (
        Session.objects.filter(owner=user)
        .select_related(*SESSION_SHOWN)
        .order_by("-created_at")  # session_views reads the devices of the multi-GPU ones
    )


def live_sessions_of(*, user) -> list[Session]:
    """The user's live sessions (queued to stopping), newest first, the first LIVE_LISTED."""
    return _LIVE_SESSIONS_OF_USER.all(user.pk)


# The notebook a session opens on; the agent starts its kernel as soon as JupyterLab answers
# (agents/gateway.py, WELCOME_NOTEBOOK), so the kernel is up by the time the page is.
WELCOME_NOTEBOOK = "Welcome.ipynb"


def session_lab_url(session: Session) -> str:
    """The browser's way into a running session's JupyterLab (or VS Code, which opens on the home
    folder by itself), through the portal's proxy."""
    if session.environment.interface == Environment.Interface.VSCODE:
        return session.base_url
    return f"{session.base_url}lab/tree/{WELCOME_NOTEBOOK}"


def session_jupyter_target(*, user, session_id) -> tuple[str, str] | Session:
    """For the Jupyter proxy: (node address, node token) of the user's running session (the agent there
    is the node's gateway to the workload), or the Session itself when it exists but is not running (for
    a friendly page). Raises NotFound for anyone else's."""
    session = session_get_for_user(user=user, session_id=session_id)
    if session.state == Session.State.RUNNING and session.upstream and session.node_id:
        node = Node.objects.only("address", "token_sealed").get(pk=session.node_id)
        return node.address.rstrip("/"), unseal(node.token_sealed)
    return session


@dataclass(frozen=True)
class StopNotice:
    """A live stop warning as its session's people read it (``session_notices``)."""

    kind: str
    message: str
    due_at: datetime
    seconds_left: int
    still_here: bool  # "I'm still here" puts it off (an idle warning)


def session_notices(*, session: Session, now: datetime | None = None) -> list[StopNotice]:
    """The live stop warnings of a session while it runs, soonest first, their lines in the active
    language; none for a session that is not running (its warnings are moot)."""
    return stop_notices_of(session_ids=[session.id], now=now).get(session.id, [])


# Read with every look at a page of sessions (the dashboard's, the sessions page, one session's):
# compiled once per process, for any number of sessions.
_STOP_WARNINGS = Lookup(
    lambda ids: StopWarning.objects.filter(
        session_id__any=ids, session__state=Session.State.RUNNING, cleared_at__isnull=True
    ).order_by("due_at", "id"),
    key_types=(list,),
    many=True,
)
_RESUMED = Lookup(
    lambda ids: Session.objects.filter(resumed_from_id__any=ids).values_list("resumed_from_id", "id"),
    key_types=(list,),
    many=True,
)


def stop_notices_of(*, session_ids, now: datetime | None = None) -> dict[uuid.UUID, list[StopNotice]]:
    """``session_notices`` of many sessions in one query: session id → its notices (running ones only)."""
    session_ids = list(session_ids)
    if not session_ids:
        return {}
    now = now or timezone.now()
    found: dict[uuid.UUID, list[StopNotice]] = {}
    for w in _STOP_WARNINGS.all(session_ids):
        found.setdefault(w.session_id, []).append(
            StopNotice(
                kind=w.kind,
                message=w.message_display,
                due_at=w.due_at,
                seconds_left=max(0, int((w.due_at - now).total_seconds())),
                still_here=w.kind == StopWarning.Kind.IDLE,
            )
        )
    return found


def queue_order(sessions: list[Session], *, served: dict[int, int] | None = None) -> list[Session]:
    """FCFS within a priority, round-robin between accounts: the n-th waiting session of every account
    goes before the (n+1)-th of any. ``served`` (account id → sessions it has on nodes now) counts
    towards n, so an account just served waits behind one that was not, from one dispatch to the next."""
    rank: dict[int, int] = dict(served or {})
    keyed = []
    for session in sorted(sessions, key=lambda s: (s.queued_at or s.created_at, str(s.id))):
        rank[session.account_id] = rank.get(session.account_id, 0) + 1
        keyed.append(((-session.queue_priority, rank[session.account_id], session.queued_at), session))
    return [s for _key, s in sorted(keyed, key=lambda pair: pair[0])]


def preemptible_sessions(*, gpu_model_id: int, now: datetime) -> list[Preemptible]:
    """The allocations of ``gpu_model_id`` an on-demand launch may take by preemption: those of running
    interruptible sessions not already being stopped for another request."""
    rows = Allocation.objects.filter(
        session__gpu_model_id=gpu_model_id,
        session__tier=Session.Tier.INTERRUPTIBLE,
        session__state=Session.State.RUNNING,
        session__preempted_for__isnull=True,
    ).values_list("session_id", "device_id", "slot_start", "slot_count", "session__running_at")
    return [
        Preemptible(session_id, device_id, start, count, (now - (running_at or now)).total_seconds())
        for session_id, device_id, start, count, running_at in rows
    ]


def resumed_as_of(*, session_ids) -> dict[uuid.UUID, uuid.UUID]:
    """Preempted session id → the session that resumes it (one query; none for no ids)."""
    if not session_ids:
        return {}
    return dict(_RESUMED.all(list(session_ids)))


def queue_served(*, account_ids) -> dict[int, int]:
    """For ``queue_order``: how many sessions each of these accounts has on nodes now."""
    rows = (
        Session.objects.filter(account_id__in=set(account_ids), state__in=Session.ON_NODE)
        .values("account_id")
        .annotate(n=Count("id"))
    )
    return {row["account_id"]: row["n"] for row in rows}


@dataclass(frozen=True)
class QueuePlace:
    position: int  # 1 = next
    estimate_seconds: int | None  # None: unknown


def queue_place(*, session: Session) -> QueuePlace | None:
    """Where a queued session stands among those waiting for the same GPU model, and a rough wait:
    position × the median recent session length ÷ the model's devices. None unless queued."""
    return queue_places(sessions=[session]).get(session.id)


RECENT_SESSIONS_FOR_ESTIMATE = 50


def queue_places(*, sessions: list[Session]) -> dict[uuid.UUID, QueuePlace]:
    """``queue_place`` of each queued session among ``sessions`` (the others are left out), in two
    queries whatever their number: the waiting sessions and the accounts' sessions on nodes (the recent
    lengths and the devices of their GPU models come from the cache, two more when it misses)."""
    queued = [s for s in sessions if s.state == Session.State.QUEUED]
    if not queued:
        return {}
    model_ids = {s.gpu_model_id for s in queued}
    of_models = Q(gpu_model_id__in=[m for m in model_ids if m is not None])
    if None in model_ids:  # CPU sessions wait in a queue of their own
        of_models |= Q(gpu_model__isnull=True)
    waiting_by_model: dict[int | None, list[Session]] = {}
    waiting = list(Session.objects.filter(of_models, state=Session.State.QUEUED))
    for session in waiting:
        waiting_by_model.setdefault(session.gpu_model_id, []).append(session)
    served = queue_served(account_ids=[s.account_id for s in waiting])
    durations_by_model, devices_by_model = _queue_statistics(of_models, model_ids)
    places = {}
    for session in queued:
        ordered = [s.id for s in queue_order(waiting_by_model.get(session.gpu_model_id, []), served=served)]
        position = ordered.index(session.id) + 1 if session.id in ordered else len(ordered) + 1
        durations = durations_by_model.get(session.gpu_model_id)
        if not durations:
            places[session.id] = QueuePlace(position, None)
            continue
        devices = max(1, devices_by_model.get(session.gpu_model_id, 0))
        places[session.id] = QueuePlace(position, int(statistics.median(durations) * position / devices))
    return places


def _queue_statistics(of_models: Q, model_ids: set) -> tuple[dict, dict]:
    """For each GPU model: the lengths of its recent sessions and its healthy devices, for the wait
    estimate. The same for everyone, and an estimate: cached for ``CATALOG_CACHE_SECONDS`` on its own
    key, not with the catalog, whose version every launch and stop replaces."""
    key = f"queue-statistics:{sorted(map(str, model_ids))}"
    found = cache.get(key)
    if found is not None:
        return found
    durations_by_model: dict[int | None, list[float]] = {}
    recent = (
        Session.objects.filter(of_models, state=Session.State.STOPPED, running_at__isnull=False)
        .annotate(
            recency=Window(RowNumber(), partition_by=[F("gpu_model_id")], order_by=F("ended_at").desc())
        )
        .filter(recency__lte=RECENT_SESSIONS_FOR_ESTIMATE)
        .values_list("gpu_model_id", "running_at", "ended_at")
    )
    for model_id, start, end in recent:
        if start and end:
            durations_by_model.setdefault(model_id, []).append((end - start).total_seconds())
    devices_by_model = dict(
        Device.objects.filter(of_models, health=Device.Health.OK)
        .values_list("gpu_model_id")
        .annotate(n=Count("id"))
    )
    cache.set(key, (durations_by_model, devices_by_model), timeout=settings.CATALOG_CACHE_SECONDS)
    return durations_by_model, devices_by_model


def slot_map(*, device: Device) -> list[str | None]:
    """Eight cells: the session id (short) holding each slot, or None."""
    slots = AllocationSlot.objects.filter(device=device)
    return _slot_cells(slots.values_list(*_SLOT_COLUMNS))[device.id]


_SLOT_COLUMNS = ("device_id", "slot", "allocation__session_id")
_HELD_SLOTS = Lookup(
    lambda: AllocationSlot.objects.values_list(*_SLOT_COLUMNS),
    key_types=(),
    many=True,
)


def slot_maps() -> defaultdict[int, list[str | None]]:
    """``slot_map`` of every device, by device id, in one query (compiled once per process): the
    operations page and the nodes API list the whole fleet."""
    return _slot_cells(_HELD_SLOTS.all())


def _slot_cells(slots) -> defaultdict[int, list[str | None]]:
    """(device id, slot, session id) rows as eight cells a device."""
    found: defaultdict[int, list[str | None]] = defaultdict(lambda: [None] * SLOTS_PER_GPU)
    for device_id, slot, session_id in slots:
        found[device_id][slot] = str(session_id)[:8]
    return found


def availability() -> dict[tuple[str, str], int]:
    """For each (gpu model, profile): how many more sessions would fit right now (no locks)."""
    found: dict[tuple[str, str], int] = {}
    profiles = {p.name: p for p in Profile.objects.all()}
    for model in GpuModel.objects.filter(enabled=True):
        index, _meta = free_index(gpu_model=model)
        for name in model.profiles:
            profile = profiles.get(name)
            if profile is None or profile.kind == Profile.Kind.CPU:
                continue
            found[(model.name, name)] = _count_fits(index, request_for(gpu_model=model, profile=profile))
    return found


def _count_fits(index, request) -> int:
    copy = index.copy()
    count = 0
    while (choice := copy.choose(request)) is not None and count < 1000:
        copy.occupy(choice)
        count += 1
    return count


def _price(*, gpu_model: str, profile: str, tier: str = ON_DEMAND) -> dict | None:
    """The catalog's price of a choice (from billing), or None when it has none; an on-demand price
    carries its ``interruptible`` one beside it (None: that tier is not offered)."""
    try:
        quote = price_quote(gpu_model=gpu_model, profile=profile, tier=tier)
    except NotFound:
        return None
    price = {
        "price_micros_per_hour": quote.price_micros_per_hour,
        "card_burn_micros_per_hour": quote.card_burn_micros_per_hour,
    }
    if tier == ON_DEMAND:
        price["interruptible"] = _price(gpu_model=gpu_model, profile=profile, tier=INTERRUPTIBLE)
    return price


def profiles_offered(*, gpu_model: GpuModel, profiles: dict[str, Profile]) -> list[str]:
    """The profiles ``gpu_model`` offers that its fleet can hold: a multi-GPU profile (``2x``…) only where
    some active node has that many GPUs of the model."""
    counts = [profiles[n].gpu_count for n in gpu_model.profiles if n in profiles]
    most = node_gpus_most(gpu_model=gpu_model) if any(c > 1 for c in counts) else 1
    return [n for n in gpu_model.profiles if n not in profiles or profiles[n].gpu_count <= most]


def catalog() -> dict:
    """Models with their offered profiles (``gpu_count``: the whole GPUs one takes), environments, prices
    (from billing) and availability now: from the cache, built when a change made it stale (see
    ``provisioner.catalog_cache``)."""
    key = f"catalog:{catalog_version()}"
    found = cache.get(key)
    if found is None:
        found = catalog_build()
        cache.set(key, found, timeout=_catalog_lifetime())
    return found


def _catalog_lifetime() -> int:
    """``CATALOG_CACHE_SECONDS``, and never past the moment a price or burn rate set for later applies."""
    lifetime = settings.CATALOG_CACHE_SECONDS
    now = timezone.now()
    later = [
        model.objects.filter(effective_from__gt=now)
        .order_by("effective_from")
        .values_list("effective_from", flat=True)
        .first()
        for model in (Price, CardBurnRate)
    ]
    for moment in filter(None, later):
        lifetime = min(lifetime, max(1, int((moment - now).total_seconds()) + 1))
    return lifetime


def catalog_build() -> dict:
    """The catalog as the database has it now (``catalog`` keeps it cached)."""
    free = availability()
    profiles = {p.name: p for p in Profile.objects.all()}
    models = []
    for model in GpuModel.objects.filter(enabled=True).order_by("name"):
        offered = [
            {
                "profile": name,
                "gpu_count": profiles[name].gpu_count if name in profiles else 1,
                "price": _price(gpu_model=model.name, profile=name),
                "available": free.get((model.name, name), 0),
            }
            for name in profiles_offered(gpu_model=model, profiles=profiles)
        ]
        models.append(
            {
                "name": model.name,
                "memory_mib": model.memory_mib,
                "peak_tflops": model.peak_tflops,
                "placement_policy": model.placement_policy,
                "profiles": offered,
            }
        )
    cpu = None
    if Profile.objects.filter(kind=Profile.Kind.CPU).exists():
        price = _price(gpu_model="", profile="cpu")
        if price is not None:  # an unpriced CPU profile is not offered
            cpu = {
                "profile": "cpu",
                "price": price,
                "available": Node.objects.filter(state=Node.State.ACTIVE).count(),
            }
    return {
        "gpu_models": models,
        "cpu": cpu,
        "profiles": [
            {"name": p.name, "kind": p.kind, "eighths": p.eighths, "gpu_count": p.gpu_count}
            for p in sorted(profiles.values(), key=lambda p: (p.kind, p.name))
        ],
        # what some active node can run (docs/ENVIRONMENTS.md), with its price tier
        "environments": environments_offered(),
        "as_of": timezone.now().isoformat(),
    }


def environments_served_q() -> Q:
    """The published environments some active node can run (or that need no interpreter)."""
    pythons: set[str] = set()
    for served in Node.objects.filter(state=Node.State.ACTIVE).values_list("environments", flat=True):
        if served is None:  # an agent that does not report them is taken to have them all
            return Q()
        pythons.update(served)
    return Q(python="") | Q(python__in=sorted(pythons))


def published_pythons() -> list[str]:
    """The interpreters of the published environments: each heartbeat's answer names them, and the
    agent says which it has."""
    return sorted(
        set(
            Environment.objects.filter(owner__isnull=True, enabled=True)
            .exclude(python="")
            .values_list("python", flat=True)
        )
    )


def environments_own(*, user) -> list[Environment]:
    """The user's own environments (their venvs), with the published one each runs on."""
    return list(Environment.objects.filter(owner=user, enabled=True).select_related("base").order_by("name"))


def quota_usage(*, user) -> dict:
    """The user's own limits and what they use of them, and for each team they pay with, the team's and
    their member cap. For 'users can see their own quota'."""

    def pack(limits, usage) -> dict:
        return {
            "limits": limits.__dict__,
            "usage": {
                "sessions": usage.sessions,
                "eighths": usage.eighths,
                "spend_micros": usage.spend_micros,
            },
        }

    answer = {"user": pack(quotas.limits_for_user(user=user), quotas.usage_of_user(user=user)), "teams": []}
    home = quotas.home_use_of(user)  # the home as last measured; its limits are the user's max_home_*
    answer["user"]["home"] = home and {
        "bytes": home.bytes,
        "files": home.files,
        "measured_at": home.measured_at.isoformat(),
        "over": home.over,
    }
    for account in accounts_payable_by(user=user):
        if account.kind != Account.Kind.TEAM:
            continue
        answer["teams"].append(
            {
                "account": account.id,
                "name": account.name,
                "team": pack(
                    quotas.limits_for_account(account=account), quotas.usage_of_account(account=account)
                ),
                "member": pack(
                    quotas.limits_for_member(user=user, account=account),
                    quotas.usage_of_member(user=user, account=account),
                ),
            }
        )
    return answer


def environments_offered() -> list[dict]:
    """The published environments a launch may name: those whose interpreter some active node has
    (``environments_served_q``), a VS Code one only while an active node reports that it serves VS Code
    (its agent found code-server; agents/editors/install.sh); each with its price tier."""
    interfaces = {Environment.Interface.JUPYTERLAB.value}
    for served in Node.objects.filter(state=Node.State.ACTIVE).values_list("interfaces", flat=True):
        if isinstance(served, list):
            interfaces.update(i for i in served if isinstance(i, str))
    published = Environment.objects.filter(environments_served_q(), enabled=True, owner__isnull=True)
    return [
        {
            "name": e.name,
            "runtime": "docker" if e.image and not e.python else "process",
            "interface": e.interface,
            "surcharge_micros_per_hour": e.surcharge_micros_per_hour,
        }
        for e in published.order_by("name")
        if e.interface in interfaces
    ]
