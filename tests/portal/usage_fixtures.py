"""Sessions metered for a known number of seconds, for the usage report tests (pages, properties,
browser): a provisioner session row (whose owner the "by user" grouping reads) and its closed meter."""

from __future__ import annotations

from datetime import timedelta

from billing.models import Meter
from billing.services.metering import meter_alive, meter_close, meter_open
from billing.services.pricing import price_quote
from core.clock import db_now
from provisioner.models import Environment, GpuModel, Profile, Session

SLICES = {"whole": 8, "1/2": 4, "1/4": 2, "1/8": 1}


def catalog_ensure() -> None:
    for model in ("A100-SXM4-80GB", "T4"):
        GpuModel.objects.get_or_create(name=model, defaults={"memory_mib": 15360, "profiles": list(SLICES)})
    for name, eighths in SLICES.items():
        Profile.objects.get_or_create(
            name=name,
            defaults={
                "kind": "whole" if eighths == 8 else "slice",
                "eighths": eighths,
                "quota_eighths": eighths,
            },
        )
    Environment.objects.get_or_create(name="python-3.11", defaults={"python": "/usr/bin/python3"})


def metered_session(*, owner, account, gpu_model: str, profile: str, seconds: int) -> Meter:
    """A stopped session of ``owner`` on ``account``, billed for exactly ``seconds`` and closed."""
    session = Session.objects.create(
        owner=owner,
        account=account,
        gpu_model=GpuModel.objects.get(name=gpu_model),
        profile=Profile.objects.get(name=profile),
        environment=Environment.objects.get(name="python-3.11"),
        state=Session.State.STOPPED,
        jupyter_token_sealed="-",
        max_seconds=86400,
    )
    quote = price_quote(gpu_model=gpu_model, profile=profile)
    started = db_now() - timedelta(seconds=seconds + 5)
    meter_open(
        account=account,
        session_ref=session.ref,
        gpu_model=gpu_model,
        profile=profile,
        quote=quote,
        started_at=started,
    )
    end = started + timedelta(seconds=seconds)
    meter_alive(session_refs=[session.ref], alive_at=end)
    return meter_close(session_ref=session.ref, ended_at=end)
