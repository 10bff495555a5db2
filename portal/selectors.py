"""Reads of the portal app."""

from __future__ import annotations

from dataclasses import dataclass

from django.conf import settings
from django.contrib.auth import BACKEND_SESSION_KEY, HASH_SESSION_KEY, SESSION_KEY
from django.contrib.sessions.backends.base import SessionBase
from django.db import DatabaseError, close_old_connections
from django.db.models import QuerySet
from django.utils.crypto import constant_time_compare
from django.utils.module_loading import import_string

from billing import selectors as billing_selectors
from billing.models import Account
from billing.rules import FolderGrant
from core.compiled import Lookup
from core.errors import NotFound
from portal.models import Membership, Team, TeamInvite, User
from portal.proxy import Refusal, Route
from provisioner import quotas
from provisioner.selectors import session_jupyter_target


def team_list_for_user(*, user: User) -> QuerySet[Team]:
    return Team.objects.filter(memberships__user=user).order_by("name")


# The team page's reads, at every look at it: compiled once per process.
_MEMBERSHIP_IN = Lookup(
    lambda user_id, slug: Membership.objects.select_related(
        "team", "team__account", "team__account__team_folder_usage"
    ).filter(user_id=user_id, team__slug=slug),
    key_types=(int, str),
)


def _members(team_id) -> QuerySet[Membership]:
    return (
        Membership.objects.filter(team_id=team_id).select_related("user").order_by("role", "user__username")
    )


_TEAM_MEMBERSHIPS = Lookup(_members, key_types=(int,), many=True)
_TEAM_MEMBERSHIP_OF = Lookup(
    lambda team_id, user_id: _members(team_id).filter(user_id=user_id), key_types=(int, int), many=True
)
_OPEN_INVITES = Lookup(
    lambda team_id: TeamInvite.objects.filter(team_id=team_id, revoked_at__isnull=True).order_by(
        "-created_at"
    )[:20],
    key_types=(int,),
    many=True,
)


def team_get_for_member(*, user: User, slug: str) -> tuple[Team, Membership] | None:
    """The team and the caller's membership, or None: a team one is not in does not exist for them."""
    membership = _MEMBERSHIP_IN.first(user.pk, slug)
    return (membership.team, membership) if membership else None


def team_member_get(*, team: Team, user_id: int) -> User | None:
    """A member of ``team`` by user id, or None for anyone not in it."""
    return User.objects.filter(pk=user_id, memberships__team=team).first()


def team_open_invites(*, team: Team) -> list[TeamInvite]:
    """The team's invites not revoked, newest first (the last 20)."""
    return _OPEN_INVITES.all(team.pk)


@dataclass(frozen=True)
class MemberSpend:
    """One member of a team, their use of the team's account this month, and their own cap inside the
    team's quota (a limit of None: no cap of their own)."""

    membership: Membership
    limits: quotas.Limits
    usage: quotas.Usage


def team_member_spend(
    *, team: Team, user_id: int | None = None, members: dict | None = None
) -> list[MemberSpend]:
    """Every member of ``team`` (or the one with ``user_id``) with their spend on its account this month
    and their cap, by role and name."""
    if user_id is None:
        memberships = _TEAM_MEMBERSHIPS.all(team.pk)
    else:
        memberships = _TEAM_MEMBERSHIP_OF.all(team.pk, user_id)
    if members is None:
        members = quotas.members_of_account(account=team.account)
    nothing = (quotas.Limits(None, None, None, None, None, None), quotas.Usage(0, 0, 0))
    return [MemberSpend(m, *members.get(m.user_id, nothing)) for m in memberships]


def team_overview(*, team: Team) -> dict:
    """A team's wallet and cards, its quota and what it uses of it, each member's spend this month
    with their cap (the caps a team admin sets inside the team's quota), and its team folder's use."""
    account = team.account
    use = quotas.account_use(account=account)
    funds = billing_selectors.account_funds(account=account)
    return {
        "team_funds": funds,
        "team_cards": funds.cards_count,
        "team_limits": use.limits,
        "team_usage": use.usage,
        "member_rows": team_member_spend(team=team, members=use.members),
        "team_folder": quotas.team_folder_of(
            account=account, max_bytes=use.limits.max_home_bytes, max_files=use.limits.max_home_files
        ),
    }


def account_chosen(*, user: User, wanted: str | None) -> Account | None:
    """The account a page is about: ``wanted`` (an id, as ``?account=`` carries it) among those the user
    may pay with, their own when nothing is asked, None for any other."""
    if not wanted:
        return user.account
    return next((a for a in accounts_payable_by(user=user) if str(a.pk) == wanted), None)


