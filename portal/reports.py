"""Reads for the usage reports and the audit log: what was used, by whom, and who changed what.

Usage figures come from the ledger itself: money is the metering's ``usage`` transfers (wallet and
overdraft to revenue), card-hours its ``card_burn`` transfers, so a report's total equals the ledger to
the micro-unit. Seconds come from the same postings: every metering posting's idempotency key names the
span of seconds it paid for (``meter:<id>:<from>-<to>:<source>``, see billing/services/metering.py), and
a posting's legs share one span, so each span is counted once. GPU-hours are those seconds times the
share of a whole card the profile rents (a ``1/4`` slice, a MIG ``3g.40gb`` as 3/7, nothing for ``cpu``).

The reports live in the portal, not in billing: grouping by user needs the session's owner, which only
the provisioner knows. Each report is one SQL aggregation.
"""

from __future__ import annotations

import zoneinfo
from dataclasses import dataclass
from datetime import date, datetime, time, timedelta
from decimal import Decimal

from django.conf import settings
from django.db import connection
from django.db.models import Q, QuerySet
from django.utils import timezone
from django.utils.translation import gettext as _

from billing.models import CARD_UNIT, Account, AuditEntry
from core.errors import ValidationFailed

GROUPINGS = ("user", "team", "gpu_model", "profile")
BUCKETS = ("day", "week", "month")
DEFAULT_DAYS = 30
MAX_DAYS = 3 * 366
MICRO_SECOND = Decimal("0.000001")  # GPU-seconds of a MIG slice are sevenths: kept to this precision

# One row per (bucket, group): the metering postings in range, each span of seconds counted on one leg.
_USAGE_SQL = """
WITH legs AS (
    SELECT t.id, t.kind, t.unit, t.amount_micros, t.meter_id,
           date_trunc(%(bucket)s, t.created_at AT TIME ZONE %(tz)s)::date AS bucket,
           split_part(t.idempotency_key, ':', 3) AS span
    FROM billing_transfer t
    JOIN billing_meter m ON m.id = t.meter_id
    WHERE t.kind IN ('usage', 'card_burn') AND t.created_at >= %(since)s AND t.created_at < %(until)s
      AND (%(account)s::bigint IS NULL OR m.account_id = %(account)s::bigint)
), spans AS (
    SELECT legs.*, row_number() OVER (PARTITION BY meter_id, span ORDER BY id) = 1 AS first_leg,
           COALESCE(split_part(span, '-', 2)::bigint - split_part(span, '-', 1)::bigint, 0) AS seconds
    FROM legs
), keyed AS (
    SELECT spans.*, m.profile,
           CASE
               WHEN %(group)s = 'user' THEN COALESCE(s.owner_id, u.id)::text
               WHEN %(group)s = 'team' THEN team.id::text
               WHEN %(group)s = 'gpu_model' THEN m.gpu_model
               ELSE m.profile
           END AS group_key,
           CASE
               WHEN %(group)s = 'user' THEN COALESCE(owner.username, u.username)
               WHEN %(group)s = 'team' THEN team.name
               WHEN %(group)s = 'gpu_model' THEN NULLIF(m.gpu_model, '')
               ELSE m.profile
           END AS group_label,
           CASE
               WHEN m.profile = 'whole' THEN 1::numeric
               WHEN m.profile ~ '^1/[248]$' THEN 1::numeric / split_part(m.profile, '/', 2)::numeric
               WHEN m.profile ~ '^[1-7]g\\.' THEN split_part(m.profile, 'g', 1)::numeric / 7
               ELSE 0::numeric
           END AS share
    FROM spans
    JOIN billing_meter m ON m.id = spans.meter_id
    LEFT JOIN provisioner_session s ON s.id::text = m.session_ref
    LEFT JOIN portal_user owner ON owner.id = s.owner_id
    LEFT JOIN portal_user u ON u.account_id = m.account_id
    LEFT JOIN portal_team team ON team.account_id = m.account_id
)
SELECT bucket, group_key, max(group_label),
       COALESCE(sum(seconds) FILTER (WHERE first_leg), 0)::bigint,
       COALESCE(sum(seconds * share) FILTER (WHERE first_leg), 0),
       COALESCE(sum(amount_micros) FILTER (WHERE kind = 'usage' AND unit = %(money)s), 0)::bigint,
       COALESCE(sum(amount_micros) FILTER (WHERE kind = 'card_burn' AND unit = %(card)s), 0)::bigint
FROM keyed
GROUP BY bucket, group_key
ORDER BY bucket, max(group_label) NULLS LAST, group_key NULLS LAST
"""


