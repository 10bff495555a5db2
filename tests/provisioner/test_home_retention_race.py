"""A launch and the removal of the same user's shared home, racing on one real PostgreSQL: each ends
one way or the other, whole (the launch cancels the removal and the home stays, or the home is moved away
first and the launch goes on), never a deadlock between the launch's locks and the removal's."""

from __future__ import annotations

import pytest
from django.utils import timezone

from provisioner.models import HomeRemoval, Session
from provisioner.selectors import workload_user
from provisioner.services.home_retention import home_remove_shared
from tests.provisioner.factories import A100, catalog_make, fleet_make, launch, no_start_task, user_make
from tests.provisioner.test_concurrency import _race

pytestmark = pytest.mark.django_db(transaction=True)
USERS = 8


def test_a_launch_racing_the_removal_of_its_users_home_wins_or_loses_whole(monkeypatch, settings, tmp_path):
    no_start_task(monkeypatch)
    settings.HOMES_BACKEND, settings.HOMES_SHARED_ROOT = "shared", str(tmp_path)
    fleet_make(catalog_make(A100), nodes=1, gpus_per_node=8)
    now = timezone.now()
    users, removals = [], []
    for index in range(USERS):
        user = user_make(f"racer-{index}")
        (tmp_path / workload_user(user)).mkdir()
        (tmp_path / workload_user(user) / "notes.txt").write_text("mine")
        users.append(user)
        removals.append(
            HomeRemoval.objects.create(
                user=user,
                name=workload_user(user),
                reason="idle",
                planned_at=now,
                due_at=now,
                warned_at=now,
                warned_final_at=now,
            )  # fmt: skip
        )

    def step(i: int):
        if i % 2:
            return launch(users[i // 2], model=A100, profile="1/8").state
        return home_remove_shared(removal_id=removals[i // 2].id, now=timezone.now())

    outcomes = _race(2 * USERS, step)

    assert all(isinstance(outcome, str) for outcome in outcomes), outcomes
    for user, removal in zip(users, removals, strict=True):
        removal.refresh_from_db()
        home = tmp_path / workload_user(user)
        assert Session.objects.filter(owner=user).count() == 1  # every launch went through
        if removal.cancelled_at is not None:
            assert removal.removed_at is None and (home / "notes.txt").read_text() == "mine"
        else:
            assert removal.removed_at is not None and not home.exists()
    kept = sorted(workload_user(u) for u, r in zip(users, removals, strict=True) if r.cancelled_at)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != ".suanli") == kept
