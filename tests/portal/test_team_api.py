"""The teams API: the caller's teams, one team with each member's role, spend and cap (invites for its
owners and admins only), caps set by the team's owners and admins inside the team's quota, roles changed
by owners, members removed. The authorisation matrix (tests/security) covers strangers and staff."""

from __future__ import annotations

import pytest
from rest_framework.test import APIClient

from billing.models import AuditEntry
from billing.services.topups import wallet_credit_promotion
from portal.models import Membership
from portal.services import access_token_create, team_create, team_invite_create, user_create
from provisioner.models import Quota
from provisioner.quotas import quota_set

pytestmark = pytest.mark.django_db


def _client(user) -> APIClient:
    client = APIClient()
    client.force_login(user)
    return client


@pytest.fixture
def course(settings):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    lead = user_create(username="lead", email="lead@example.com", password="pw-123456789")
    student = user_create(username="stu", email="stu@example.com", password="pw-123456789")
    team = team_create(creator=lead, name="Course 101")
    Membership.objects.create(team=team, user=student, role=Membership.Role.MEMBER)
    wallet_credit_promotion(account=team.account, amount_micros=50_000_000, idempotency_key="course-fund")
    quota_set(account=team.account, limits={"max_eighths": 8, "monthly_spend_cap_micros": 100_000_000})
    team_invite_create(team=team, actor=lead)
    return team, lead, student


def test_the_team_list_is_the_callers_teams_with_their_role(course):
    team, lead, student = course
    outsider = user_create(username="out", email="out@example.com", password="pw-123456789")
    assert _client(student).get("/api/v1/teams").json() == [
        {"slug": team.slug, "name": "Course 101", "role": "member", "account_id": team.account_id}
    ]
    assert _client(lead).get("/api/v1/teams").json()[0]["role"] == "owner"
    assert _client(outsider).get("/api/v1/teams").json() == []
    assert _client(student).get("/api/v1/me").json()["teams"] == _client(student).get("/api/v1/teams").json()


def test_members_see_roles_spend_and_caps_and_only_managers_see_invites(course):
    team, lead, student = course
    as_member = _client(student).get(f"/api/v1/teams/{team.slug}")
    assert as_member.status_code == 200, as_member.content
    body = as_member.json()
    assert body["role"] == "member" and body["account_id"] == team.account_id
    assert body["limits"]["max_eighths"] == 8 and body["limits"]["monthly_spend_cap_micros"] == 100_000_000
    assert body["usage"] == {"sessions": 0, "eighths": 0, "spend_micros": 0, "card_micros": 0}
    assert {(m["username"], m["role"]) for m in body["members"]} == {("lead", "owner"), ("stu", "member")}
    assert all(
        m["cap"] == {"max_eighths": None, "monthly_spend_cap_micros": None, "monthly_card_cap_micros": None}
        for m in body["members"]
    )
    assert body["invites"] is None
    invite = team.invites.get()
    as_owner = _client(lead).get(f"/api/v1/teams/{team.slug}").json()
    assert [i["code"] for i in as_owner["invites"]] == [invite.code]
    assert invite.code not in as_member.content.decode()


def test_an_owner_caps_a_member_inside_the_team_quota_audited(course):
    team, lead, student = course
    client = _client(lead)
    url = f"/api/v1/teams/{team.slug}/members/{student.pk}/cap"
    caps = {"max_eighths": 2, "monthly_spend_cap_micros": 10_000_000, "monthly_card_cap_micros": 3_000_000}
    response = client.put(url, caps, format="json")
    assert response.status_code == 200, response.content
    assert response.json()["cap"] == caps
    assert response.json()["username"] == "stu"
    quota = Quota.objects.get(user=student, account=team.account)
    assert (quota.max_eighths, quota.monthly_spend_cap_micros, quota.monthly_card_cap_micros) == (
        2,
        10_000_000,
        3_000_000,
    )
    audit = AuditEntry.objects.filter(action="quota.set", actor=lead).latest("id")
    assert audit.after["max_eighths"] == 2
    shown = client.get(f"/api/v1/teams/{team.slug}").json()["members"]
    assert {m["username"]: m["cap"]["max_eighths"] for m in shown} == {"lead": None, "stu": 2}

    cleared = client.put(url, {"max_eighths": None, "monthly_spend_cap_micros": None}, format="json")
    assert cleared.json()["cap"] == dict.fromkeys(caps)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"max_eighths": 16, "monthly_spend_cap_micros": None}, "max_eighths"),  # above the team's 8
        ({"max_eighths": 1, "monthly_spend_cap_micros": 200_000_000}, "monthly_spend_cap_micros"),
        ({"max_eighths": -1, "monthly_spend_cap_micros": None}, "max_eighths"),
        ({"max_eighths": "two", "monthly_spend_cap_micros": None}, "max_eighths"),
        ({"max_eighths": 2**40, "monthly_spend_cap_micros": None}, "max_eighths"),
        ({"max_eighths": 1}, "monthly_spend_cap_micros"),
        ({"max_eighths": 1, "monthly_spend_cap_micros": "x" * 20_000}, "monthly_spend_cap_micros"),
    ],
)
def test_a_bad_cap_is_a_400_with_the_error_body_and_writes_nothing(course, body, field):
    team, lead, student = course
    before = (Quota.objects.count(), AuditEntry.objects.count())
    response = _client(lead).put(f"/api/v1/teams/{team.slug}/members/{student.pk}/cap", body, format="json")
    assert response.status_code == 400, response.content
    error = response.json()["error"]
    assert set(error) == {"code", "message", "fields"} and field in error["fields"]
    assert (Quota.objects.count(), AuditEntry.objects.count()) == before


