"""A team's page shows its wallet, cards, quota and each member's spend; owners and admins cap members
inside the team's quota, members cannot."""

from __future__ import annotations

import pytest
from django.test import Client

from billing.services.topups import wallet_credit_promotion
from portal.models import Membership
from portal.services import team_create, user_create
from provisioner.models import Quota
from provisioner.quotas import quota_set

pytestmark = pytest.mark.django_db


def _login(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture
def team():
    lead = user_create(username="lead", email="lead@example.com", password="pw-123456789")
    student = user_create(username="stu", email="stu@example.com", password="pw-123456789")
    team = team_create(creator=lead, name="Course 101")
    Membership.objects.create(team=team, user=student, role=Membership.Role.MEMBER)
    wallet_credit_promotion(account=team.account, amount_micros=50_000_000, idempotency_key="team-fund")
    quota_set(account=team.account, limits={"max_eighths": 8, "monthly_spend_cap_micros": 100_000_000})
    return team, lead, student


def test_the_team_page_shows_wallet_quota_and_members(team):
    team, lead, _student = team
    page = _login(lead).get(f"/teams/{team.slug}/").content.decode()
    assert "¥50.00" in page and 'data-testid="member-spend"' in page
    assert "of 8/8 allowed" in page and "stu" in page


def test_an_admin_caps_a_member_inside_the_team_quota(team):
    team, lead, student = team
    client = _login(lead)
    client.post(
        f"/teams/{team.slug}/", {"action": "cap", "member": student.pk, "max_eighths": "2", "spend_cap": "10"}
    )
    quota = Quota.objects.get(user=student, account=team.account)
    assert quota.max_eighths == 2 and quota.monthly_spend_cap_micros == 10_000_000

    response = client.post(
        f"/teams/{team.slug}/", {"action": "cap", "member": student.pk, "max_eighths": "16", "spend_cap": ""},
        follow=True,
    )  # fmt: skip
    assert "cannot exceed the team" in response.content.decode()
    quota.refresh_from_db()
    assert quota.max_eighths == 2


def test_a_member_cannot_set_caps(team):
    team, lead, student = team
    response = _login(student).post(
        f"/teams/{team.slug}/", {"action": "cap", "member": lead.pk, "max_eighths": "1"}, follow=True
    )
    assert "Only the team" in response.content.decode()
    assert not Quota.objects.filter(user=lead, account=team.account).exists()


def test_the_dashboard_shows_unread_notices_with_the_bell_count(team):
    from notices.services import notice_read, notify

    _team, lead, _student = team
    for card in (7, 8):
        notify(users=[lead], kind="card_expiring", key="card_expiring",
               params={"card": card, "hours": "2.00", "expires": "2027-01-01 00:00"},
               dedupe_key=f"card:{card}:expiry:1d")  # fmt: skip
    page = _login(lead).get("/dashboard/").content.decode()
    assert 'data-testid="notifications"' in page and "Your compute card #8 with 2.00 h left" in page
    assert 'data-testid="bell-count">2<' in page
    notice_read(user=lead, notice_id=lead.notices.get(dedupe_key="card:8:expiry:1d").id)
    page = _login(lead).get("/dashboard/").content.decode()
    assert (
        'data-testid="bell-count">1<' in page
        and "#8 with" not in page.split('data-testid="notifications"')[1]
    )


def test_a_member_sees_the_team_cards_and_wallet_without_split_gift_or_top_up(team):
    from billing.services.cards import card_batch_issue, card_redeem

    team, lead, student = team
    _batch, (code,) = card_batch_issue(hours_micros=4_000_000, count=1, valid_days=30, max_parts=3)
    card = card_redeem(user=lead, account=team.account, code=code)
    member_cards = _login(student).get(f"/cards/?account={team.account_id}").content.decode()
    assert 'data-testid="team-role-note"' in member_cards and 'value="split"' not in member_cards
    member_wallet = _login(student).get(f"/wallet/?account={team.account_id}").content.decode()
    assert 'data-testid="team-role-note"' in member_wallet and 'name="amount"' not in member_wallet

    lead_cards = _login(lead).get(f"/cards/?account={team.account_id}").content.decode()
    assert 'value="split"' in lead_cards and 'data-testid="team-role-note"' not in lead_cards

    refused = _login(student).post(
        f"/cards/?account={team.account_id}", {"action": "gift", "card": card.pk}, follow=True
    )
    assert "Only the team&#x27;s owners and admins" in refused.content.decode()
    card.refresh_from_db()
    assert card.state == "active" and not card.parts.exists()
