"""Reads of the portal app."""

from __future__ import annotations

from django.db.models import QuerySet

from billing.models import Account
from portal.models import Membership, Team, User


def team_list_for_user(*, user: User) -> QuerySet[Team]:
    return Team.objects.filter(memberships__user=user).order_by("name")


def team_get_for_member(*, user: User, slug: str) -> tuple[Team, Membership] | None:
    """The team and the caller's membership, or None: a team one is not in does not exist for them."""
    membership = (
        Membership.objects.select_related("team", "team__account").filter(user=user, team__slug=slug).first()
    )
    return (membership.team, membership) if membership else None


def accounts_payable_by(*, user: User) -> list[Account]:
    """The accounts a user may launch on: their own and those of teams they belong to."""
    accounts = [user.account] if user.account_id else []
    accounts += [m.team.account for m in Membership.objects.select_related("team__account").filter(user=user)]
    return accounts
