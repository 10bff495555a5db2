"""Monthly budgets: what each budget over some sessions has used this month.

A budget is a monthly cap of a quota (``provisioner.quotas``): money (``monthly_spend_cap_micros``) or
card-hours (``monthly_card_cap_micros``), for a user (all their sessions), a team's account, or one
member's share of a team. Admission refuses a launch once a budget is spent (``quotas.quota_admit``);
``provisioner.services.budgets`` alerts, warns and stops while sessions run; the launch page shows
them beside the runway.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime

from django.db.models import CharField, Q
from django.db.models.functions import Cast

from billing.models import Account, AccruedNow, Meter
from core.compiled import Lookup
from provisioner.models import Quota, Session
from provisioner.quotas import Limits, limits_of_quota, month_start


@dataclass(frozen=True)
class Budget:
    """One budget's month so far. ``scope``: "you" (a user's), "team" (a team account's) or "member"
    (a member's share of a team)."""

    scope: str
    user_id: int | None
    account_id: int | None
    spend_cap_micros: int | None
    card_cap_micros: int | None
    spent_micros: int
    card_micros: int

    @property
    def percent(self) -> int:
        """How much of the budget is used, in whole percent: the larger of money and card-hours."""
        pairs = ((self.spent_micros, self.spend_cap_micros), (self.card_micros, self.card_cap_micros))
        return max((100 * spent // cap if cap else 100 for spent, cap in pairs if cap is not None), default=0)

    def covers(self, owner_id: int, account_id: int) -> bool:
        if self.scope == "you":
            return owner_id == self.user_id
        if self.scope == "team":
            return account_id == self.account_id
        return owner_id == self.user_id and account_id == self.account_id

    @property
    def key(self) -> str:
        return f"{self.scope}:{self.user_id or ''}:{self.account_id or ''}"


def _capped(limits: Limits) -> bool:
    return limits.monthly_spend_cap_micros is not None or limits.monthly_card_cap_micros is not None


# Read by the launch page, every session's page and the sessions API: compiled once per process.
_TEAM_ACCOUNTS = Lookup(
    lambda ids: Account.objects.filter(id__any=ids, kind=Account.Kind.TEAM).values_list("id", flat=True),
    key_types=(list,),
    many=True,
)
_QUOTAS = Lookup(
    lambda owners, teams: Quota.objects.filter(
        Q(user_id__any=owners, account__isnull=True) | Q(account_id__any=teams)
    ),
    key_types=(list, list),
    many=True,
)
_SESSIONS_SINCE = Lookup(
    lambda owners, teams, since: (
        Session.objects.filter(Q(owner_id__any=owners) | Q(account_id__any=teams), created_at__gte=since)
        .annotate(ref=Cast("id", CharField()))
        .values_list("ref", "owner_id", "account_id")
    ),
    key_types=(list, list, datetime),
    many=True,
)
_METERS = Lookup(
    lambda refs: (
        Meter.objects.filter(session_ref__any=refs)
        .annotate(accrued=AccruedNow())
        .values_list("session_ref", "charged_micros", "accrued", "card_charged_micros")
    ),
    key_types=(list,),
    many=True,
)


def _limits_of(owners: set[int], teams: set[int]) -> dict[tuple[str, int | None, int | None], Limits]:
    """The capped budgets over these users and team accounts, in one query: (scope, user, account) →
    limits."""
    found = {(q.user_id, q.account_id): q for q in _QUOTAS.all(sorted(owners), sorted(teams))}
    budgets = {}
    for user_id in owners:
        budgets[("you", user_id, None)] = limits_of_quota(found.get((user_id, None)), user_default=True)
    for (user_id, account_id), quota in found.items():
        if account_id is not None:
            scope = "member" if user_id is not None else "team"
            budgets[(scope, user_id, account_id)] = limits_of_quota(quota, user_default=False)
    return {k: v for k, v in budgets.items() if _capped(v)}


def budgets_of(pairs: set[tuple[int, int]]) -> list[Budget]:
    """The capped budgets that cover sessions of these (owner, account) pairs, with this month's money
    and card-hours spent. Four queries, however many sessions."""
    owners = {owner for owner, _a in pairs}
    teams = set(_TEAM_ACCOUNTS.all(sorted({a for _o, a in pairs})))
    limits = _limits_of(owners, teams)
    if not limits:
        return []
    month = _SESSIONS_SINCE.all(sorted(owners), sorted(teams), month_start())
    whose = {ref: (owner, account) for ref, owner, account in month}
    spent: dict[tuple, list[int]] = defaultdict(lambda: [0, 0])
    for ref, charged, accrued, card in _METERS.all(sorted(whose)):
        owner, account = whose[ref]
        for key in (("you", owner, None), ("team", None, account), ("member", owner, account)):
            spent[key][0] += charged + accrued
            spent[key][1] += card
    return [
        Budget(
            scope, user_id, account_id, lim.monthly_spend_cap_micros, lim.monthly_card_cap_micros, *spent[key]
        )
        for key, lim in limits.items()
        for scope, user_id, account_id in [key]
    ]
