"""Reconciliation: re-check, from the entries alone, what the ledger promises.

The services keep these true by construction and the database refuses edits to posted money (the
append-only triggers). This catches what gets around both: a hand-edited cached balance, a restored
backup, a bug. Checks:

- every ledger account's cached ``balance_micros`` equals the sum of its entries;
- wallets and cards are not below zero, overdrafts not above it;
- entries sum to zero in every unit;
- every transfer has exactly two entries that sum to zero.

A mismatch opens a ``LedgerHold`` (one per problem while open), tells staff (a notice to each staff
member, emailed in their language) and, while open, refuses launches on the account it names
(``account_hold_check``). Staff resolve it in the admin with a note, audited.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from django.contrib.auth import get_user_model
from django.db import IntegrityError, connection, transaction
from django.db.models import Sum
from django.db.models.functions import Now
from django.urls import reverse
from django.utils.translation import gettext as _

from billing.audit import audit_record
from billing.models import Account, Entry, LedgerHold
from billing.services.ledger import lock_accounts
from core.compiled import Lookup
from core.errors import Conflict, ValidationFailed
from notices.services import notify

log = logging.getLogger(__name__)

_BALANCES = """
    SELECT la.id, la.owner_id, la.kind, la.unit, la.balance_micros, COALESCE(e.total, 0)::bigint
    FROM billing_ledgeraccount la
    LEFT JOIN (SELECT account_id, sum(amount_micros) AS total FROM billing_entry GROUP BY account_id) e
        ON e.account_id = la.id
    WHERE la.balance_micros <> COALESCE(e.total, 0)
       OR (la.kind IN ('wallet', 'card') AND la.balance_micros < 0)
       OR (la.kind = 'overdraft' AND la.balance_micros > 0)
"""
_UNITS = """
    SELECT la.unit, sum(e.amount_micros)::bigint FROM billing_entry e
    JOIN billing_ledgeraccount la ON la.id = e.account_id
    GROUP BY la.unit HAVING sum(e.amount_micros) <> 0
"""
_TRANSFERS = """
    SELECT t.id, count(e.id), COALESCE(sum(e.amount_micros), 0)::bigint FROM billing_transfer t
    LEFT JOIN billing_entry e ON e.transfer_id = t.id
    GROUP BY t.id HAVING count(e.id) <> 2 OR COALESCE(sum(e.amount_micros), 0) <> 0