# A user's memberships, read at every launch and every look at the dashboard: compiled once.
_MEMBERSHIPS = Lookup(
    lambda user_id: Membership.objects.select_related("team__account").filter(user_id=user_id),
    key_types=(int,),
    many=True,
)
_MEMBERSHIPS_WITH_FOLDERS = Lookup(
    lambda user_id: (
        Membership.objects.select_related("team__account__team_folder_usage")
        .annotate(
            folder_max_bytes=quotas.team_folder_limit("max_home_bytes", "team__account_id"),
            folder_max_files=quotas.team_folder_limit("max_home_files", "team__account_id"),
        )
        .filter(user_id=user_id)
    ),
    key_types=(int,),
    many=True,
)
_GRANTING_MEMBERSHIPS = Lookup(
    lambda user_id: (
        Membership.objects.filter(user_id=user_id, user__is_active=True)
        .select_related("team")
        .order_by("team__slug")
    ),
    key_types=(int,),
    many=True,
)


def accounts_payable_by(*, user: User, with_team_folders: bool = False) -> list[Account]:
    """The accounts a user may launch on: their own and those of teams they belong to, in one query;
    ``with_team_folders``: each team's account carries its ``team_folder`` (``quotas.team_folder_of``),
    read in the same query."""
    accounts = [user.account] if user.account_id else []
    if user.pk is None:
        return accounts
    if not with_team_folders:
        return accounts + [m.team.account for m in _MEMBERSHIPS.all(user.pk)]
    for m in _MEMBERSHIPS_WITH_FOLDERS.all(user.pk):
        account = m.team.account
        account.team_folder = quotas.team_folder_of(
            account=account, max_bytes=m.folder_max_bytes, max_files=m.folder_max_files
        )
        accounts.append(account)
    return accounts


def team_folder_grants(*, user: User) -> list[FolderGrant]:
    """The team folders ``user`` may see, one per team they belong to, with their access (registered as
    billing's rule; docs/STORAGE.md, "Team folders"): an owner or admin always writes. One query."""
    if user.pk is None:
        return []
    return [
        FolderGrant(
            account_id=m.team.account_id,
            name=m.team.slug,
            read_only=m.folder_read_only and not m.manages_team,
            manages=m.manages_team,
        )
        for m in _GRANTING_MEMBERSHIPS.all(user.pk)
    ]


def account_managed_by(*, user: User, account: Account) -> bool:
    """Whether ``user`` may move ``account``'s money and cards (split, gift, revoke, top up): their own
    account, or a team's where they are an owner or admin (registered as billing's rule)."""
    if account.kind == Account.Kind.USER:
        return account.pk == user.account_id
    return Membership.objects.filter(
        user=user, team__account=account, role__in=[Membership.Role.OWNER, Membership.Role.ADMIN]
    ).exists()


def account_managers(*, account: Account) -> list[User]:
    """The active users who manage ``account`` (as ``account_managed_by``): its owner for a personal
    account, a team's owners and admins (registered as billing's rule)."""
    if account.kind == Account.Kind.USER:
        return list(User.objects.filter(account=account, is_active=True))
    return list(
        User.objects.filter(
            is_active=True,
            memberships__team__account=account,
            memberships__role__in=[Membership.Role.OWNER, Membership.Role.ADMIN],
        )
    )


def user_for_django_session(*, django_session_key: str) -> User | None:
    """The logged-in, active user of a Django session key (as the cookie carries it), or None."""
    if not django_session_key:
        return None
    store: SessionBase = import_string(f"{settings.SESSION_ENGINE}.SessionStore")(django_session_key)
    try:
        user_id = store.get(SESSION_KEY)
        backend = store.get(BACKEND_SESSION_KEY)
    except DatabaseError:
        raise  # the database cannot be asked: not "no session" (the proxy answers 503)
    except Exception:  # a corrupt or foreign session is simply no session
        return None
    if user_id is None or backend not in settings.AUTHENTICATION_BACKENDS:
        return None
    user = User.objects.filter(pk=user_id, is_active=True).first()
    if user is None:
        return None
    # A password change ends the sessions made before it, as Django's own middleware does.
    if not constant_time_compare(store.get(HASH_SESSION_KEY, ""), user.get_session_auth_hash()):
        return None
    return user


def jupyter_route(*, django_session_key: str, session_id: str):
    """For the Jupyter proxy: a Route to the running session of the cookie's user, a Refusal (the
    session is theirs but not running: show its page), or None (no such session, or not theirs: the
    same 404 either way)."""
    user = user_for_django_session(django_session_key=django_session_key)
    if user is None:
        return None
    try:
        target = session_jupyter_target(user=user, session_id=session_id)
    except NotFound:
        return None
    if isinstance(target, tuple):
        upstream, token = target
        return Route(upstream=upstream, token=token)
    return Refusal(status=409, state=target.state, session_url=f"/sessions/{target.id}/")


def jupyter_route_resolve(django_session_key: str, session_id: str) -> Route | Refusal | None:
    """The Jupyter proxy's resolver: ``jupyter_route`` on a connection given back after each call."""
    try:
        return jupyter_route(django_session_key=django_session_key, session_id=session_id)
    finally:
        close_old_connections()  # as the end of a request does: a pooled connection goes back to the pool
