"""The pages of what a student and a team see: dashboard, wallet, cards, launch, sessions, operations.

Views are thin: they pick the account the caller may see (their own, or a team's they belong to), call
one billing/provisioner selector or service, and render. Fragments (``…/live``) are the same templates'
parts, polled by ``static/js/live.js`` for live state without reloads.
"""

from __future__ import annotations

import csv
from datetime import datetime, time, timedelta
from decimal import Decimal, InvalidOperation

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.db.models import DateField, DateTimeField, F, Func, Sum, Value
from django.db.models.functions import Cast
from django.http import HttpRequest, HttpResponse, StreamingHttpResponse
from django.shortcuts import redirect, render
from django.utils import timezone
from django.utils.translation import gettext as _

from billing import selectors as billing_selectors
from billing.models import Account, Card, Entry, LedgerAccount, Transfer
from billing.services import cards as card_services
from billing.services.storage import storage_cost
from billing.services.topups import amount_parse, topup_create
from core.compiled import Lookup
from core.errors import ApplicationError, ValidationFailed
from core.units import hours_to_micros
from portal.selectors import account_managed_by, accounts_payable_by
from portal.session_pages import running_sessions
from portal.shortcuts import account_or_404, newer_older_page
from portal.templatetags.suanli import card_hours
from provisioner.quotas import home_use_of

# The spend chart's days, on the dashboard and the wallet. Compiled once per process, so the reader's time
# zone is a key of the query (PostgreSQL's ``timezone()``), not the active zone Django's ``__date`` and
# ``TruncDate`` write into the SQL (core.compiled refuses those).
_SPEND_BY_DAY = Lookup(
    lambda account_id, since, zone: (
        Entry.objects.filter(
            account__owner_id=account_id,
            account__kind__in=[LedgerAccount.Kind.WALLET, LedgerAccount.Kind.OVERDRAFT],
            transfer__kind__in=[Transfer.Kind.USAGE, Transfer.Kind.STORAGE],
            amount_micros__lt=0,
            transfer__created_at__gte=since,
        )
        .annotate(
            day=Cast(
                Func(
                    Value(zone), F("transfer__created_at"), function="timezone", output_field=DateTimeField()
                ),
                DateField(),
            )
        )
        .values("day")
        .annotate(spent=Sum("amount_micros"))
        .values_list("day", "spent")
    ),
    key_types=(int, datetime, str),
    many=True,
)


def daily_spend(*, account: Account, days: int = 30) -> list[tuple[str, int]]:
    """Money spent per day of the reader's time zone (GPU time and home storage, from wallet and
    overdraft), oldest first, zero-filled."""
    since = timezone.localdate() - timedelta(days=days - 1)
    start = timezone.make_aware(datetime.combine(since, time.min))
    rows = _SPEND_BY_DAY.all(account.pk, start, timezone.get_current_timezone_name())
    by_day = {day: -spent for day, spent in rows}
    return [
        ((since + timedelta(days=n)).isoformat(), by_day.get(since + timedelta(days=n), 0))
        for n in range(days)
    ]


def _money_context(request: HttpRequest, account: Account, *, with_team_folders: bool = False) -> dict:
    money = _funds_context(account)
    cards = (
        billing_selectors.usable_cards(account=account)
        .select_related("ledger_account")
        .order_by("expires_at", "created_at")
    )
    return {
        "account": account,
        "accounts": accounts_payable_by(user=request.user, with_team_folders=with_team_folders),
        # split, gift, revoke and top up: the account's own user, a team's owners and admins
        "can_manage": account_managed_by(user=request.user, account=account),
        "cards": cards,
        **money,
    }


@login_required
def wallet(request: HttpRequest) -> HttpResponse:
    account = account_or_404(request)
    if request.method == "POST":
        try:
            amount_micros = amount_parse(amount=request.POST.get("amount", ""))
            topup = topup_create(
                account=account,
                amount_micros=amount_micros,
                actor=request.user,
                idempotency_key=request.POST.get("idempotency_key") or None,
            )
        except ApplicationError as exc:
            messages.error(request, exc.message)
            return redirect(f"{request.path}?account={account.pk}")
        return redirect(topup.checkout_url)
    if request.GET.get("topup") == "success":
        messages.success(
            request, _("Thank you: your top-up is credited as soon as the payment is confirmed.")
        )
    elif request.GET.get("topup") == "cancelled":
        messages.warning(request, _("The top-up was cancelled; nothing was charged."))
    entries = billing_selectors.ledger_entries(account=account, kind=request.GET.get("kind") or None)
    page = newer_older_page(entries, request.GET.get("page"), size=25)
    context = _money_context(request, account) | {
        "entries": page,
        "kinds": Transfer.Kind.choices,
        "kind": request.GET.get("kind", ""),
        "spend": daily_spend(account=account),
        "topups": billing_selectors.topups_recent(account=account),
        "new_key": __import__("uuid").uuid4().hex,
    }
    return render(request, "portal/wallet.html", context)


class _Echo:
    def write(self, value):
        return value


