"""The usage reports (staff: the whole site; a team's owners and admins: their team) and the staff audit
log, each as a page, as CSV (``?format=csv``) and as JSON (``?format=json``) of the same figures."""

from __future__ import annotations

import csv
import json

from django.contrib.admin.views.decorators import staff_member_required
from django.contrib.auth.decorators import login_required
from django.core.paginator import Paginator
from django.http import Http404, HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.shortcuts import render
from django.utils.translation import gettext as _

from billing.models import Account
from core.errors import ValidationFailed
from portal import reports
from portal.selectors import team_get_for_member

AUDIT_PAGE_SIZE = 50
USAGE_COLUMNS = ("session_hours", "gpu_hours", "money_micros", "card_hours_micros")
AUDIT_COLUMNS = ("id", "time", "actor", "action", "target_type", "target_id", "before", "after", "reason")


class _Echo:
    def write(self, value):
        return value


def _group_label(group: str, row: reports.UsageRow) -> str:
    if row.group_label:
        return row.group_label
    if group == "team":
        return _("Personal accounts")
    if group == "gpu_model":
        return _("No GPU (cpu)")
    return _("Unknown")


def _usage_csv(report: reports.UsageReport, filename: str) -> HttpResponse:
    response = HttpResponse(content_type="text/csv; charset=utf-8")
    response["Content-Disposition"] = f'attachment; filename="{filename}.csv"'
    writer = csv.writer(response)
    writer.writerow(["bucket", report.filter.group, "label", *USAGE_COLUMNS])
    for row in report.rows:
        line = row.as_dict()
        label = _group_label(report.filter.group, row)
        writer.writerow([line["bucket"], line["group"] or "", label, *(line[c] for c in USAGE_COLUMNS)])
    totals = report.totals.as_dict()
    writer.writerow(["total", "", "", *(totals[c] for c in USAGE_COLUMNS)])
    return response


def _usage_answer(
    request: HttpRequest, *, account: Account | None, template: str, context: dict, filename: str
) -> HttpResponse:
    """The report in the format asked for; bad filters are a 400 with the problem in words."""
    answer = request.GET.get("format") or "html"
    if answer not in ("html", "csv", "json"):
        answer, error = "html", _("Unknown format: choose csv or json.")
    else:
        error = None
    report = None
    if error is None:
        try:
            usage_filter = reports.usage_filter_parse(query=request.GET)
        except ValidationFailed as exc:
            error = exc.message
        else:
            report = reports.usage_report(usage_filter=usage_filter, account=account)
    if error is not None:
        if answer == "json":
            return JsonResponse({"error": error}, status=400)
        if answer == "csv":
            return HttpResponse(error, status=400, content_type="text/plain; charset=utf-8")
    elif answer == "json":
        return JsonResponse(report.as_dict(), json_dumps_params={"ensure_ascii": False})
    elif answer == "csv":
        return _usage_csv(report, filename)
    bars = report.per_bucket() if report else []
    peak = max((money for _bucket, money, _card in bars), default=0)
    card_peak = max((card for _bucket, _money, card in bars), default=0)
    context |= {
        "report": report,
        "error": error,
        "query": request.GET,
        "rows": [(row, _group_label(report.filter.group, row)) for row in report.rows] if report else [],
        "bars": [
            {
                "bucket": bucket,
                "money_micros": money,
                "card_micros": card,
                "money_percent": round(100 * money / peak, 1) if peak else 0,
                "card_percent": round(100 * card / card_peak, 1) if card_peak else 0,
            }
            for bucket, money, card in bars
        ],
        "groupings": [
            ("user", _("User")),
            ("team", _("Team")),
            ("gpu_model", _("GPU model")),
            ("profile", _("GPU profile")),
        ],
        "buckets": [("day", _("Day")), ("week", _("Week")), ("month", _("Month"))],
        "export_query": _export_query(request),
    }
    return render(request, template, context, status=400 if error else 200)


def _export_query(request: HttpRequest) -> str:
    query = request.GET.copy()
    query.pop("format", None)
    query.pop("page", None)
    return query.urlencode()


@staff_member_required
def usage_report_site(request: HttpRequest) -> HttpResponse:
    """The whole site's usage, for staff."""
    return _usage_answer(
        request, account=None, template="portal/usage_report.html", context={}, filename="suanli-usage"
    )


@login_required
def usage_report_team(request: HttpRequest, slug: str) -> HttpResponse:
    """One team's usage, for its owners and admins; a member is told it is not their role (403)."""
    found = team_get_for_member(user=request.user, slug=slug)
    if found is None:
        raise Http404
    team, membership = found
    if not membership.manages_team:
        message = _("Only the team's owners and admins can see its usage report.")
        if request.GET.get("format") == "json":
            return JsonResponse({"error": message}, status=403)
        return render(request, "portal/forbidden.html", {"message": message}, status=403)
    return _usage_answer(
        request,
        account=team.account,
        template="portal/usage_report.html",
        context={"team": team},
        filename=f"suanli-usage-{team.slug}",
    )


def _audit_display(entry) -> dict:
    row = reports.audit_row(entry)
    for side in ("before", "after"):
        row[side] = "" if row[side] is None else json.dumps(row[side], ensure_ascii=False, sort_keys=True)
    row["created_at"] = entry.created_at
    return row


@staff_member_required
def audit_log(request: HttpRequest) -> HttpResponse:
    """Every admin and money change (who, what, before, after), filtered, paged, exportable."""
    answer = request.GET.get("format") or "html"
    try:
        if answer not in ("html", "csv", "json"):
            raise ValidationFailed(_("Unknown format: choose csv or json."))
        audit_filter = reports.audit_filter_parse(query=request.GET)
    except ValidationFailed as exc:
        if answer == "json":
            return JsonResponse({"error": exc.message}, status=400)
        if answer == "csv":
            return HttpResponse(exc.message, status=400, content_type="text/plain; charset=utf-8")
        context = {"error": exc.message, "query": request.GET, "actions": reports.audit_actions()}
        return render(request, "portal/audit_log.html", context, status=400)
    entries = reports.audit_entries(audit_filter=audit_filter)
    if answer == "json":
        rows = [reports.audit_row(entry) for entry in entries.iterator(chunk_size=2000)]
        return JsonResponse(
            {"filter": audit_filter.as_query(), "entries": rows}, json_dumps_params={"ensure_ascii": False}
        )
    if answer == "csv":
        writer = csv.writer(_Echo())

        def lines():
            yield writer.writerow(AUDIT_COLUMNS)
            for entry in entries.iterator(chunk_size=2000):
                row = _audit_display(entry)
                yield writer.writerow([row[h] if row[h] is not None else "" for h in AUDIT_COLUMNS])

        response = StreamingHttpResponse(lines(), content_type="text/csv; charset=utf-8")
        response["Content-Disposition"] = 'attachment; filename="suanli-audit.csv"'
        return response
    page = Paginator(entries, AUDIT_PAGE_SIZE).get_page(request.GET.get("page"))
    context = {
        "page": page,
        "rows": [_audit_display(entry) for entry in page.object_list],
        "query": request.GET,
        "actions": reports.audit_actions(),
        "export_query": _export_query(request),
    }
    return render(request, "portal/audit_log.html", context)
