"""The audit trail of admin and money actions (one row each, never edited)."""

from __future__ import annotations

from typing import Any

from billing.models import AuditEntry


def audit_record(
    *,
    actor: Any | None,
    action: str,
    target: Any,
    before: dict | None = None,
    after: dict | None = None,
    reason: str = "",
) -> AuditEntry:
    """Append one audit row. Call it inside the transaction of the change it records."""
    return AuditEntry.objects.create(
        actor=actor if getattr(actor, "pk", None) else None,
        action=action,
        target_type=target._meta.label_lower,
        target_id=str(target.pk),
        before=before,
        after=after,
        reason=reason,
    )