@dataclass(frozen=True)
class UsageFilter:
    """A usage report's question: which days (``since`` … ``until`` inclusive, site time), how grouped."""

    since: date
    until: date
    group: str = "user"
    bucket: str = "day"

    def as_query(self) -> dict[str, str]:
        return {
            "from": self.since.isoformat(),
            "to": self.until.isoformat(),
            "group": self.group,
            "bucket": self.bucket,
        }


@dataclass(frozen=True)
class UsageRow:
    bucket: date
    group_key: str | None
    group_label: str | None
    seconds: int  # metered seconds of sessions
    gpu_seconds: Decimal  # seconds × the share of a whole card
    money_micros: int  # money from wallet and overdraft, site currency
    card_micros: int  # card-hour micros burned

    def as_dict(self) -> dict:
        return {
            "bucket": self.bucket.isoformat(),
            "group": self.group_key,
            "label": self.group_label,
            "session_hours": _hours(Decimal(self.seconds)),
            "gpu_hours": _hours(self.gpu_seconds),
            "money_micros": self.money_micros,
            "card_hours_micros": self.card_micros,
        }


@dataclass(frozen=True)
class UsageReport:
    filter: UsageFilter
    rows: list[UsageRow]

    @property
    def totals(self) -> UsageRow:
        return UsageRow(
            bucket=self.filter.since,
            group_key=None,
            group_label=None,
            seconds=sum(r.seconds for r in self.rows),
            gpu_seconds=sum((r.gpu_seconds for r in self.rows), Decimal(0)),
            money_micros=sum(r.money_micros for r in self.rows),
            card_micros=sum(r.card_micros for r in self.rows),
        )

    def per_bucket(self) -> list[tuple[date, int, int]]:
        """(bucket, money, card-hour micros) per bucket, oldest first: the chart's bars."""
        sums: dict[date, list[int]] = {}
        for row in self.rows:
            pair = sums.setdefault(row.bucket, [0, 0])
            pair[0] += row.money_micros
            pair[1] += row.card_micros
        return [(bucket, money, card) for bucket, (money, card) in sorted(sums.items())]

    def as_dict(self) -> dict:
        totals = self.totals.as_dict()
        del totals["bucket"], totals["group"], totals["label"]
        return {
            "filter": self.filter.as_query(),
            "currency": settings.SITE_CURRENCY,
            "rows": [row.as_dict() for row in self.rows],
            "totals": totals,
        }


def _hours(seconds: Decimal) -> str:
    return str((Decimal(seconds) / 3600).quantize(Decimal("0.0001")))


def _site_tz() -> zoneinfo.ZoneInfo:
    return zoneinfo.ZoneInfo(settings.TIME_ZONE)


def _day(value: str, field: str) -> date:
    try:
        day = date.fromisoformat(value.strip())
        if not 2000 <= day.year <= 9000:
            raise ValueError(day)
        return day
    except ValueError:
        raise ValidationFailed(
            _("“%(value)s” is not a date; write it as YYYY-MM-DD.") % {"value": value[:20]},
            fields={field: "invalid"},
        ) from None


def date_range_parse(*, since: str | None, until: str | None) -> tuple[date, date]:
    """The inclusive day range from ``?from=`` and ``?to=`` (default: the last 30 days up to today).

    Raises ValidationFailed on a malformed date, a start after the end, or a range over three years."""
    today = timezone.localdate(timezone=_site_tz())
    end = _day(until, "to") if until else today
    start = _day(since, "from") if since else end - timedelta(days=DEFAULT_DAYS - 1)
    if start > end:
        raise ValidationFailed(_("The start date is after the end date."), fields={"from": "after_to"})
    if (end - start).days > MAX_DAYS:
        raise ValidationFailed(_("A range covers at most three years."), fields={"from": "too_long"})
    return start, end


def usage_filter_parse(*, query: dict) -> UsageFilter:
    """A UsageFilter from a request's query (``from``, ``to``, ``group``, ``bucket``); raises
    ValidationFailed with the problem in words."""
    since, until = date_range_parse(since=query.get("from"), until=query.get("to"))
    group = query.get("group") or "user"
    bucket = query.get("bucket") or "day"
    if group not in GROUPINGS:
        raise ValidationFailed(
            _("Unknown grouping “%(value)s”: choose user, team, GPU model or profile.")
            % {"value": group[:20]},
            fields={"group": "invalid"},
        )
    if bucket not in BUCKETS:
        raise ValidationFailed(
            _("Unknown period “%(value)s”: choose day, week or month.") % {"value": bucket[:20]},
            fields={"bucket": "invalid"},
        )
    return UsageFilter(since=since, until=until, group=group, bucket=bucket)


