"""Helpers for provisioner tests: the catalog, nodes that report an inventory through the real heartbeat
service, users with money, API clients, and a record of the Celery tasks a test would have sent."""

from __future__ import annotations

import itertools
import sys

import pytest
from django.core.cache import cache
from rest_framework.test import APIClient

from billing.models import Meter
from portal.services import user_create
from provisioner.models import (
    Allocation,
    AllocationSlot,
    Device,
    DeviceSample,
    Environment,
    GpuModel,
    Node,
    Profile,
    Quota,
    Session,
    SessionEvent,
)
from provisioner.serializers import HeartbeatOut
from provisioner.services.heartbeats import heartbeat_record
from provisioner.services.nodes import node_enroll
from tests.billing.conftest import fund, seed_prices

A100 = "A100-SXM4-80GB"
ENV = "python-3.11 (JupyterLab)"
_counter = itertools.count()


def make_catalog() -> None:
    """GPU models named as the fake fleets name their cards, one environment, prices and burn rates.
    Puts back the profiles the migration seeds (a transactional test flushes them)."""
    from provisioner.demo import PROFILES, multi_gpu_profiles_ensure

    for name, kind, eighths, quota in PROFILES:
        Profile.objects.get_or_create(
            name=name, defaults={"kind": kind, "eighths": eighths, "quota_eighths": quota}
        )
    multi_gpu_profiles_ensure()
    GpuModel.objects.create(
        name=A100,
        memory_mib=81920,
        peak_tflops=312,
        profiles=["whole", "2x", "4x", "1/2", "1/4", "1/8"],
        nvml_names=["NVIDIA A100-SXM4-80GB"],
    )
    GpuModel.objects.create(
        name="T4", memory_mib=15360, peak_tflops=65, profiles=["whole", "1/2"], nvml_names=["NVIDIA Tesla T4"]
    )
    GpuModel.objects.create(
        name="H200",
        memory_mib=143771,
        peak_tflops=989,
        profiles=["whole", "1g.18gb"],
        nvml_names=["NVIDIA H200"],
    )
    Environment.objects.create(name=ENV, python=sys.executable, cpu_cores=1.0, memory_mib=4096)
    seed_prices()


def gpu(index: int, uuid: str, name: str = "NVIDIA A100-SXM4-80GB", memory_mib: int = 81920, **extra) -> dict:
    return {
        "index": index,
        "uuid": uuid,
        "name": name,
        "pci_bus_id": f"00000000:{index + 7:02x}:00.0",
        "memory_total_mib": memory_mib,
        "mig_mode": bool(extra.get("mig_devices")),
        "health": "ok",
        "mig_devices": [],
        **extra,
    }


def heartbeat_body(
    gpus: list[dict], workloads: list[dict] | None = None, metrics: list[dict] | None = None
) -> dict:
    return {
        "agent_version": "0.1.0",
        "listen_url": "http://127.0.0.1:1",
        "runtime": "process",
        "inventory": {"driver_version": "550.54.15", "cuda_version": "12.4", "gpus": gpus},
        "metrics": {"collected_at": None, "gpus": metrics or []},
        "workloads": workloads or [],
    }


def make_node(name: str | None = None, gpus: list[dict] | None = None, *, sharing_policy: str | None = None):
    """An enrolled node whose inventory came in through ``heartbeat_record``. Returns (node, token).
    Default: one A100 in the given (default fixed-share) sharing policy. The address answers nothing."""
    name = name or f"node-{next(_counter)}"
    labels = {"sharing_policy": sharing_policy} if sharing_policy else {}
    enrolment = node_enroll(name=name, address="http://127.0.0.1:9", labels=labels)
    node = enrolment.node
    if gpus is None:
        gpus = [gpu(0, f"GPU-{name}-0")]
    heartbeat_record(node=node, body=heartbeat_body(gpus))
    node.refresh_from_db()
    return node, enrolment.token


def beat(
    node: Node, workloads: list[dict] | None = None, gpus: list[dict] | None = None, metrics=None
) -> dict:
    """Send the node's current inventory again, with these workload states."""
    if gpus is None:
        gpus = [
            gpu(d.index, d.uuid, d.nvml_name, d.memory_mib)
            for d in Device.objects.filter(node=node, kind=Device.Kind.PHYSICAL).order_by("index")
        ]
        for entry in gpus:
            migs = Device.objects.filter(parent__uuid=entry["uuid"]).order_by("id")
            if migs:
                entry["mig_mode"] = True
                entry["mig_devices"] = [
                    {"uuid": m.uuid, "profile": m.mig_profile, "memory_total_mib": m.memory_mib} for m in migs
                ]
    return HeartbeatOut(heartbeat_record(node=node, body=heartbeat_body(gpus, workloads, metrics))).data


def workload_status(session: Session, state: str = "running", **extra) -> dict:
    return {
        "session_id": str(session.id),
        "state": state,
        "upstream": "http://127.0.0.1:45678",
        "exit_reason": None,
        "started_at": None,
        "last_alive_at": None,
        "gpu_plan": {},
        "gpu_util_percent": None,
        "gpu_memory_used_mib": None,
        **extra,
    }


def make_user(username: str | None = None, *, funds: int = 100_000_000, staff: bool = False):
    username = username or f"user{next(_counter)}"
    user = user_create(
        username=username, email=f"{username}@example.com", password="a-long-pass-phrase-9", is_staff=staff
    )
    if funds:
        fund(user.account, funds)
    return user


def client_for(user) -> APIClient:
    client = APIClient()
    client.force_authenticate(user)
    return client


def counts() -> dict[str, int]:
    """Rows a refused request must not have written."""
    return {
        model.__name__: model.objects.count()
        for model in (Session, Allocation, AllocationSlot, SessionEvent, Meter, Device, DeviceSample, Quota)
    }


@pytest.fixture(autouse=True)
def _clear_rate_limits():
    cache.clear()


@pytest.fixture(autouse=True)
def _fast_passwords(settings):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture
def catalog(db):
    make_catalog()


@pytest.fixture
def sent_tasks(monkeypatch):
    """Celery tasks the code under test sends (name, args), recorded instead of reaching the broker."""
    from celery import Celery
    from celery.app.task import Task

    sent: list[tuple[str, tuple]] = []

    def record(self, args=None, kwargs=None, **options):
        sent.append((self.name.rsplit(".", 1)[-1], tuple(args or ())))

    def record_by_name(app, name, args=None, kwargs=None, **options):
        sent.append((name.rsplit(".", 1)[-1], tuple(args or ())))

    monkeypatch.setattr(Task, "apply_async", record)
    monkeypatch.setattr(Celery, "send_task", record_by_name)
    return sent
