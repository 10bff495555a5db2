"""A user's session is read in one query, with everything its answers show, and nobody else's is."""

from __future__ import annotations

import uuid

import pytest

from core.errors import NotFound
from provisioner.models import Session
from provisioner.selectors import session_get_for_user
from provisioner.services.sessions import session_launch
from tests.provisioner.conftest import A100, ENV, gpu, make_node, make_user

pytestmark = pytest.mark.django_db


def _field_values(obj) -> dict:
    return {f.attname: getattr(obj, f.attname) for f in obj._meta.concrete_fields}


def test_a_session_is_read_with_its_rows_and_never_anyone_elses(
    catalog, sent_tasks, django_assert_num_queries
):
    make_node("node-c", [gpu(0, "GPU-c-0")])
    owner, other = make_user("owner"), make_user("other")
    launched = session_launch(
        user=owner, account=owner.account, gpu_model=A100, profile="1/2", environment=ENV,
        max_hours=None, idle_minutes=None, idempotency_key=None,
    ).session  # fmt: skip
    with django_assert_num_queries(1):
        session = session_get_for_user(user=owner, session_id=str(launched.id))
        assert (session.gpu_model.name, session.profile.name, session.environment.name) == (A100, "1/2", ENV)
        assert session.node.name == "node-c" and session.device.uuid == "GPU-c-0"
        assert session.account.pk == owner.account_id
    assert _field_values(session) == _field_values(Session.objects.get(id=launched.id))
    for who, sid in ((other, launched.id), (owner, uuid.uuid4()), (owner, "not-a-uuid")):
        with pytest.raises(NotFound):
            session_get_for_user(user=who, session_id=sid)


def test_a_users_live_sessions_are_read_newest_first_in_one_query(
    catalog, sent_tasks, django_assert_num_queries
):
    from provisioner.selectors import live_sessions_of
    from provisioner.services.sessions import session_stop

    make_node("node-l", [gpu(0, "GPU-l-0")])
    owner, other = make_user("liver"), make_user("bystander")

    def launch(user):
        return session_launch(
            user=user, account=user.account, gpu_model=A100, profile="1/8", environment=ENV,
            max_hours=None, idle_minutes=None, idempotency_key=None,
        ).session  # fmt: skip

    first, second, third = launch(owner), launch(owner), launch(owner)
    launch(other)
    Session.objects.filter(id=second.id).update(state=Session.State.STOPPED)  # ended: not live
    session_stop(session=third, actor=owner, reason="done")  # stopping: still live
    with django_assert_num_queries(1):
        live = live_sessions_of(user=owner)
        assert [s.node.name for s in live] == ["node-l", "node-l"]
    assert [s.id for s in live] == [third.id, first.id]
    assert [s.state for s in live] == ["stopping", "placing"]