def _bounds(since: date, until: date) -> tuple[datetime, datetime]:
    tz = _site_tz()
    return datetime.combine(since, time.min, tz), datetime.combine(until + timedelta(days=1), time.min, tz)


def usage_report(*, usage_filter: UsageFilter, account: Account | None = None) -> UsageReport:
    """GPU-hours, card-hours and money of metered sessions in the filter's range, per bucket and group,
    in one query; only ``account``'s meters when given (a team's own report). Reads only."""
    start, end = _bounds(usage_filter.since, usage_filter.until)
    params = {
        "bucket": usage_filter.bucket,
        "group": usage_filter.group,
        "tz": settings.TIME_ZONE,
        "since": start,
        "until": end,
        "account": account.pk if account is not None else None,
        "money": settings.SITE_CURRENCY,
        "card": CARD_UNIT,
    }
    with connection.cursor() as cursor:
        cursor.execute(_USAGE_SQL, params)
        rows = [
            UsageRow(
                bucket=bucket,
                group_key=key or None,
                group_label=label,
                seconds=seconds,
                gpu_seconds=Decimal(gpu_seconds).quantize(MICRO_SECOND),
                money_micros=money,
                card_micros=card,
            )
            for bucket, key, label, seconds, gpu_seconds, money, card in cursor.fetchall()
        ]
    return UsageReport(filter=usage_filter, rows=rows)


# --- the audit log ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AuditFilter:
    actor: str = ""  # a username, exactly
    action: str = ""  # an action, or its family before the dot ("price", "node")
    target_type: str = ""  # app_label.model, e.g. "billing.price"
    since: date | None = None
    until: date | None = None

    def as_query(self) -> dict[str, str]:
        return {
            "actor": self.actor,
            "action": self.action,
            "target": self.target_type,
            "from": self.since.isoformat() if self.since else "",
            "to": self.until.isoformat() if self.until else "",
        }


def audit_filter_parse(*, query: dict) -> AuditFilter:
    """An AuditFilter from ``actor``, ``action``, ``target``, ``from`` and ``to``; raises ValidationFailed
    on a malformed date or a start after the end."""
    since = _day(query["from"], "from") if query.get("from") else None
    until = _day(query["to"], "to") if query.get("to") else None
    if since and until and since > until:
        raise ValidationFailed(_("The start date is after the end date."), fields={"from": "after_to"})
    return AuditFilter(
        actor=(query.get("actor") or "").strip()[:150],
        action=(query.get("action") or "").strip()[:64],
        target_type=(query.get("target") or "").strip()[:64],
        since=since,
        until=until,
    )


def audit_entries(*, audit_filter: AuditFilter) -> QuerySet[AuditEntry]:
    """Audit rows matching the filter, newest first, with their actor."""
    entries = AuditEntry.objects.select_related("actor").order_by("-created_at", "-id")
    if audit_filter.actor:
        entries = entries.filter(actor__username=audit_filter.actor)
    if audit_filter.action:
        entries = entries.filter(
            Q(action=audit_filter.action) | Q(action__startswith=f"{audit_filter.action}.")
        )
    if audit_filter.target_type:
        entries = entries.filter(target_type=audit_filter.target_type)
    tz = _site_tz()
    if audit_filter.since:
        entries = entries.filter(created_at__gte=datetime.combine(audit_filter.since, time.min, tz))
    if audit_filter.until:
        end = datetime.combine(audit_filter.until + timedelta(days=1), time.min, tz)
        entries = entries.filter(created_at__lt=end)
    return entries


def audit_actions() -> list[str]:
    """Every action the log holds, for the filter's choices."""
    return list(AuditEntry.objects.order_by("action").values_list("action", flat=True).distinct())


def audit_row(entry: AuditEntry) -> dict:
    """One audit row as the exports write it."""
    return {
        "id": entry.id,
        "time": entry.created_at.isoformat(),
        "actor": entry.actor.get_username() if entry.actor_id else None,
        "action": entry.action,
        "target_type": entry.target_type,
        "target_id": entry.target_id,
        "before": entry.before,
        "after": entry.after,
        "reason": entry.reason,
    }
