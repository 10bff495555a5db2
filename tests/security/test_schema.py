"""Schemathesis against the served OpenAPI document (``/api/schema/``), in-process through Django's WSGI
app, authenticated with a personal access token that has every scope: no 5xx, every status code
documented, every answer shaped as the schema says. Bounded and derandomised: 20 examples per operation
and generation mode, so the run is the same on every machine and stays around two minutes on two cores.

The agents' heartbeat and the Stripe webhook have their own authentication and are left out of the
user-token run; ``test_hardening`` sends them garbage.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import schemathesis
from django.contrib.auth import get_user_model
from django.core.cache import cache
from django.core.signals import request_finished, request_started
from django.core.wsgi import get_wsgi_application
from django.db import close_old_connections
from django.utils import timezone
from hypothesis import HealthCheck, settings
from rest_framework.test import APIClient
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import response_schema_conformance, status_code_conformance

from billing.services.cards import card_batch_issue, card_redeem
from portal.models import Membership
from portal.services import access_token_create, team_create, team_invite_create
from provisioner.messages import message, message_columns
from provisioner.models import StopWarning
from provisioner.services.sessions import session_launch
from tests.provisioner.conftest import (
    A100,
    ENV,
    beat,
    fund,
    make_catalog,
    make_node,
    make_user,
    workload_status,
)

APP = get_wsgi_application()
CONFIG = schemathesis.Config.from_dict(
    {
        "generation": {"max-examples": 20, "deterministic": True, "database": "none"},
        # The coverage phase (every boundary of every field) takes minutes here; fuzzing with positive
        # and negative data finds the same classes of fault within the bound.
        "phases": {"coverage": {"enabled": False}, "stateful": {"enabled": False}},
    }
)
schema = schemathesis.openapi.from_wsgi("/api/schema/?format=json", APP, config=CONFIG)
user_schema = schema.exclude(path="/api/agent/heartbeat")

CHECKS = [not_a_server_error, response_schema_conformance, status_code_conformance]


@pytest.fixture
def in_process_requests():
    """As Django's test client does: the WSGI app must not close the test's connection mid-test."""
    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    yield
    request_started.connect(close_old_connections)
    request_finished.connect(close_old_connections)


@pytest.fixture
def token_headers(db, in_process_requests, settings):
    """A user with money, a redeemed card and a node to launch on, and a token with every scope."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    cache.clear()
    make_catalog()
    make_node()
    # Made as createsuperuser and the admin make users, not by signup: it must still have an account.
    user = get_user_model().objects.create_user("fuzz", "fuzz@example.com", "a-long-pass-phrase-9")
    user.refresh_from_db()
    fund(user.account, 100_000_000)
    _batch, (code,) = card_batch_issue(hours_micros=6_000_000, count=1, valid_days=30)
    card_redeem(user=user, account=user.account, code=code)
    _token, raw = access_token_create(user=user, name="fuzz", scopes=["read", "sessions", "cards", "billing"])
    return {"Authorization": f"Bearer {raw}"}


@user_schema.parametrize()
@settings(max_examples=20, derandomize=True, deadline=3000, suppress_health_check=list(HealthCheck))
def test_api_answers_as_documented(case, token_headers):
    cache.clear()  # the fuzzer is not testing the throttles
    case.call_and_validate(headers=token_headers, checks=CHECKS)


CSRF = "c" * 32  # a CSRF secret: Django takes it unmasked in the X-CSRFToken header as in the cookie


def _browser(user) -> dict:
    """The cookies and header of a logged-in browser session, for the calls no token may make."""
    from django.test import Client

    client = Client()
    client.force_login(user)
    return {
        "cookies": {"sessionid": client.cookies["sessionid"].value, "csrftoken": CSRF},
        "headers": {"X-CSRFToken": CSRF},
    }


def _documented(method: str, path: str, session: dict, *, expect: int, **case) -> dict | None:
    if "body" in case:
        case["media_type"] = "application/json"
    answer = user_schema[path][method].Case(cookies=session["cookies"], headers=session["headers"], **case)
    response = answer.call_and_validate(checks=CHECKS)
    assert response.status_code == expect, response.content[:500]
    return response.json() if response.content else None


