"""The account rules billing asks of the layer above, registered at startup.

Billing knows accounts, not teams: who may pay with an account, and who may move what it holds, are the
portal's rules (docs/TEAMS.md). The portal registers them in its ``AppConfig.ready`` (the way billing
reaches the provisioner by a signal), so billing never imports the portal.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django.core.exceptions import ImproperlyConfigured


@dataclass(frozen=True)
class FolderGrant:
    """A team account's shared folder a user may see (docs/STORAGE.md, "Team folders")."""

    account_id: int
    name: str  # the team's slug: where sessions show the folder
    read_only: bool  # the member's own access, before any quota
    manages: bool  # an owner or admin of the team


@dataclass(frozen=True)
class AccountRules:
    paying_accounts: Callable[..., list]  # (user=) -> the accounts the user may see and pay with
    manages: Callable[..., bool]  # (user=, account=) -> whether the user may move its money and cards
    managers: Callable[..., list]  # (account=) -> the users who may (whom its money matters are told)
    folders: Callable[..., list] = lambda *, user: []  # (user=) -> the FolderGrants of the user's teams


_registered: list[AccountRules] = []


def account_rules_register(rules: AccountRules) -> None:
    """Install the rules; a second registration replaces the first (a test may swap them)."""
    _registered[:] = [rules]


def account_rules() -> AccountRules:
    if not _registered:
        raise ImproperlyConfigured("No account rules registered: the portal registers them in its ready().")
    return _registered[0]


def accounts_payable_by(*, user: Any) -> list:
    """The accounts ``user`` may see and pay with."""
    return list(account_rules().paying_accounts(user=user))


def account_managed_by(*, user: Any, account: Any) -> bool:
    """Whether ``user`` may move ``account``'s money and cards, beyond paying with it."""
    return bool(account_rules().manages(user=user, account=account))


def account_managers(*, account: Any) -> list:
    """The active users who may move ``account``'s money and cards: whom billing tells about it."""
    return list(account_rules().managers(account=account))


def folder_grants_of(*, user: Any) -> list[FolderGrant]:
    """The team folders ``user`` may see: one per team they belong to."""
    return list(account_rules().folders(user=user))
