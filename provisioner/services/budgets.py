"""Monthly budgets (``provisioner.budgets``), watched while sessions run, after every metering tick
(billing's ``metered`` signal):

- at each of BUDGET_ALERT_PERCENTS (50, 80, 100 by default) the budget's people are told once a month
  (a user: themselves; a team: its managers; a member: the member and the team's managers); a jump
  past several thresholds at once tells only the highest;
- at 100 % the sessions the budget covers are warned (``stop_warnings``) and stopped when the warning
  is due; a member over their share stops only their own sessions in that team;
- a budget raised again clears those warnings.
"""

from __future__ import annotations

from datetime import datetime

from django.conf import settings
from django.utils import timezone

from billing.models import Account
from billing.rules import account_managers
from core.units import micros_to_hours, money_text
from notices.services import notify
from provisioner.budgets import Budget, budgets_of
from provisioner.messages import message
from provisioner.models import Session, StopWarning
from provisioner.services.sessions import session_stop
from provisioner.services.stop_warnings import (
    stop_warn,
    stop_warn_ahead,
    stop_warnings_clear,
    stop_warnings_due,
)

S = Session.State
W = StopWarning.Kind


def _people(budget: Budget) -> list[int]:
    """Whom a budget's alerts go to: its user (a user's or a member's), and a team's managers."""
    users = [budget.user_id] if budget.user_id is not None else []
    if budget.account_id is not None:
        team = Account(id=budget.account_id, kind=Account.Kind.TEAM)
        users += [u.id for u in account_managers(account=team) if u.id != budget.user_id]
    return users


def _alert(budget: Budget, now: datetime) -> int:
    """Tell the budget's people of the highest threshold it has crossed, once a month. Returns notices
    made."""
    crossed = [p for p in settings.BUDGET_ALERT_PERCENTS if budget.percent >= p]
    if not crossed:
        return 0
    return notify(
        users=_people(budget),
        kind="budget_threshold",
        key=f"budget_threshold_{budget.scope}",
        params={
            "percent": crossed[-1],
            "spent": money_text(budget.spent_micros, currency=settings.SITE_CURRENCY),
            "card_hours": f"{micros_to_hours(budget.card_micros):.2f}",
        },
        dedupe_key=f"budget:{budget.key}:{now:%Y-%m}:{crossed[-1]}",
    )


def budgets_enforce(*, now: datetime | None = None) -> dict[str, int]:
    """Alert, warn and stop for the budgets of running sessions (see the module). Returns counts."""
    now = now or timezone.now()
    counts = {"alerted": 0, "warned": 0, "stopped": 0, "cleared": 0}
    running = list(Session.objects.filter(state=S.RUNNING).values_list("id", "owner_id", "account_id"))
    budgets = budgets_of({(o, a) for _s, o, a in running}) if running else []
    spent = [b for b in budgets if b.percent >= 100]
    counts["alerted"] = sum(_alert(budget, now) for budget in budgets)
    over = {}
    for session_id, owner_id, account_id in running:
        budget = next((b for b in spent if b.covers(owner_id, account_id)), None)
        if budget is not None:
            over[session_id] = (owner_id, budget)
    due = stop_warnings_due(kind=W.BUDGET, now=now)
    for session_id, (owner_id, budget) in over.items():
        if session_id in due:
            session_stop(session=Session(id=session_id), actor=None, reason=message("budget_reached"))
            counts["stopped"] += 1
            continue
        counts["warned"] += stop_warn(
            session_id=session_id,
            owner_id=owner_id,
            kind=W.BUDGET,
            due_at=now + stop_warn_ahead(),
            key=f"stop_warning_budget_{budget.scope}",
            now=now,
        ).created
    under = [s for s, _o, _a in running if s not in over]
    counts["cleared"] = stop_warnings_clear(session_ids=under, kind=W.BUDGET, now=now) if under else 0
    return counts
