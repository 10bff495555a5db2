"""Builders for provisioner tests, written straight to the database: GPU models, nodes, physical and
MIG devices, environments, prices, and users and teams with funded accounts.

Transactional tests flush every table (the profiles the migration seeds too), so ``catalog_make``
puts the standard profiles back.
"""

from __future__ import annotations

import itertools

from django.contrib.auth import get_user_model

from billing.models import Account
from billing.services.pricing import price_set
from billing.services.topups import wallet_credit_promotion
from portal.models import Membership, Team
from provisioner.demo import multi_gpu_profiles_ensure
from provisioner.models import AllocationSlot, Device, Environment, GpuModel, Node, Profile, Session
from provisioner.sealing import new_token, seal, token_hash

A100 = "A100-SXM4-80GB"
T4 = "T4"
ENV = "python-3.11"
PLENTY_MICROS = 1_000_000_000  # 1,000 currency units: days of an A100
STANDARD_PROFILES = [
    ("whole", "whole", 8, 8),
    ("1/2", "slice", 4, 4),
    ("1/4", "slice", 2, 2),
    ("1/8", "slice", 1, 1),
    ("cpu", "cpu", 0, 0),
    ("1g.10gb", "mig", 8, 1),
    ("2g.20gb", "mig", 8, 2),
    ("3g.40gb", "mig", 8, 3),
    ("7g.80gb", "mig", 8, 8),
]
A100_PROFILES = ["whole", "2x", "4x", "8x", "1/2", "1/4", "1/8", "1g.10gb", "2g.20gb", "3g.40gb"]

_ids = itertools.count(1)


def profiles_ensure() -> dict[str, Profile]:
    for name, kind, eighths, quota_eighths in STANDARD_PROFILES:
        Profile.objects.get_or_create(
            name=name, defaults={"kind": kind, "eighths": eighths, "quota_eighths": quota_eighths}
        )
    multi_gpu_profiles_ensure()
    return {p.name: p for p in Profile.objects.all()}


def gpu_model_make(
    name: str = A100, *, profiles: list[str] | None = None, policy: str = "binpack", memory_mib: int = 81920
) -> GpuModel:
    model, _ = GpuModel.objects.update_or_create(
        name=name,
        defaults={
            "memory_mib": memory_mib,
            "profiles": profiles if profiles is not None else list(A100_PROFILES),
            "placement_policy": policy,
            "nvml_names": [f"NVIDIA {name}"],
        },
    )
    return model


def environment_make(name: str = ENV) -> Environment:
    env, _ = Environment.objects.get_or_create(name=name, defaults={"python": "/usr/bin/python3"})
    return env


def prices_make(model: str = A100, *, whole_micros_per_hour: int = 12_000_000) -> None:
    """Price the whole card (slices and MIG profiles cost their fraction of it) and the cpu profile."""
    price_set(gpu_model=model, profile="whole", price_micros_per_hour=whole_micros_per_hour)
    price_set(gpu_model="", profile="cpu", price_micros_per_hour=360_000)


def catalog_make(model: str = A100, *, policy: str = "binpack") -> GpuModel:
    """Profiles, one priced GPU model, and the environment: what a launch needs besides devices."""
    profiles_ensure()
    environment_make()
    gpu = gpu_model_make(model, policy=policy)
    prices_make(model)
    return gpu


def node_make(name: str | None = None, *, state: str = Node.State.ACTIVE) -> Node:
    token = new_token()
    return Node.objects.create(
        name=name or f"node-{next(_ids)}",
        address="http://127.0.0.1:1",
        token_hash=token_hash(token),
        token_sealed=seal(token),
        state=state,
    )