@login_required
def wallet_statement_csv(request: HttpRequest) -> StreamingHttpResponse:
    """The account's whole ledger history as CSV (streamed, any length)."""
    account = account_or_404(request)
    entries = billing_selectors.ledger_entries(account=account, kind=request.GET.get("kind") or None)
    writer = csv.writer(_Echo())

    def rows():
        header = ["time", "kind", "ledger_account", "unit", "amount_micros", "balance_after_micros"]
        yield writer.writerow([*header, "memo", "session"])
        for entry in entries.iterator(chunk_size=2000):
            meter = entry.transfer.meter
            yield writer.writerow(
                [
                    entry.transfer.created_at.isoformat(),
                    entry.transfer.kind,
                    entry.account.kind,
                    entry.account.unit,
                    entry.amount_micros,
                    entry.balance_after_micros,
                    entry.transfer.memo,
                    meter.session_ref if meter else "",
                ]
            )

    response = StreamingHttpResponse(rows(), content_type="text/csv; charset=utf-8")
    response["Content-Disposition"] = f'attachment; filename="suanli-statement-{account.pk}.csv"'
    return response


@login_required
def funds_live(request: HttpRequest) -> HttpResponse:
    account = account_or_404(request)
    return render(request, "includes/funds.html", _money_context(request, account))


def _funds_context(account: Account) -> dict:
    funds = billing_selectors.account_funds(account=account)
    return {"funds": funds, "runway_warn": funds.runway_seconds is not None and funds.runway_seconds < 600}


@login_required
def dashboard_live(request: HttpRequest) -> HttpResponse:
    """What changes on the dashboard while it is open (funds, runway, the sessions' state and cost), in
    one answer the page polls: each part replaces its own element (static/js/live.js)."""
    account = account_or_404(request)
    context = _funds_context(account) | {"running": running_sessions(user=request.user)}
    return render(request, "includes/dashboard_live.html", context)


@login_required
def dashboard(request: HttpRequest) -> HttpResponse:
    account = account_or_404(request)
    money = _money_context(request, account, with_team_folders=True)
    # the teams are those whose accounts the user pays with, with their folders (one query for all)
    teams = sorted(
        (a.team for a in money["accounts"] if a.kind == Account.Kind.TEAM), key=lambda team: team.name
    )
    context = money | {
        "teams": teams,
        # the folders measured so far, as the home line shows the home once measured
        "team_folders": [(t, t.account.team_folder.use) for t in teams if t.account.team_folder.use],
        "spend": daily_spend(account=account),
        "running": running_sessions(user=request.user),
        "home": home_use_of(request.user),  # read with the request's user: no query
    }
    # storage's price, where one is set (cached: no query)
    context["storage"] = context["home"] and storage_cost(home_bytes=context["home"].bytes)
    return render(request, "portal/dashboard.html", context)


def _hours_to_micros(text: str) -> int:
    try:
        hours = Decimal(text.strip())
    except (InvalidOperation, ValueError):
        raise ValidationFailed(_("“%(text)s” is not a number of hours.") % {"text": text[:20]}) from None
    try:
        micros = hours_to_micros(hours)
    except ValueError:  # a fraction of a micro-hour, or not finite
        micros = 0
    if micros <= 0:
        raise ValidationFailed(_("Hours must be positive, with at most six decimals."))
    return micros


def _client_ip(request: HttpRequest) -> str:
    return request.META.get("REMOTE_ADDR", "")


@login_required
def cards(request: HttpRequest) -> HttpResponse:
    """Redeem, split, gift and revoke compute cards; every card with its lineage."""
    account = account_or_404(request)
    if request.method == "POST":
        action = request.POST.get("action")
        try:
            if action == "redeem":
                card = card_services.card_redeem(
                    user=request.user,
                    account=account,
                    code=request.POST.get("code", "")[:200],
                    ip=_client_ip(request),
                )
                messages.success(
                    request,
                    _("Redeemed: %(hours)s of compute on this account.")
                    % {"hours": _format_hours(card.ledger_account.balance_micros)},
                )
            elif action == "split":
                parts = [
                    _hours_to_micros(p)
                    for p in request.POST.get("parts", "").replace("，", ",").split(",")
                    if p.strip()
                ]
                made = card_services.card_split(
                    card_id=int(request.POST.get("card", 0)), account=account, parts=parts, actor=request.user
                )
                request.session["new_codes"] = [(code, part.hours_micros) for part, code in made]
            elif action == "gift":
                part, code = card_services.card_gift(
                    card_id=int(request.POST.get("card", 0)), account=account, actor=request.user
                )
                request.session["new_codes"] = [(code, part.hours_micros)]
            elif action == "revoke":
                card_services.card_revoke(
                    card_id=int(request.POST.get("card", 0)), account=account, actor=request.user
                )
                messages.success(request, _("Revoked: its hours are back on the card it came from."))
        except ApplicationError as exc:
            messages.error(request, exc.message)
        except ValueError:
            messages.error(request, _("That card is not yours."))
        return redirect(f"{request.path}?account={account.pk}")
    context = _money_context(request, account) | {
        "owned": _CARDS_OWNED.all(account.pk),
        "given": _CARDS_GIVEN.all(account.pk),
        "new_codes": request.session.pop("new_codes", None),
    }
    return render(request, "portal/cards.html", context)


# The cards page's two lists: compiled once per process.
_CARDS_OWNED = Lookup(
    lambda account_id: (
        Card.objects.filter(owner_id=account_id)
        .exclude(state=Card.State.UNREDEEMED)
        .select_related("ledger_account", "batch", "parent", "gifted_by", "redeemed_by")
        .order_by("state", "expires_at", "created_at")
    ),
    key_types=(int,),
    many=True,
)
_CARDS_GIVEN = Lookup(
    lambda account_id: (
        Card.objects.filter(parent__owner_id=account_id, state__in=[Card.State.UNREDEEMED, Card.State.GIFTED])
        .select_related("ledger_account", "parent")
        .order_by("-created_at")
    ),
    key_types=(int,),
    many=True,
)


def _format_hours(micros: int) -> str:
    return card_hours(micros)
