"""Placement goes where the user's files are (issue #18): the node that holds a local home, or the nodes
that mount the pool's shared homes root, when one of them has room; elsewhere only when none has, and
then the session says so."""

from __future__ import annotations

import pytest
from django.utils import timezone

from provisioner.models import HomeUsage, Session
from provisioner.placement import cpu_node_pick
from provisioner.selectors import home_nodes
from tests.provisioner.factories import catalog_make, gpu_make, launch, no_start_task, node_make, user_make

pytestmark = pytest.mark.django_db


@pytest.fixture
def two_nodes(monkeypatch):
    no_start_task(monkeypatch)
    model = catalog_make()
    a, b = node_make("node-a"), node_make("node-b")
    gpu_make(a, model, index=0)
    gpu_make(b, model, index=0)
    return a, b


def _home_on(user, node) -> None:
    HomeUsage.objects.create(user=user, bytes=4096, files=3, measured_at=timezone.now(), node=node)


def test_a_session_goes_to_the_node_that_holds_the_users_home_over_the_policys_choice(two_nodes):
    first = launch(user_make())  # no home anywhere yet: wherever the policy says
    used = first.node
    other = next(n for n in two_nodes if n != used)
    # Binpack would put the next slice beside the first; this user's files are on the other node.
    alice = user_make()
    _home_on(alice, other)
    session = launch(alice)
    assert session.state == Session.State.PLACING and session.node == other
    assert session.reason_key == "placed_on"
    # Someone without a home goes where binpack says: beside the first slice.
    assert launch(user_make()).node == used


def test_with_no_room_where_the_home_is_it_runs_elsewhere_and_says_so(two_nodes):
    a, b = two_nodes
    launch(user_make(), profile="whole")  # one node's only GPU, whole
    full = Session.objects.get().node
    free = b if full == a else a
    alice = user_make()
    _home_on(alice, full)
    session = launch(alice)
    assert session.state == Session.State.PLACING and session.node == free
    assert (session.reason_key, session.reason_params) == ("placed_away_from_home", {"node": free.name})
    assert "not your latest files" in session.reason


def test_a_home_on_a_node_that_is_down_is_no_preference(two_nodes):
    a, _b = two_nodes
    alice = user_make()
    _home_on(alice, a)
    assert home_nodes(user_id=alice.pk) == {a.id}
    a.state = a.State.DOWN
    a.save(update_fields=["state"])
    assert home_nodes(user_id=alice.pk) == frozenset()


def test_shared_homes_prefer_the_nodes_labelled_as_mounting_them(two_nodes, settings):
    a, b = two_nodes
    settings.HOMES_BACKEND, settings.HOMES_SHARED_ROOT = "shared", "/mnt/suanli-homes"
    b.labels = {"homes": "shared"}
    b.save(update_fields=["labels"])
    alice = user_make()
    _home_on(alice, a)  # measured on a before: a shared root makes every labelled node hold it
    assert home_nodes(user_id=alice.pk) == {b.id}
    assert launch(alice).node == b
    assert launch(user_make()).node == b  # every user's home is on the shared root
    settings.HOMES_BACKEND = "local"
    assert home_nodes(user_id=alice.pk) == {a.id}  # a local home measured on a stays on a


def test_a_local_home_measured_on_a_shared_node_prefers_every_shared_node(two_nodes):
    a, b = two_nodes
    for node in (a, b):
        node.labels = {"homes": "shared", "zone": "x"}
        node.save(update_fields=["labels"])
    third = node_make("node-c")
    alice = user_make()
    _home_on(alice, a)
    assert home_nodes(user_id=alice.pk) == {a.id, b.id}
    assert third.id not in home_nodes(user_id=alice.pk)


def test_a_cpu_session_prefers_the_home_node_over_the_least_busy(two_nodes):
    a, b = two_nodes
    launch(user_make())
    busy = Session.objects.get().node
    idle = b if busy == a else a
    assert cpu_node_pick() == idle
    assert cpu_node_pick(preferred_nodes={busy.id}) == busy
    assert cpu_node_pick(preferred_nodes=frozenset()) == idle