def gpu_make(
    node: Node,
    model: GpuModel,
    *,
    index: int | None = None,
    sharing: str = Device.Sharing.FIXED_SHARE,
    health: str = Device.Health.OK,
    mig_mode: bool = False,
) -> Device:
    n = next(_ids)
    return Device.objects.create(
        node=node,
        uuid=f"GPU-{n:08d}",
        index=n % 64 if index is None else index,
        kind=Device.Kind.PHYSICAL,
        gpu_model=model,
        nvml_name=f"NVIDIA {model.name}",
        memory_mib=model.memory_mib,
        mig_mode=mig_mode,
        health=health,
        sharing_policy=sharing,
    )


def mig_make(parent: Device, profile: str = "1g.10gb", *, health: str = Device.Health.OK) -> Device:
    n = next(_ids)
    return Device.objects.create(
        node=parent.node,
        uuid=f"MIG-{n:08d}",
        index=parent.index,
        kind=Device.Kind.MIG,
        parent=parent,
        gpu_model=parent.gpu_model,
        mig_profile=profile,
        memory_mib=10240,
        health=health,
        sharing_policy=Device.Sharing.EXCLUSIVE,
    )


def fleet_make(
    model: GpuModel, *, nodes: int = 1, gpus_per_node: int = 8, sharing: str = Device.Sharing.FIXED_SHARE
) -> list[Device]:
    devices = []
    for _ in range(nodes):
        node = node_make()
        devices += [gpu_make(node, model, index=i, sharing=sharing) for i in range(gpus_per_node)]
    return devices


def fund(account: Account, micros: int = PLENTY_MICROS) -> None:
    wallet_credit_promotion(account=account, amount_micros=micros, idempotency_key=f"prov-fund-{next(_ids)}")


def user_make(username: str | None = None, *, funded_micros: int = PLENTY_MICROS):
    """A user with their own account, funded; no password (tests never log in through this)."""
    username = username or f"user-{next(_ids)}"
    account = Account.objects.create(kind=Account.Kind.USER, name=username)
    user = get_user_model().objects.create(username=username, account=account)
    if funded_micros:
        fund(account, funded_micros)
    return user


def team_make(owner, *, members=(), funded_micros: int = PLENTY_MICROS) -> Team:
    name = f"team-{next(_ids)}"
    account = Account.objects.create(kind=Account.Kind.TEAM, name=name)
    team = Team.objects.create(name=name, slug=name, account=account, created_by=owner)
    Membership.objects.create(team=team, user=owner, role=Membership.Role.OWNER)
    for member in members:
        Membership.objects.create(team=team, user=member, role=Membership.Role.MEMBER)
    if funded_micros:
        fund(account, funded_micros)
    return team


def no_start_task(monkeypatch) -> None:
    """Launches queue ``session_start_task`` after commit; these tests drive no agents and no broker."""
    monkeypatch.setattr("provisioner.enqueue.session_start", lambda session_id: None)


def launch(
    user, *, account: Account | None = None, model: str = A100, profile: str = "1/8", **extra
) -> Session:
    from provisioner.services.sessions import session_launch

    fields = {"max_hours": 1, "idle_minutes": None, "idempotency_key": None, **extra}
    return session_launch(
        user=user,
        account=account or user.account,
        gpu_model=model,
        profile=profile,
        environment=ENV,
        **fields,
    ).session


def slot_pairs() -> list[tuple[int, int]]:
    """Every (device id, slot) held, as the database has it."""
    return list(AllocationSlot.objects.values_list("device_id", "slot"))


def used_masks() -> dict[int, int]:
    masks: dict[int, int] = {}
    for device_id, slot in slot_pairs():
        masks[device_id] = masks.get(device_id, 0) | (1 << slot)
    return masks


def session_row(user, *, profile: str = "1/8", model: GpuModel | None = None) -> Session:
    """A queued session written directly, for calling placement without admission."""
    return Session.objects.create(
        owner=user,
        account=user.account,
        gpu_model=model,
        profile=Profile.objects.get(name=profile),
        environment=environment_make(),
        jupyter_token_sealed=seal(new_token()),
        max_seconds=3600,
    )
