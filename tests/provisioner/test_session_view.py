"""The one view of a session: its list form agrees with the single form, and each session's GPU figures
are those of its own life on its card."""

from __future__ import annotations

import pytest

from provisioner.models import Session
from provisioner.services.sessions import session_launch, session_stop
from provisioner.session_view import session_view, session_views
from tests.provisioner.conftest import A100, ENV, beat, gpu, make_node, make_user, workload_status

pytestmark = pytest.mark.django_db


def _launch(user) -> Session:
    return session_launch(
        user=user, account=user.account, gpu_model=A100, profile="1/2", environment=ENV,
        max_hours=None, idle_minutes=None, idempotency_key=None,
    ).session  # fmt: skip


def _util(samples) -> list[int | None]:
    return [s.gpu_util_percent for s in samples]


def test_two_sessions_on_one_card_each_get_the_samples_of_their_own_life(catalog, sent_tasks):
    node, _token = make_node("node-v", [gpu(0, "GPU-v-0")], sharing_policy="best-effort")
    first, second = _launch(make_user()), _launch(make_user())

    def figures(util: int) -> list[dict]:
        return [{"uuid": "GPU-v-0", "gpu_util_percent": util, "memory_used_mib": 1024}]

    beat(node, [workload_status(first)], metrics=figures(10))
    beat(node, [workload_status(first), workload_status(second)], metrics=figures(20))
    session_stop(session=Session.objects.get(id=first.id), actor=first.owner, reason="done")
    beat(node, [workload_status(second)], metrics=figures(30))  # the first is gone: stopped now
    beat(node, [workload_status(second)], metrics=figures(40))

    rows = Session.objects.select_related(
        "gpu_model", "profile", "environment", "node", "device", "account"
    ).order_by("created_at")
    listed = session_views(rows, samples=True)
    assert [v.state for v in listed] == ["stopped", "running"]
    assert _util(listed[0].metrics.samples) == [10, 20, 30]
    assert _util(listed[1].metrics.samples) == [20, 30, 40]
    for row, view in zip(rows, listed, strict=True):
        assert session_view(row, now=None).metrics == view.metrics
        assert (session_view(row).cost, session_view(row).limits) == (view.cost, view.limits)
    assert session_views(rows)[1].metrics.samples is None  # lists leave samples out
