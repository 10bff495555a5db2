"""Who may move an account's money and cards, beyond paying with it.

Anyone who may pay with an account (``account_for_user``) sees it, spends from it within their caps and
redeems codes onto it. Moving what it holds elsewhere (splitting, gifting or revoking its cards) and
topping it up take more: the account's own user, or an owner or admin of the team whose account it is.
Billing does not know teams; the portal answers through the rules it registers (``billing.rules``).
The rules are in docs/TEAMS.md.
"""

from __future__ import annotations

from typing import Any

from django.utils.translation import gettext as _

from billing.models import Account
from billing.rules import account_managed_by
from core.errors import Forbidden

TEAM_ROLE_REQUIRED = "team_role_required"


def account_manager_require(*, actor: Any, account: Account, message: str) -> None:
    """Raise Forbidden ``team_role_required`` with ``message`` (the rule, in words) unless ``actor``
    manages ``account``. A call without an actor is the system's own (a beat task, a migration) and
    passes: every view passes the requesting user."""
    if actor is None or not getattr(actor, "pk", None):
        return
    if not account_managed_by(user=actor, account=account):
        raise Forbidden(message, code=TEAM_ROLE_REQUIRED)


def cards_manager_require(*, actor: Any, account: Account) -> None:
    account_manager_require(
        actor=actor,
        account=account,
        message=_("Only the team's owners and admins can split, gift or revoke its compute cards."),
    )


def topup_manager_require(*, actor: Any, account: Account) -> None:
    account_manager_require(
        actor=actor, account=account, message=_("Only the team's owners and admins can top up its wallet.")
    )
