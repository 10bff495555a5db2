"""The usage reports and the audit log as staff, a team's owner and a team's member see them: figures
equal to the ledger, filters, CSV and JSON exports of the same figures, and clear answers to bad input."""

from __future__ import annotations

import csv
import html
import io
import json

import pytest
from django.test import Client
from django.utils import timezone

from billing.models import AuditEntry, Entry, LedgerAccount, Transfer
from billing.services.pricing import burn_rate_set, price_set
from billing.services.topups import wallet_credit_promotion
from portal.models import Membership
from portal.services import team_create, user_create
from provisioner.services.nodes import node_enroll
from tests.billing.conftest import A100, seed_prices
from tests.portal.usage_fixtures import catalog_ensure, metered_session

pytestmark = pytest.mark.django_db


def _client(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture
def usage():
    """olga owns the Lab team and ran an A100 for half an hour on her own wallet (¥6.00); mia, a member,
    ran half a T4 for an hour on the team's wallet (¥1.00)."""
    seed_prices()
    catalog_ensure()
    root = user_create(username="root", email="", password="pw-123456789", is_staff=True)
    olga = user_create(username="olga", email="", password="pw-123456789")
    mia = user_create(username="mia", email="", password="pw-123456789")
    team = team_create(creator=olga, name="Lab")
    Membership.objects.create(team=team, user=mia, role=Membership.Role.MEMBER)
    wallet_credit_promotion(account=olga.account, amount_micros=20_000_000, idempotency_key="f-olga")
    wallet_credit_promotion(account=team.account, amount_micros=20_000_000, idempotency_key="f-team")
    metered_session(owner=olga, account=olga.account, gpu_model=A100, profile="whole", seconds=1800)
    metered_session(owner=mia, account=team.account, gpu_model="T4", profile="1/2", seconds=3600)
    return {"root": root, "olga": olga, "mia": mia, "team": team}


def _ledger_usage_micros(account=None) -> int:
    entries = Entry.objects.filter(
        transfer__kind=Transfer.Kind.USAGE,
        account__kind__in=[LedgerAccount.Kind.WALLET, LedgerAccount.Kind.OVERDRAFT],
    )
    if account is not None:
        entries = entries.filter(account__owner=account)
    return -sum(entries.values_list("amount_micros", flat=True))


def test_staff_json_by_user_matches_the_ledger(usage):
    body = _client(usage["root"]).get("/operations/usage/?group=user&format=json").json()
    by_label = {row["label"]: row for row in body["rows"]}
    assert by_label["olga"]["money_micros"] == 6_000_000
    assert by_label["olga"]["gpu_hours"] == "0.5000" and by_label["olga"]["session_hours"] == "0.5000"
    assert by_label["mia"]["money_micros"] == 1_000_000  # her team session is hers, paid by the team
    assert by_label["mia"]["gpu_hours"] == "0.5000" and by_label["mia"]["session_hours"] == "1.0000"
    assert by_label["olga"]["card_hours_micros"] == 0
    assert body["totals"]["money_micros"] == 7_000_000 == _ledger_usage_micros()
    assert body["filter"]["bucket"] == "day" and body["currency"] == "CNY"


@pytest.mark.parametrize(
    ("group", "expected"),
    [
        ("team", {"Lab": 1_000_000, None: 6_000_000}),
        ("gpu_model", {A100: 6_000_000, "T4": 1_000_000}),
        ("profile", {"whole": 6_000_000, "1/2": 1_000_000}),
    ],
)
def test_staff_groupings_partition_the_total(usage, group, expected):
    body = _client(usage["root"]).get(f"/operations/usage/?group={group}&bucket=month&format=json").json()
    assert {row["label"]: row["money_micros"] for row in body["rows"]} == expected
    assert body["totals"]["money_micros"] == sum(expected.values())


def test_csv_export_has_the_same_figures_and_a_total_line(usage):
    response = _client(usage["root"]).get("/operations/usage/?group=gpu_model&format=csv")
    assert response["Content-Type"].startswith("text/csv")
    lines = list(csv.reader(io.StringIO(response.content.decode())))
    assert lines[0] == [
        "bucket", "gpu_model", "label", "session_hours", "gpu_hours", "money_micros", "card_hours_micros"
    ]  # fmt: skip
    today = timezone.localdate().isoformat()
    assert [today, A100, A100, "0.5000", "0.5000", "6000000", "0"] in lines
    assert [today, "T4", "T4", "1.0000", "0.5000", "1000000", "0"] in lines
    assert lines[-1] == ["total", "", "", "1.5000", "1.0000", "7000000", "0"]


def test_the_page_shows_chart_table_and_totals(usage):
    page = _client(usage["root"]).get("/operations/usage/?group=user").content.decode()
    assert 'data-testid="usage-chart"' in page and 'data-testid="usage-table"' in page
    assert "¥7.00" in page and "olga" in page and "mia" in page
    assert "format=csv" in page and "format=json" in page
    assert "cdn" not in page.lower() and '<script src="http' not in page


def test_a_range_without_usage_says_so(usage):
    client = _client(usage["root"])
    page = client.get("/operations/usage/?from=2024-01-01&to=2024-01-31").content.decode()
    assert (
        'data-testid="report-empty"' in page and "No metered usage between 2024-01-01 and 2024-01-31" in page
    )
    body = client.get("/operations/usage/?from=2024-01-01&to=2024-01-31&format=json").json()
    assert body["rows"] == [] and body["totals"]["money_micros"] == 0


@pytest.mark.parametrize(
    ("query", "message"),
    [
        ("from=2026-13-01", "is not a date"),
        ("to=yesterday", "is not a date"),
        ("from=2026-05-02&to=2026-05-01", "The start date is after the end date."),
        ("group=colour", "Unknown grouping"),
        ("bucket=year", "Unknown period"),
        ("from=2000-01-01&to=2026-01-01", "at most three years"),
        ("format=xml", "Unknown format"),
    ],
)
def test_bad_filters_are_a_clear_400(usage, query, message):
    client = _client(usage["root"])
    response = client.get(f"/operations/usage/?{query}")
    assert response.status_code == 400
    assert message in response.content.decode()
    if "format" not in query:
        answer = client.get(f"/operations/usage/?{query}&format=json")
        assert answer.status_code == 400 and message in answer.json()["error"]
        assert client.get(f"/operations/usage/?{query}&format=csv").status_code == 400


def test_the_site_report_and_audit_log_are_for_staff_only(usage):
    olga = _client(usage["olga"])
    for url in ("/operations/usage/", "/operations/usage/?format=json", "/operations/audit/?format=csv"):
        response = olga.get(url)
        assert response.status_code == 302 and "/admin/login/" in response["Location"]


def test_a_team_owner_sees_only_the_team_account(usage):
    owner = _client(usage["olga"])
    body = owner.get("/teams/lab/usage/?group=user&format=json").json()
    assert [(row["label"], row["money_micros"]) for row in body["rows"]] == [("mia", 1_000_000)]
    assert body["totals"]["money_micros"] == 1_000_000 == _ledger_usage_micros(usage["team"].account)
    page = owner.get("/teams/lab/usage/").content.decode()
    assert "Lab" in page and "¥1.00" in page and "¥6.00" not in page
    assert "/teams/lab/usage/" in owner.get("/teams/lab/").content.decode()


def test_a_team_member_gets_a_clear_403_and_a_stranger_404(usage):
    member = _client(usage["mia"])
    response = member.get("/teams/lab/usage/")
    assert response.status_code == 403
    assert "Only the team's owners and admins can see its usage report." in html.unescape(
        response.content.decode()
    )
    assert member.get("/teams/lab/usage/?format=json").status_code == 403
    assert "/teams/lab/usage/" not in member.get("/teams/lab/").content.decode()
    assert _client(usage["root"]).get("/teams/lab/usage/").status_code == 404  # not a member


def test_a_chinese_reader_sees_the_report_in_chinese(usage):
    usage["root"].language = "zh-hans"
    usage["root"].save(update_fields=["language"])
    page = _client(usage["root"]).get("/operations/usage/", HTTP_ACCEPT_LANGUAGE="zh-hans").content.decode()
    assert "用量报告" in page and "GPU 小时" in page
    assert "Usage report" not in page


# --- the audit log ------------------------------------------------------------------------------------


@pytest.fixture
def audited(usage):
    root = usage["root"]
    price_set(gpu_model="T4", profile="whole", price_micros_per_hour=3_000_000, actor=root, reason="new T4s")
    burn_rate_set(gpu_model=A100, multiplier_milli=2500, actor=root, reason="A100 dearer")
    node_enroll(name="node-a", address="http://10.0.0.5:9000", actor=root)
    node_enroll(name="node-a", address="http://10.0.0.6:9000", actor=root)
    return usage


def test_the_audit_log_lists_who_changed_what_with_before_and_after(audited):
    page = _client(audited["root"]).get("/operations/audit/").content.decode()
    assert 'data-testid="audit-table"' in page
    assert "price.set" in page and "burn_rate.set" in page and "node.token_rotate" in page
    assert "new T4s" in page and "root" in page
    body = _client(audited["root"]).get("/operations/audit/?action=price&format=json").json()
    t4 = next(e for e in body["entries"] if e["reason"] == "new T4s")
    assert t4["actor"] == "root"
    assert t4["before"] == {"price_micros_per_hour": 2_000_000}
    assert t4["after"] == {"price_micros_per_hour": 3_000_000}
    assert {e["action"] for e in body["entries"]} == {"price.set"}


def test_every_change_of_a_rate_or_node_records_the_state_before(audited):
    burn = AuditEntry.objects.get(action="burn_rate.set", reason="A100 dearer")
    assert burn.before == {"multiplier_milli": 2000} and burn.after == {"multiplier_milli": 2500}
    rotate = AuditEntry.objects.get(action="node.token_rotate")
    assert rotate.before["address"] == "http://10.0.0.5:9000"
    assert rotate.after["address"] == "http://10.0.0.6:9000"


def test_the_audit_log_filters_by_actor_subject_and_dates(audited):
    client = _client(audited["root"])
    by_root = client.get("/operations/audit/?actor=root&format=json").json()["entries"]
    assert by_root and all(e["actor"] == "root" for e in by_root)
    assert client.get("/operations/audit/?actor=nobody&format=json").json()["entries"] == []
    nodes = client.get("/operations/audit/?target=provisioner.node&format=json").json()["entries"]
    assert {e["action"] for e in nodes} == {"node.enroll", "node.token_rotate"}
    today = timezone.localdate().isoformat()
    assert client.get(f"/operations/audit/?from={today}&to={today}&format=json").json()["entries"]
    old = client.get("/operations/audit/?from=2024-01-01&to=2024-01-02")
    assert 'data-testid="audit-empty"' in old.content.decode()


def test_the_audit_csv_has_before_and_after_as_json(audited):
    response = _client(audited["root"]).get("/operations/audit/?action=price.set&format=csv")
    rows = list(csv.DictReader(io.StringIO(b"".join(response.streaming_content).decode())))
    t4 = next(r for r in rows if r["reason"] == "new T4s")
    assert json.loads(t4["before"]) == {"price_micros_per_hour": 2_000_000}
    assert json.loads(t4["after"]) == {"price_micros_per_hour": 3_000_000}
    assert t4["actor"] == "root" and t4["target_type"] == "billing.price"


def test_the_audit_log_is_paged(audited):
    for n in range(60):
        price_set(gpu_model="T4", profile="1/2", price_micros_per_hour=1_000_000 + n, actor=audited["root"])
    client = _client(audited["root"])
    first = client.get("/operations/audit/").content.decode()
    assert "Page 1 of 2" in first and "page=2" in first
    second = client.get("/operations/audit/?page=2").content.decode()
    assert "Page 2 of 2" in second


@pytest.mark.parametrize("query", ["from=2026-02-30", "from=2026-05-02&to=2026-05-01"])
def test_bad_audit_filters_are_a_clear_400(audited, query):
    client = _client(audited["root"])
    response = client.get(f"/operations/audit/?{query}")
    assert response.status_code == 400 and 'data-testid="audit-error"' in response.content.decode()
    assert client.get(f"/operations/audit/?{query}&format=json").status_code == 400


def test_a_team_card_split_records_what_the_card_held_before(usage):
    from billing.services.cards import card_batch_issue, card_redeem, card_split

    olga, team = usage["olga"], usage["team"]
    _batch, (code,) = card_batch_issue(hours_micros=10_000_000, count=1, valid_days=30)
    card = card_redeem(user=olga, account=team.account, code=code)
    card_split(card_id=card.id, account=team.account, parts=[4_000_000], actor=olga)
    entry = AuditEntry.objects.get(action="cards.split")
    assert entry.before == {"card_id": card.id, "hours_left_micros": 10_000_000}
    assert entry.after["parts"][0]["hours_micros"] == 4_000_000
    body = _client(usage["root"]).get("/operations/audit/?action=cards&format=json").json()
    assert [e["before"] for e in body["entries"] if e["action"] == "cards.split"] == [entry.before]
