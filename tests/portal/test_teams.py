import threading

import pytest
from django.db import connection

from core.errors import Conflict, Forbidden, NotFound
from portal.models import Membership, TeamInvite
from portal.services import (
    team_create,
    team_invite_create,
    team_join,
    team_leave,
    team_member_remove,
    team_member_set_role,
    user_create,
)


def _user(name):
    return user_create(username=name, email="", password="a-long-pass-phrase")


@pytest.fixture
def owner(db):
    return _user("owner")


@pytest.fixture
def team(owner):
    return team_create(creator=owner, name="Deep Learning 101")


def test_creating_a_team_makes_the_creator_its_owner(team, owner):
    assert team.slug == "deep-learning-101"
    assert team.account.kind == "team"
    assert Membership.objects.get(team=team, user=owner).role == "owner"


def test_invite_and_join_with_a_code(team, owner):
    invite = team_invite_create(team=team, actor=owner, role="member")
    student = _user("student")
    membership = team_join(user=student, code=invite.code.lower())
    assert membership.role == "member"
    with pytest.raises(Conflict):
        team_join(user=student, code=invite.code)


def test_a_member_cannot_invite_or_remove(team, owner):
    invite = team_invite_create(team=team, actor=owner)
    student, other = _user("student"), _user("other")
    team_join(user=student, code=invite.code)
    team_join(user=other, code=invite.code)
    with pytest.raises(Forbidden):
        team_invite_create(team=team, actor=student)
    with pytest.raises(Forbidden):
        team_member_remove(team=team, actor=student, member=other)


def test_an_outsider_sees_no_team(team):
    with pytest.raises(NotFound):
        team_invite_create(team=team, actor=_user("outsider"))


def test_the_last_owner_cannot_leave_or_step_down(team, owner):
    with pytest.raises(Conflict):
        team_leave(team=team, user=owner)
    with pytest.raises(Conflict):
        team_member_set_role(team=team, actor=owner, member=owner, role="member")


def test_owner_promotes_removes_and_members_leave(team, owner):
    invite = team_invite_create(team=team, actor=owner)
    student = _user("student")
    team_join(user=student, code=invite.code)
    team_member_set_role(team=team, actor=owner, member=student, role="admin")
    assert Membership.objects.get(team=team, user=student).role == "admin"
    team_member_remove(team=team, actor=owner, member=student)
    assert not Membership.objects.filter(team=team, user=student).exists()
    helper = _user("helper")
    team_join(user=helper, code=invite.code)
    team_leave(team=team, user=helper)
    assert not Membership.objects.filter(team=team, user=helper).exists()


def test_unknown_revoked_and_used_up_invites_read_the_same(team, owner):
    invite = team_invite_create(team=team, actor=owner, max_uses=1)
    team_join(user=_user("first"), code=invite.code)
    for code in (invite.code, "NOPE-NOPE-NOPE"):
        with pytest.raises(NotFound, match="not valid"):
            team_join(user=_user(f"late{len(code)}"), code=code)


@pytest.mark.django_db(transaction=True)
def test_an_invite_is_never_used_more_than_it_allows_under_concurrency():
    owner = _user("owner")
    team = team_create(creator=owner, name="Race")
    invite = team_invite_create(team=team, actor=owner, max_uses=3)
    users = [_user(f"u{i}") for i in range(12)]
    barrier = threading.Barrier(len(users))
    outcomes = []

    def join(user):
        barrier.wait()
        try:
            team_join(user=user, code=invite.code)
            outcomes.append("joined")
        except NotFound:
            outcomes.append("refused")
        finally:
            connection.close()

    threads = [threading.Thread(target=join, args=(u,)) for u in users]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert outcomes.count("joined") == 3
    assert TeamInvite.objects.get(pk=invite.pk).uses == 3
    assert Membership.objects.filter(team=team).count() == 4


def test_team_pages_hide_other_teams(client, team):
    outsider = _user("outsider")
    client.force_login(outsider)
    assert client.get(f"/teams/{team.slug}/").status_code == 404