def test_a_team_admin_caps_but_a_member_cannot(course):
    team, lead, student = course
    helper = user_create(username="ta", email="ta@example.com", password="pw-123456789")
    Membership.objects.create(team=team, user=helper, role=Membership.Role.ADMIN)
    cap = {"max_eighths": 1, "monthly_spend_cap_micros": None}
    url = f"/api/v1/teams/{team.slug}/members/{student.pk}/cap"
    assert _client(helper).put(url, cap, format="json").status_code == 200
    refused = _client(student).put(f"/api/v1/teams/{team.slug}/members/{lead.pk}/cap", cap, format="json")
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "team_role_required"
    assert not Quota.objects.filter(user=lead, account=team.account).exists()


def test_an_owner_changes_roles_and_removes_members(course):
    team, lead, student = course
    client = _client(lead)
    promoted = client.put(f"/api/v1/teams/{team.slug}/members/{student.pk}", {"role": "admin"}, format="json")
    assert promoted.status_code == 200 and promoted.json()["role"] == "admin"
    assert _client(student).get(f"/api/v1/teams/{team.slug}").json()["invites"] is not None
    unknown = client.put(f"/api/v1/teams/{team.slug}/members/{student.pk}", {"role": "king"}, format="json")
    assert unknown.status_code == 400 and "role" in unknown.json()["error"]["fields"]
    last_owner = client.put(f"/api/v1/teams/{team.slug}/members/{lead.pk}", {"role": "member"}, format="json")
    assert last_owner.status_code == 409
    assert Membership.objects.get(team=team, user=lead).role == "owner"

    assert client.delete(f"/api/v1/teams/{team.slug}/members/{student.pk}").status_code == 204
    assert _client(student).get(f"/api/v1/teams/{team.slug}").status_code == 404
    assert client.delete(f"/api/v1/teams/{team.slug}/members/{student.pk}").status_code == 404
    assert AuditEntry.objects.filter(action="team.member_remove", actor=lead).exists()


def test_team_reads_take_a_read_token_and_team_changes_take_none(course):
    team, lead, student = course
    _token, raw = access_token_create(user=lead, name="ci", scopes=["read", "sessions", "cards", "billing"])
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
    assert client.get(f"/api/v1/teams/{team.slug}").status_code == 200
    cap = {"max_eighths": 1, "monthly_spend_cap_micros": None}
    refused = client.put(f"/api/v1/teams/{team.slug}/members/{student.pk}/cap", cap, format="json")
    assert refused.status_code == 403
    assert client.delete(f"/api/v1/teams/{team.slug}/members/{student.pk}").status_code == 403
    assert Membership.objects.filter(team=team).count() == 2
    assert not Quota.objects.filter(user=student, account=team.account).exists()


def test_create_invite_join_revoke_and_leave_through_the_api(course):
    team, lead, student = course
    newcomer = user_create(username="new", email="new@example.com", password="pw-123456789")
    created = _client(newcomer).post("/api/v1/teams", {"name": "Side project"}, format="json")
    assert created.status_code == 201 and created.json()["role"] == "owner"
    invite = _client(lead).post(f"/api/v1/teams/{team.slug}/invites", {"max_uses": 2}, format="json")
    assert invite.status_code == 201, invite.content
    code = invite.json()["code"]
    assert _client(student).post(f"/api/v1/teams/{team.slug}/invites", {}, format="json").status_code == 403
    owner_invite = _client(lead).post(f"/api/v1/teams/{team.slug}/invites", {"role": "owner"}, format="json")
    assert owner_invite.status_code == 400
    joined = _client(newcomer).post("/api/v1/teams/join", {"code": code}, format="json")
    assert joined.status_code == 201 and joined.json()["slug"] == team.slug
    assert _client(newcomer).post("/api/v1/teams/join", {"code": code}, format="json").status_code == 409
    assert _client(newcomer).post("/api/v1/teams/join", {"code": "NOPE"}, format="json").status_code == 404
    revoked = _client(lead).delete(f"/api/v1/teams/{team.slug}/invites/{invite.json()['id']}")
    assert revoked.status_code == 204
    assert _client(lead).delete(f"/api/v1/teams/{team.slug}/invites/999999").status_code == 404
    assert _client(newcomer).post(f"/api/v1/teams/{team.slug}/leave").status_code == 204
    assert not Membership.objects.filter(team=team, user=newcomer).exists()
    assert _client(lead).post(f"/api/v1/teams/{team.slug}/leave").status_code == 409  # the last owner
    assert _client(newcomer).post(f"/api/v1/teams/{team.slug}/leave").status_code == 404  # no longer in it


def test_a_token_reads_teams_but_changes_none(course):
    team, lead, _student = course
    _token, raw = access_token_create(user=lead, name="ci", scopes=["read", "sessions", "cards", "billing"])
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
    assert client.get("/api/v1/teams").status_code == 200
    assert client.post("/api/v1/teams", {"name": "By script"}, format="json").status_code == 403
    assert client.post(f"/api/v1/teams/{team.slug}/invites", {}, format="json").status_code == 403
    assert client.post(f"/api/v1/teams/{team.slug}/leave").status_code == 403