def test_answers_with_real_data_match_the_schema(db, in_process_requests, settings):
    """The fuzzer rarely names a real team, card or batch, so the new endpoints' 2xx answers are also
    checked here, with real objects, against the same schema and checks."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    cache.clear()
    make_catalog()
    owner, member, staff = make_user("owner"), make_user("member"), make_user("ops", staff=True)
    team = team_create(creator=owner, name="lab")
    Membership.objects.create(team=team, user=member, role=Membership.Role.MEMBER)
    team_invite_create(team=team, actor=owner)
    lead = _browser(owner)
    slug, user_id = {"slug": team.slug}, {"slug": team.slug, "user_id": member.pk}
    _documented("GET", "/api/v1/teams", lead, expect=200)
    assert _documented("GET", "/api/v1/teams/{slug}", lead, expect=200, path_parameters=slug)["invites"]
    assert _documented("GET", "/api/v1/teams/{slug}", _browser(member), expect=200, path_parameters=slug)[
        "members"
    ]
    cap = {"max_eighths": 2, "monthly_spend_cap_micros": None}
    path = "/api/v1/teams/{slug}/members/{user_id}"
    _documented("PUT", path + "/cap", lead, expect=200, path_parameters=user_id, body=cap)
    folder = {"read_only": True}
    assert _documented("PUT", path + "/folder", lead, expect=200, path_parameters=user_id, body=folder)[
        "folder_read_only"
    ]
    _documented("PUT", path, lead, expect=200, path_parameters=user_id, body={"role": "admin"})
    _documented("DELETE", path, lead, expect=204, path_parameters=user_id)

    _batch, (code,) = card_batch_issue(hours_micros=6_000_000, count=1, valid_days=30)
    card = card_redeem(user=owner, account=owner.account, code=code)
    split = {"path_parameters": {"card_id": card.id}, "body": {"parts": ["1.5", "1"]}}
    once = {**lead["headers"], "Idempotency-Key": "split-real-data"}
    first = _documented(
        "POST", "/api/v1/cards/{card_id}/split", {**lead, "headers": once}, expect=201, **split
    )
    again = _documented(
        "POST", "/api/v1/cards/{card_id}/split", {**lead, "headers": once}, expect=200, **split
    )
    assert [p["card"]["id"] for p in again["parts"]] == [p["card"]["id"] for p in first["parts"]]

    ops = _browser(staff)
    price = {"gpu_model": A100, "profile": "whole", "price_micros_per_hour": 4_000_000}
    _documented("POST", "/api/v1/admin/prices", ops, expect=201, body=price)
    _documented("GET", "/api/v1/admin/prices", ops, expect=200)
    batch = {"hours": "2", "count": 2, "valid_days": 7}
    issued = _documented("POST", "/api/v1/admin/card-batches", ops, expect=201, body=batch)
    _documented("GET", "/api/v1/admin/card-batches", ops, expect=200)
    batch_id = {"batch_id": issued["batch"]["id"]}
    _documented("GET", "/api/v1/admin/card-batches/{batch_id}", ops, expect=200, path_parameters=batch_id)


def test_a_sessions_notices_and_still_here_match_the_schema(db, in_process_requests, settings):
    """A running session with a live idle warning: the answers the lab extension reads, as documented."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    cache.clear()
    make_catalog()
    node, _token = make_node()
    owner = make_user("lab-owner")
    launched = session_launch(
        user=owner,
        account=owner.account,
        gpu_model=A100,
        profile="whole",
        environment=ENV,
        max_hours=None,
        idle_minutes=None,
        idempotency_key=None,
    )
    beat(node, [workload_status(launched.session, "running")])
    key, params, _text = message_columns(message("idle_warning", minutes=5))
    StopWarning.objects.create(
        session=launched.session,
        kind=StopWarning.Kind.IDLE,
        due_at=timezone.now() + timedelta(minutes=5),
        message_key=key,
        message_params=params,
    )
    lab = _browser(owner)
    sid = {"session_id": str(launched.session.id)}
    notices = _documented(
        "GET", "/api/v1/sessions/{session_id}/notices", lab, expect=200, path_parameters=sid
    )
    assert [w["kind"] for w in notices["warnings"]] == ["idle"]
    kept = _documented(
        "POST", "/api/v1/sessions/{session_id}/still-here", lab, expect=200, path_parameters=sid
    )
    assert kept["warnings"] == []


@pytest.mark.django_db
def test_the_served_schema_names_the_token_scheme_and_the_error_body():
    document = APIClient().get("/api/schema/?format=json").json()
    assert document["components"]["securitySchemes"]["tokenAuth"] == {
        "type": "http",
        "scheme": "bearer",
        "description": document["components"]["securitySchemes"]["tokenAuth"]["description"],
    }
    assert "Error" in document["components"]["schemas"]
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            assert "401" in operation["responses"], (method, path)


@pytest.mark.django_db
def test_the_schema_generates_without_a_warning_and_every_operation_id_is_unique():
    """drf-spectacular renames colliding operation ids with numeral suffixes and warns; a client
    generated from the schema would then have methods like ``v1_sessions_retrieve_2``."""
    from django.core.management import call_command

    call_command("spectacular", "--validate", "--fail-on-warn", "--file", "/dev/null")
    document = APIClient().get("/api/schema/?format=json").json()
    ids = [op["operationId"] for operations in document["paths"].values() for op in operations.values()]
    assert len(ids) == len(set(ids))
    assert {"cards_split", "sessions_list", "sessions_retrieve", "wallet_topup_create"} <= set(ids)
    assert {"teams_list", "teams_retrieve", "teams_member_cap_set", "admin_card_batches_create"} <= set(ids)