"""
# Card ledger accounts are owned through their card; find the paying account to hold.
_CARD_OWNER = "SELECT owner_id FROM billing_card WHERE ledger_account_id = %s"


@dataclass(frozen=True)
class Finding:
    kind: str
    subject: str
    detail: dict
    account_id: int | None = None
    ledger_account_id: int | None = None


def ledger_findings() -> list[Finding]:
    """Everything the entries disagree with, right now. Reads only (one snapshot: REPEATABLE READ)."""
    findings: list[Finding] = []
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
        cursor.execute(_BALANCES)
        for la_id, owner_id, kind, unit, cached, entries in cursor.fetchall():
            if owner_id is None and kind == "card":
                cursor.execute(_CARD_OWNER, [la_id])
                row = cursor.fetchone()
                owner_id = row[0] if row else None
            detail = {"ledger_account": la_id, "kind": kind, "unit": unit, "cached_micros": cached}
            detail["entries_micros"] = entries
            problem = LedgerHold.Kind.BALANCE if cached != entries else LedgerHold.Kind.FLOOR
            findings.append(Finding(problem, f"la:{la_id}", detail, owner_id, la_id))
        cursor.execute(_UNITS)
        for unit, total in cursor.fetchall():
            findings.append(
                Finding(LedgerHold.Kind.UNIT, f"unit:{unit}", {"unit": unit, "sum_micros": total})
            )
        cursor.execute(_TRANSFERS)
        for transfer_id, count, total in cursor.fetchall():
            detail = {"transfer": transfer_id, "entries": count, "sum_micros": total}
            findings.append(Finding(LedgerHold.Kind.TRANSFER, f"transfer:{transfer_id}", detail))
    return findings


def ledger_reconcile() -> list[LedgerHold]:
    """Run the checks; open a hold for each new problem and alert staff about it. Idempotent: a
    problem already on an open hold is not raised again. Returns the holds opened by this run."""
    opened: list[LedgerHold] = []
    for finding in ledger_findings():
        try:
            with transaction.atomic():
                hold = LedgerHold.objects.create(
                    kind=finding.kind,
                    subject=finding.subject,
                    detail=finding.detail,
                    account_id=finding.account_id,
                    ledger_account_id=finding.ledger_account_id,
                )
        except IntegrityError:
            continue  # already open
        log.error("ledger reconciliation: %s on %s: %s", finding.kind, finding.subject, finding.detail)
        opened.append(hold)
    if opened:
        _alert_staff(opened)
    return opened


def _alert_staff(holds: list[LedgerHold]) -> None:
    """Each active staff member gets a ``ledger_hold`` notice per hold (emailed in their language)."""
    staff = list(get_user_model().objects.filter(is_staff=True, is_active=True).values_list("id", flat=True))
    for hold in holds:
        notify(
            users=staff,
            kind="ledger_hold",
            key="ledger_hold",
            params={
                "problem": hold.kind,
                "subject": hold.subject,
                "account": hold.account.name if hold.account_id else "-",
                "hold": hold.id,
            },
            dedupe_key=f"ledger-hold:{hold.id}",
            url=reverse("admin:billing_ledgerhold_change", args=[hold.id]),
        )


# Every launch asks: compiled once per process.
_OPEN_HOLD = Lookup(
    lambda account_id: LedgerHold.objects.filter(account_id=account_id, resolved_at__isnull=True).values_list(
        "id", flat=True
    ),
    key_types=(int,),
)


def account_hold_check(*, account: Account) -> None:
    """Raise Conflict while a reconciliation hold is open on ``account`` (launches wait for staff)."""
    if _OPEN_HOLD.first(account.pk) is not None:
        raise Conflict(
            _(
                "Launches on this account are paused while staff check its balance. Your running sessions "
                "and your money are not affected; please contact support."
            ),
            code="account_on_hold",
        )


def ledger_hold_resolve(*, hold: LedgerHold, actor, resolution: str, rebuild: bool = False) -> LedgerHold:
    """Close an open hold with a note (what was found, which reversing transfer corrected it). Audited.

    With ``rebuild`` (balance holds only) the cached balance is first set back to the sum of its
    entries, the ledger's truth; money itself is corrected only by reversing transfers. Raises
    ValidationFailed without a note or for a rebuild of another kind of hold, Conflict when it is
    already resolved."""
    if not (resolution or "").strip():
        raise ValidationFailed(
            _("Say what was found and how it was corrected."), fields={"resolution": "required"}
        )
    with transaction.atomic():
        hold = LedgerHold.objects.select_for_update().get(pk=hold.pk)
        if hold.resolved_at is not None:
            raise Conflict(_("This hold is already resolved."))
        if rebuild:
            if hold.kind != LedgerHold.Kind.BALANCE or hold.ledger_account_id is None:
                raise ValidationFailed(_("Only a cached balance can be rebuilt from its entries."))
            _balance_rebuild(ledger_account_id=hold.ledger_account_id, actor=actor, reason=resolution)
        hold.resolved_at = Now()
        hold.resolved_by = actor if getattr(actor, "pk", None) else None
        hold.resolution = resolution.strip()
        hold.save(update_fields=["resolved_at", "resolved_by", "resolution"])
        audit_record(
            actor=actor,
            action="ledger_hold.resolve",
            target=hold,
            before={"open": True},
            after={"open": False, "rebuilt": rebuild},
            reason=hold.resolution,
        )
    return hold


def _balance_rebuild(*, ledger_account_id: int, actor, reason: str) -> None:
    (la,) = lock_accounts([ledger_account_id]).values()
    total = Entry.objects.filter(account_id=la.id).aggregate(total=Sum("amount_micros"))["total"] or 0
    before = la.balance_micros
    la.balance_micros, la.version = total, la.version + 1
    la.save(update_fields=["balance_micros", "version"])
    audit_record(
        actor=actor,
        action="ledger_account.rebuild",
        target=la,
        before={"balance_micros": before},
        after={"balance_micros": total},
        reason=reason,
    )


def ledger_holds_open() -> int:
    return LedgerHold.objects.filter(resolved_at__isnull=True).count()
