"""The billing admin: the ledger is read-only, an adjustment needs a reason and leaves an audit row,
a batch is issued with its codes downloaded once as CSV."""

from __future__ import annotations

import csv
import io

import pytest
from django.contrib import admin
from django.test import Client

from billing.codes import code_normalize
from billing.models import AuditEntry, CardBatch, Entry, LedgerAccount, Transfer
from billing.services.ledger import wallet_for
from portal.services import user_create
from tests.billing.conftest import fund

pytestmark = pytest.mark.django_db


@pytest.fixture
def staff():
    user = user_create(
        username="root", email="root@example.com", password="a-long-pass-phrase-9", is_staff=True
    )
    user.is_superuser = True
    user.save(update_fields=["is_superuser"])
    client = Client()
    client.force_login(user)
    return user, client


def test_every_billing_model_is_in_the_admin_and_the_ledger_is_append_only(staff):
    from django.apps import apps

    for model in apps.get_app_config("billing").get_models():
        assert model in admin.site._registry, model
    _, client = staff
    account = user_create(username="payer", email="", password="a-long-pass-phrase-9").account
    fund(account, 1_000_000)
    transfer = Transfer.objects.get()
    for model, pk in (
        (Transfer, transfer.pk),
        (LedgerAccount, transfer.credit_id),
        (Entry, Entry.objects.first().pk),
    ):
        model_admin = admin.site._registry[model]
        request = type("R", (), {"user": staff[0]})()
        assert not model_admin.has_change_permission(request, None)
        assert not model_admin.has_delete_permission(request, None)
        assert not model_admin.has_add_permission(request)
        page = client.get(f"/admin/billing/{model._meta.model_name}/{pk}/change/")
        assert page.status_code == 200  # viewable, read-only
        assert client.post(f"/admin/billing/{model._meta.model_name}/{pk}/delete/").status_code == 403
    for name in ("transfer", "ledgeraccount", "entry", "meter", "card", "cardbatch", "auditentry", "account"):
        assert client.get(f"/admin/billing/{name}/?q=x").status_code == 200


def test_an_adjustment_needs_a_reason_and_leaves_an_audit_row(staff):
    user, client = staff
    account = user_create(username="payer", email="", password="a-long-pass-phrase-9").account
    url = f"/admin/billing/account/{account.pk}/adjust/"
    assert client.get(url).status_code == 200
    refused = client.post(url, {"amount": "5", "reason": "  ", "idempotency_key": "k1"})
    assert refused.status_code == 200 and b"reason" in refused.content
    assert not Transfer.objects.exists()
    done = client.post(url, {"amount": "5.25", "reason": "goodwill for the outage", "idempotency_key": "k2"})
    assert done.status_code == 302
    client.post(
        url, {"amount": "5.25", "reason": "goodwill for the outage", "idempotency_key": "k2"}
    )  # replay
    assert wallet_for(account=account).balance_micros == 5_250_000
    audit = AuditEntry.objects.get(action="wallet.adjust")
    assert audit.actor == user and audit.reason == "goodwill for the outage"
    assert audit.before == {"balance_micros": 0} and audit.after == {"balance_micros": 5_250_000}
    too_much = client.post(url, {"amount": "-100", "reason": "oops", "idempotency_key": "k3"})
    assert too_much.status_code == 200 and wallet_for(account=account).balance_micros == 5_250_000


def test_issuing_a_batch_in_the_admin_downloads_its_codes_once(staff):
    _, client = staff
    assert client.get("/admin/billing/cardbatch/add/").status_code == 200
    bad = client.post("/admin/billing/cardbatch/add/", {"hours": "2", "count": "3", "max_parts": "3"})
    assert bad.status_code == 200 and not CardBatch.objects.exists()  # no validity given
    response = client.post(
        "/admin/billing/cardbatch/add/",
        {
            "label": "CV201",
            "hours": "2",
            "count": "3",
            "valid_days": "30",
            "max_parts": "3",
            "one_per_user": "on",
        },
    )
    assert response["Content-Type"].startswith("text/csv")
    rows = list(csv.DictReader(io.StringIO(response.content.decode())))
    assert len(rows) == 3 and all(code_normalize(r["code"]) for r in rows)
    batch = CardBatch.objects.get(label="CV201")
    assert batch.cards.count() == 3 and batch.hours_micros == 2_000_000
    assert client.get(f"/admin/billing/cardbatch/{batch.pk}/change/").status_code == 200
