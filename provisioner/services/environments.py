"""Environments (docs/ENVIRONMENTS.md): admins publish them with a price tier; users save their own
virtualenvs kept in their homes; a launch names one of either (``environment_for_launch``).

The portal checks only the shape of a user's path (relative, no ``..``): whether it is a prefix inside
the home, without a link out of it, is for the node to check when a session starts (agents/environments),
since only the node sees the home."""

from __future__ import annotations

import re

from django.db import IntegrityError, transaction
from django.db.models import ProtectedError, Q
from django.utils.translation import gettext as _

from billing.audit import audit_record
from core.compiled import Lookup
from core.errors import Conflict, NotFound, ValidationFailed
from provisioner.catalog_cache import catalog_changed
from provisioner.models import Environment, Node

OWN_PREFIX = "mine:"  # a launch names a user's own environment "mine:<name>", a published one by its name
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]{0,63}$")
HOME_PATH_MAX = 200
OWN_PER_USER = 20


def _name_check(name: str) -> None:
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise ValidationFailed(
            _("A name is 1 to 64 letters, digits and . _ + - (starting with a letter or digit)."),
            fields={"name": "invalid"},
        )


def home_path_check(home_path: str) -> str:
    """The home path as given, when it is a relative path without ``..``; the node checks the rest."""
    path = (home_path or "").strip().removeprefix("~/")
    parts = path.split("/")
    if (
        not path
        or len(path) > HOME_PATH_MAX
        or path.startswith("/")
        or any(p in ("", ".", "..") for p in parts)
    ):
        raise ValidationFailed(
            _("The path must be a folder inside your home, such as .venvs/torch (no .. and not absolute)."),
            fields={"home_path": "invalid"},
        )
    if not path.isprintable():
        raise ValidationFailed(_("The path must be printable."), fields={"home_path": "invalid"})
    return path


def _audited(env: Environment | None) -> dict | None:
    if env is None:
        return None
    return {
        "interface": env.interface,
        "python": env.python,
        "image": env.image,
        "surcharge_micros_per_hour": env.surcharge_micros_per_hour,
        "enabled": env.enabled,
    }


def environment_publish(
    *,
    name: str,
    python: str = "",
    image: str = "",
    interface: str = Environment.Interface.JUPYTERLAB,
    surcharge_micros_per_hour: int = 0,
    cpu_cores: float = 2.0,
    memory_mib: int = 8192,
    enabled: bool = True,
    actor=None,
    reason: str = "",
) -> Environment:
    """Publish (or change) the environment ``name``: its interpreter or image, what it serves in the
    browser (``interface``: JupyterLab or VS Code) and its price tier, an hourly surcharge in micro-units
    added to every session launched with it from now on (running sessions keep the price they launched
    with). Writes an audit row; one transaction, the row locked. Raises ValidationFailed."""
    _name_check(name)
    if interface not in Environment.Interface.values:
        raise ValidationFailed(
            _("Unknown interface %(interface)s.") % {"interface": repr(interface)},
            fields={"interface": "unknown"},
        )
    if python and not python.startswith("/"):
        raise ValidationFailed(
            _("The interpreter must be an absolute path."), fields={"python": "not absolute"}
        )
    if isinstance(surcharge_micros_per_hour, bool) or not isinstance(surcharge_micros_per_hour, int):
        raise ValidationFailed(_("A surcharge is a whole number of micro-units per hour."))
    if surcharge_micros_per_hour < 0:
        raise ValidationFailed(
            _("A surcharge cannot be negative."), fields={"surcharge_micros_per_hour": "< 0"}
        )
    with transaction.atomic():
        env = Environment.objects.select_for_update().filter(name=name, owner__isnull=True).first()
        before = _audited(env)
        env = env or Environment(name=name)
        env.python, env.image, env.enabled, env.interface = python, image, enabled, interface
        env.surcharge_micros_per_hour = surcharge_micros_per_hour
        env.cpu_cores, env.memory_mib = cpu_cores, memory_mib
        env.save()
        audit_record(
            actor=actor,
            action="environment.publish",
            target=env,
            before=before,
            after=_audited(env),
            reason=reason,
        )
    return env


