"""The workload spec of docs/AGENT_PROTOCOL.md, validated strictly.

A malformed body raises SpecError naming every field at fault; unknown keys are refused too, so a
typo on the portal side is caught rather than silently ignored.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from agents.environments import home_prefix_error
from agents.gpuplan import Allocation

SESSION_ID_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
USER_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$")
TOKEN_RE = re.compile(r"^[\x21-\x7e]{8,256}$")
BASE_URL_RE = re.compile(r"^/(?:[A-Za-z0-9_.~-]+/)*$")
TEAM_KEY_RE = re.compile(r"^[0-9]{1,18}$")  # the team's account id: its folder's name under ``.teams``
TEAM_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_-]{0,99}$")  # the team's slug: where the sandbox shows it
TEAMS_MAX = 64
# What a workload serves its user: JupyterLab, or VS Code in the browser (code-server, agents/editors).
INTERFACES = ("jupyterlab", "vscode")
DEFAULT_INTERFACE = "jupyterlab"


class SpecError(ValueError):
    def __init__(self, fields: Mapping[str, str]) -> None:
        self.fields = dict(fields)
        super().__init__("; ".join(f"{path}: {why}" for path, why in self.fields.items()))


@dataclass(frozen=True)
class Environment:
    name: str
    python: str | None = None
    image: str | None = None
    home_prefix: str | None = None  # a user's own environment: a prefix in their home (agents/environments)
    # optional in the spec; the default is left out of ``to_json`` (the fingerprint agents recorded before)
    interface: str = DEFAULT_INTERFACE


@dataclass(frozen=True)
class Limits:
    cpu_cores: float
    memory_mib: int


@dataclass(frozen=True)
class TeamFolder:
    """A team's shared folder the workload sees (docs/STORAGE.md, "Team folders"): ``<homes>/.teams/<key>``
    on the node, ``/home/teams/<name>`` in the sandbox, read-only when ``read_only``."""

    key: str
    name: str
    read_only: bool


@dataclass(frozen=True)
class WorkloadSpec:
    session_id: str
    user: str
    token: str
    base_url: str
    environment: Environment
    allocation: Allocation | None
    limits: Limits
    teams: tuple[TeamFolder, ...] = ()

    def to_json(self) -> dict:
        """The spec as the portal sends it: a one-device allocation without ``device_uuids`` and a spec
        without team folders without ``teams`` (so its fingerprint is the one agents before multi-GPU
        sessions and team folders recorded)."""
        data = asdict(self)
        if data["environment"]["home_prefix"] is None:  # sent only for a user's own environment
            del data["environment"]["home_prefix"]
        if not data["teams"]:
            del data["teams"]
        else:
            data["teams"] = [dict(team) for team in data["teams"]]
        if data["environment"]["interface"] == DEFAULT_INTERFACE:
            del data["environment"]["interface"]
        allocation = data["allocation"]
        if allocation is not None:
            uuids = allocation.pop("device_uuids")
            if uuids:
                allocation["device_uuids"] = list(uuids)
        return data

    def fingerprint(self) -> str:
        """A digest of the whole spec, token included, to tell 'the same spec' from 'a different one'
        without storing the token itself."""
        return hashlib.sha256(json.dumps(self.to_json(), sort_keys=True).encode()).hexdigest()

    def token_sha256(self) -> str:
        return hashlib.sha256(self.token.encode()).hexdigest()


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check_keys(obj: Mapping, prefix: str, allowed: tuple[str, ...], errors: dict[str, str]) -> None:
    for key in obj:
        if key not in allowed:
            errors[f"{prefix}{key}"] = "unknown field"
    for key in allowed:
        if key not in obj:
            errors[f"{prefix}{key}"] = "required"


def parse_spec(body: Any, *, session_id: str | None = None) -> WorkloadSpec:
    """Validate a decoded JSON body; ``session_id`` is the one in the URL, which must match."""
    errors: dict[str, str] = {}
    if not isinstance(body, dict):
        raise SpecError({"": "the body must be a JSON object"})
    _check_keys(
        {k: v for k, v in body.items() if k != "teams"},
        "",
        ("session_id", "user", "token", "base_url", "environment", "allocation", "limits"),
        errors,
    )

    sid = body.get("session_id")
    if "session_id" in body and (not isinstance(sid, str) or not SESSION_ID_RE.match(sid)):
        errors["session_id"] = "must match [A-Za-z0-9_-]{1,64}"
    elif session_id is not None and sid is not None and sid != session_id:
        errors["session_id"] = "differs from the session id in the URL"
    user = body.get("user")
    if "user" in body and (not isinstance(user, str) or not USER_RE.match(user)):
        errors["user"] = "must match [A-Za-z0-9_][A-Za-z0-9_.-]{0,63}"
    token = body.get("token")
    if "token" in body and (not isinstance(token, str) or not TOKEN_RE.match(token)):
        errors["token"] = "must be 8 to 256 printable characters without spaces"
    base_url = body.get("base_url")
    if "base_url" in body and (not isinstance(base_url, str) or not BASE_URL_RE.match(base_url)):
        errors["base_url"] = "must be a path that starts and ends with /"

    environment = _parse_environment(body, errors)
    allocation = _parse_allocation(body, errors)
    limits = _parse_limits(body, errors)
    teams = _parse_teams(body, errors)
    if errors:
        raise SpecError(errors)
    return WorkloadSpec(sid, user, token, base_url, environment, allocation, limits, teams)


def _parse_teams(body: Mapping, errors: dict[str, str]) -> tuple[TeamFolder, ...]:
    """``body["teams"]`` (optional: none when absent), with its faults added to ``errors``."""
    teams = body.get("teams", [])
    if not isinstance(teams, list) or len(teams) > TEAMS_MAX:
        errors["teams"] = f"must be a list of at most {TEAMS_MAX} team folders"
        return ()
    parsed: list[TeamFolder] = []
    for i, team in enumerate(teams):
        prefix = f"teams.{i}."
        if not isinstance(team, dict):
            errors[f"teams.{i}"] = "must be an object"
            continue
        _check_keys(team, prefix, ("key", "name", "read_only"), errors)
        if "key" in team and (not isinstance(team["key"], str) or not TEAM_KEY_RE.match(team["key"])):
            errors[f"{prefix}key"] = "must be 1 to 18 digits"
        if "name" in team and (not isinstance(team["name"], str) or not TEAM_NAME_RE.match(team["name"])):
            errors[f"{prefix}name"] = "must match [A-Za-z0-9_][A-Za-z0-9_-]{0,99}"
        if "read_only" in team and not isinstance(team["read_only"], bool):
            errors[f"{prefix}read_only"] = "must be true or false"
        if not any(k.startswith(prefix) for k in errors):
            parsed.append(TeamFolder(team["key"], team["name"], team["read_only"]))
    for field in ("key", "name"):
        values = [getattr(t, field) for t in parsed]
        if len(set(values)) != len(values):
            errors["teams"] = f"two team folders have one {field}"
    return tuple(parsed)


def _parse_environment(body: Mapping, errors: dict[str, str]) -> Environment | None:
    """``body["environment"]``, or None with its faults added to ``errors``."""
    env = body.get("environment")
    if "environment" not in body:
        return None
    if not isinstance(env, dict):
        errors["environment"] = "must be an object"
        return None
    # optional: a user's own environment (home_prefix), a workload that is not JupyterLab (interface)
    named = {k: v for k, v in env.items() if k not in ("home_prefix", "interface")}
    _check_keys(named, "environment.", ("name", "python", "image"), errors)
    interface = env.get("interface", DEFAULT_INTERFACE)
    if interface not in INTERFACES:
        errors["environment.interface"] = f"must be one of {', '.join(INTERFACES)}"
    if "name" in env and (not isinstance(env["name"], str) or not env["name"]):
        errors["environment.name"] = "must be a non-empty string"
    for key in ("python", "image"):
        if env.get(key) is not None and (not isinstance(env[key], str) or not env[key]):
            errors[f"environment.{key}"] = "must be a non-empty string or null"
    if env.get("python") is not None and isinstance(env["python"], str) and not env["python"].startswith("/"):
        errors["environment.python"] = "must be an absolute path or null"
    home_prefix = env.get("home_prefix")
    if home_prefix is not None and (why := home_prefix_error(home_prefix)):
        errors["environment.home_prefix"] = why
    if any(k.startswith("environment.") for k in errors):
        return None
    return Environment(env["name"], env["python"], env["image"], home_prefix=home_prefix, interface=interface)


def _parse_allocation(body: Mapping, errors: dict[str, str]) -> Allocation | None:
    """``body["allocation"]`` (None for a cpu session, or with its faults added to ``errors``)."""
    alloc = body.get("allocation")
    if alloc is None:
        return None
    if not isinstance(alloc, dict):
        errors["allocation"] = "must be an object or null"
        return None
    _check_keys(
        {k: v for k, v in alloc.items() if k != "device_uuids"},
        "allocation.",
        ("device_uuid", "profile", "slot_start", "slot_count", "sharing_policy"),
        errors,
    )
    uuids = alloc.get("device_uuids", [])
    if not isinstance(uuids, list) or not all(isinstance(u, str) and u for u in uuids) or len(uuids) > 16:
        errors["allocation.device_uuids"] = "must be a list of at most 16 non-empty strings"
    for key in ("device_uuid", "profile", "sharing_policy"):
        if key in alloc and (not isinstance(alloc[key], str) or not alloc[key]):
            errors[f"allocation.{key}"] = "must be a non-empty string"
    for key in ("slot_start", "slot_count"):
        if key in alloc and not _is_int(alloc[key]):
            errors[f"allocation.{key}"] = "must be an integer"
    if any(k.startswith("allocation.") for k in errors):
        return None
    fields = {k: alloc[k] for k in Allocation.__dataclass_fields__ if k != "device_uuids"}
    return Allocation(**fields, device_uuids=tuple(uuids))


def _parse_limits(body: Mapping, errors: dict[str, str]) -> Limits | None:
    """``body["limits"]``, or None with its faults added to ``errors``."""
    lim = body.get("limits")
    if "limits" not in body:
        return None
    if not isinstance(lim, dict):
        errors["limits"] = "must be an object"
        return None
    _check_keys(lim, "limits.", ("cpu_cores", "memory_mib"), errors)
    if "cpu_cores" in lim and (not _is_number(lim["cpu_cores"]) or not 0 < lim["cpu_cores"] <= 1024):
        errors["limits.cpu_cores"] = "must be a number in (0, 1024]"
    if "memory_mib" in lim and (not _is_int(lim["memory_mib"]) or not 256 <= lim["memory_mib"] <= 1 << 24):
        errors["limits.memory_mib"] = "must be an integer of at least 256"
    if any(k.startswith("limits.") for k in errors):
        return None
    return Limits(float(lim["cpu_cores"]), lim["memory_mib"])
