"""What the provisioner tells people (``notices.notify``): a session's owner about its lifecycle, and the
payers and session owners of an account whose funds run low (billing's ``runway_low``)."""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Callable

from django.db import transaction
from django.urls import reverse

from billing.models import Account
from billing.rules import account_managers
from core.messages import Message, message_load
from notices.services import notify
from provisioner.models import Session, SessionEvent


def session_owner_notify(session_id, *, kind: str, key: str, **params: str | int | Message) -> None:
    """After commit, tell the session's owner ``key`` (its ``session`` parameter is filled in here),
    once per session and kind, linking to the session's page."""
    transaction.on_commit(lambda: _owner_notify(session_id, kind=kind, key=key, params=params))


# A stop or cancel asked for by someone (the ``actor`` of these lines, provisioner/services/sessions.py).
_ASKED_BY = ("stop_by", "cancelled_by")


def session_ended_notify(session_id, *, reason: Message | str) -> None:
    """After commit, tell the session's owner it ended (``session_stopped``) and why: the reason it was
    asked to stop for when it was stopping (its end is then only "Stopped"), else ``reason``. Not when
    the owner asked for the stop themselves: their page shows it, and a notice (and an email) about
    their own click is noise. Every other end is told: stopped by someone else (a team's admin, an
    operator), and every stop the portal makes (funds, idle, longest time, a lost node, preemption)."""

    def send() -> None:
        asked = (
            SessionEvent.objects.filter(session_id=session_id, to_state=Session.State.STOPPING)
            .order_by("-id")
            .values_list("message_key", "message_params", "message")
            .first()
        )
        why = message_load(*asked) if asked else reason
        _owner_notify(
            session_id,
            kind="session_stopped",
            key="session_stopped",
            params={"why": why},
            unless=lambda session: _asked_by_owner(why, session),
        )

    transaction.on_commit(send)


def _asked_by_owner(why: Message | str, session: Session) -> bool:
    return (
        isinstance(why, Message)
        and why.key in _ASKED_BY
        and why.params.get("actor") == session.owner.get_username()
    )


def _owner_notify(
    session_id, *, kind: str, key: str, params: dict, unless: Callable[[Session], bool] | None = None
) -> None:
    session = Session.objects.select_related("gpu_model", "profile", "owner").filter(id=session_id).first()
    if session is None or (unless is not None and unless(session)):
        return
    notify(
        users=[session.owner_id],
        kind=kind,
        key=key,
        params={"session": _label(session), **params},
        dedupe_key=f"session:{session.id}:{kind}",
        url=reverse("session_detail", args=[session.id]),
    )


def _label(session: Session) -> str:
    return f"{session.gpu_model.name} {session.profile.name}" if session.gpu_model else session.profile.name


def session_ids(refs: list[str]) -> list[uuid.UUID]:
    """The session ids among billing's meter references (it meters other references too)."""
    ids = []
    for ref in refs:
        try:
            ids.append(uuid.UUID(str(ref)))
        except ValueError:
            continue
    return ids


def runway_low_notify(*, account_id: int, runway_seconds: int, session_refs: list[str]) -> int:
    """Billing's ``runway_low``: the account's managers (who can top it up) are told, once per account
    and set of sessions; those who own one of the sessions are not, their stop warning says it
    (``limits.sessions_warn_for_funds``). Returns notices made."""
    account = Account.objects.filter(id=account_id).first()
    if account is None:
        return 0
    owners = set(Session.objects.filter(id__in=session_ids(session_refs)).values_list("owner_id", flat=True))
    warned = hashlib.sha256(",".join(sorted(session_refs)).encode()).hexdigest()[:32]
    return notify(
        users=[u for u in account_managers(account=account) if u.id not in owners],
        kind="runway_low",
        key="runway_low",
        params={"account": account.name, "minutes": max(1, runway_seconds // 60)},
        dedupe_key=f"runway-low:{account_id}:{warned}",
        url=reverse("wallet"),
    )