def environment_save(*, user, name: str, home_path: str, base: str) -> Environment:
    """Register the user's own environment ``name``: the prefix at ``home_path`` in their home, made from
    the published environment ``base``. Raises ValidationFailed (a bad name or path, an unknown base, too
    many), Conflict (the name is taken)."""
    _name_check(name)
    home_path = home_path_check(home_path)
    base_env = Environment.objects.filter(name=base, owner__isnull=True, enabled=True).first()
    if base_env is None:
        raise ValidationFailed(
            _("Unknown environment %(environment)s.") % {"environment": repr(base)},
            fields={"base": "unknown"},
        )
    if Environment.objects.filter(owner=user, enabled=True).count() >= OWN_PER_USER:
        raise ValidationFailed(_("You have as many environments as allowed: remove one first."))
    try:
        with transaction.atomic():
            return Environment.objects.create(
                owner=user,
                name=name,
                home_path=home_path,
                base=base_env,
                cpu_cores=base_env.cpu_cores,
                memory_mib=base_env.memory_mib,
            )
    except IntegrityError:
        raise Conflict(_("You already have an environment named %(name)s.") % {"name": name}) from None


def environment_remove(*, user, environment_id: int) -> None:
    """Remove the user's own environment from the portal (its files stay in the home). One that past
    sessions name is kept for them, disabled and renamed out of the way. Raises NotFound."""
    env = Environment.objects.filter(id=environment_id, owner=user, enabled=True).first()
    if env is None:
        raise NotFound(_("No such environment."))
    try:
        with transaction.atomic():
            env.delete()
    except ProtectedError:
        Environment.objects.filter(id=env.id).update(enabled=False, name=f"{env.name[:40]}~removed-{env.id}")


# A published environment by name (every launch names one): compiled once (core.compiled).
_PUBLISHED_NAMED = Lookup(
    lambda name: Environment.objects.filter(name=name, owner__isnull=True, enabled=True), key_types=(str,)
)


def environment_for_launch(*, user, environment: str) -> Environment:
    """The environment a launch names: ``mine:<name>`` for the user's own, else a published one.
    Raises ValidationFailed when there is none by that name."""
    if isinstance(environment, str) and environment.startswith(OWN_PREFIX):
        env = (
            Environment.objects.select_related("base")
            .filter(owner=user, name=environment.removeprefix(OWN_PREFIX), enabled=True, base__enabled=True)
            .first()
        )
    else:
        env = _PUBLISHED_NAMED.first(environment)
    if env is None:
        raise ValidationFailed(
            _("Unknown environment %(environment)s.") % {"environment": repr(environment)},
            fields={"environment": "unknown"},
        )
    return env


def nodes_lacking(environment: Environment) -> list[int]:
    """The nodes that cannot run ``environment``: those that did not report its interpreter (one with
    no interpreter, the agent's own or an image, runs everywhere), and for VS Code those whose agent
    did not report code-server (``interfaces``)."""
    runs_on = environment.runs_on
    lacking: set[int] = set()
    if runs_on.python:
        reported = Node.objects.filter(environments__isnull=False)
        lacking.update(reported.exclude(environments__contains=[runs_on.python]).values_list("id", flat=True))
    if runs_on.interface != Environment.Interface.JUPYTERLAB:
        lacking.update(
            Node.objects.exclude(interfaces__contains=[runs_on.interface]).values_list("id", flat=True)
        )
    return sorted(lacking)


def environment_on_some_node(environment: Environment) -> bool:
    """Whether any node reported the interpreter ``environment`` runs on (one without needs none)."""
    python = environment.runs_on.python
    return (
        not python
        or Node.objects.filter(Q(environments__isnull=True) | Q(environments__contains=[python])).exists()
    )


def node_environments_record(*, node: Node, reported) -> list[str] | None:
    """The node's served interpreters as its heartbeat reported them (``capabilities.environments``), to
    store when they changed (the catalog then says so); None when unchanged or not reported."""
    if not isinstance(reported, list):
        return None
    served = sorted({p for p in reported if isinstance(p, str) and p.startswith("/")})[:1000]
    if node.environments is not None and served == sorted(node.environments):
        return None
    catalog_changed()
    return served
