"""Schemathesis against the served OpenAPI document (``/api/schema/``), in-process through Django's WSGI
app, authenticated with a personal access token that has every scope: no 5xx, every status code
documented, every answer shaped as the schema says. Bounded and derandomised: 20 examples per operation
and generation mode, so the run is the same on every machine and stays around two minutes on two cores.

The agents' heartbeat and the Stripe webhook have their own authentication and are left out of the
user-token run; ``test_hardening`` sends them garbage.
"""

from __future__ import annotations

import pytest
import schemathesis
from django.core.cache import cache
from django.core.signals import request_finished, request_started
from django.core.wsgi import get_wsgi_application
from django.db import close_old_connections
from hypothesis import HealthCheck, settings
from rest_framework.test import APIClient
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import response_schema_conformance, status_code_conformance

from billing.services.cards import card_batch_issue, card_redeem
from portal.services import access_token_create
from tests.provisioner.conftest import make_catalog, make_node, make_user

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
    user = make_user("fuzz")
    _batch, (code,) = card_batch_issue(hours_micros=6_000_000, count=1, valid_days=30)
    card_redeem(user=user, account=user.account, code=code)
    _token, raw = access_token_create(user=user, name="fuzz", scopes=["read", "sessions", "cards", "billing"])
    return {"Authorization": f"Bearer {raw}"}


@user_schema.parametrize()
@settings(max_examples=20, derandomize=True, deadline=3000, suppress_health_check=list(HealthCheck))
def test_api_answers_as_documented(case, token_headers):
    cache.clear()  # the fuzzer is not testing the throttles
    case.call_and_validate(headers=token_headers, checks=CHECKS)


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
