"""The authorisation matrix: every ``/api/v1/`` endpoint, called by someone who must not reach the
object (another user, a team member on another member's session, a team owner on a member's notebook, a
non-member on a team's account or the team itself, a plain member on the team's roles and caps, a
non-staff user on the staff endpoints), answers 404 (403 for the staff endpoints and for a member whose
role may not), shows none of the owner's data, and changes nothing.

The endpoints come from the URL resolver and the OpenAPI document: one without a row in MATRIX fails
``test_every_api_endpoint_is_in_the_matrix``, so a new endpoint cannot be forgotten.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import stripe
from django.conf import settings as django_settings
from django.core.cache import cache
from django.urls import URLPattern, URLResolver, get_resolver
from drf_spectacular.generators import SchemaGenerator
from rest_framework.test import APIClient

from billing.models import (
    AuditEntry,
    Card,
    CardBatch,
    Entry,
    InviteCode,
    LedgerAccount,
    Price,
    TopUp,
    Transfer,
)
from billing.services.cards import card_batch_issue, card_redeem, card_split
from notices.models import Notice
from notices.services import notify
from portal.homes import home_storage
from portal.models import AccessToken, Membership, TeamInvite
from portal.services import access_token_create, team_create, team_invite_create
from provisioner.models import Node, Quota, Session
from provisioner.selectors import workload_user
from provisioner.services.sessions import session_launch
from tests.billing.conftest import fund
from tests.billing.test_topups import localstripe_url  # noqa: F401  (the fixture)
from tests.provisioner.conftest import A100, ENV, gpu, make_catalog, make_node, make_user

pytestmark = pytest.mark.django_db

ALL_SCOPES = ["read", "sessions", "cards", "billing", "files"]
HOUR = 1_000_000


# --- the endpoints ----------------------------------------------------------------------------------


def _routes(patterns, prefix: str = ""):
    for entry in patterns:
        if isinstance(entry, URLResolver):
            yield from _routes(entry.url_patterns, prefix + str(entry.pattern))
        elif isinstance(entry, URLPattern):
            yield prefix + str(entry.pattern), entry.callback


def _openapi_path(route: str) -> str:
    """``api/v1/cards/<int:card_id>`` → ``/api/v1/cards/{card_id}``, as the OpenAPI document spells it."""
    parts = []
    for part in route.split("/"):
        if part.startswith("<") and part.endswith(">"):
            part = "{" + part[1:-1].split(":")[-1] + "}"
        parts.append(part)
    return "/" + "/".join(parts)


def api_endpoints() -> set[tuple[str, str]]:
    """(METHOD, path) of every ``/api/v1/`` view the URL resolver routes to, and every operation the
    OpenAPI document lists under ``/api/v1/``."""
    found = set()
    for route, callback in _routes(get_resolver().url_patterns):
        if not route.startswith("api/v1/"):
            continue
        view_class = getattr(callback, "view_class", None) or getattr(callback, "cls", None)
        if view_class is None:  # a plain function view: it must still be in the matrix
            found.add(("ANY", _openapi_path(route)))
            continue
        for method in view_class.http_method_names:
            if method not in ("options", "head", "trace") and hasattr(view_class, method):
                found.add((method.upper(), _openapi_path(route)))
    schema = SchemaGenerator().get_schema(request=None, public=True)
    for path, operations in schema["paths"].items():
        if path.startswith("/api/v1/"):
            found |= {(method.upper(), path) for method in operations}
    return found


# --- the world: two tenants and a team --------------------------------------------------------------


@dataclass
class World:
    alice: object  # owns the objects; owner of the team "lab"
    bob: object  # a plain member of "lab"
    mallory: object  # another tenant, in no team
    staff: object
    team: object
    mallory_team: object  # mallory's own team, where she is the owner
    alice_session: Session
    bob_team_session: Session  # bob's, paid by the team's account
    alice_card: Card
    team_card: Card
    alice_token: AccessToken
    spare_code: str  # an unredeemed code, so a redemption onto another's account would succeed
    node: Node
    alice_upload: str = ""  # an upload into alice's shared home, half sent

    def secrets(self, who: str) -> list[str]:
        """Strings of alice's objects (and the team's, for a stranger to it) that must not appear in
        ``who``'s answer."""
        return [
            "alice",
            *(["skunkworks"] if who not in ("alice", "bob") else []),
            str(self.alice_session.id),
            *([str(self.bob_team_session.id)] if who != "bob" else []),
            self.alice_token.prefix,
            self.alice_token.name,
        ]


def _redeemed_card(user, account, hours: int) -> Card:
    _batch, (code,) = card_batch_issue(hours_micros=hours * HOUR, count=1, valid_days=30, max_parts=3)
    return card_redeem(user=user, account=account, code=code)


def _launch(user, account, profile: str = "1/2") -> Session:
    return session_launch(
        user=user,
        account=account,
        gpu_model=A100,
        profile=profile,
        environment=ENV,
        max_hours=None,
        idle_minutes=None,
        idempotency_key=None,
    ).session


@pytest.fixture
def world(db, settings, tmp_path) -> World:
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    settings.HOMES_BACKEND, settings.HOMES_SHARED_ROOT = "shared", str(tmp_path)
    cache.clear()
    make_catalog()
    node, _token = make_node("node-m", [gpu(0, "GPU-m-0"), gpu(1, "GPU-m-1")])
    alice, bob, mallory = make_user("alice"), make_user("bob"), make_user("mallory")
    staff = make_user("operator", staff=True)
    team = team_create(creator=alice, name="skunkworks")
    Membership.objects.create(team=team, user=bob, role=Membership.Role.MEMBER)
    fund(team.account, 50_000_000)
    team_invite_create(team=team, actor=alice)
    mallory_team = team_create(creator=mallory, name="mallorylab")
    _batch, (spare_code,) = card_batch_issue(hours_micros=2 * HOUR, count=1, valid_days=30)
    alice_token, _raw = access_token_create(user=alice, name="alice-ci", scopes=ALL_SCOPES)
    alice_session = _launch(alice, alice.account)
    notify(users=[alice], kind="session_placed", key="session_placed", params={"session": "alice's"},
           dedupe_key="alice-notice", url=f"/sessions/{alice_session.id}/")  # fmt: skip
    return World(
        alice=alice,
        bob=bob,
        mallory=mallory,
        staff=staff,
        team=team,
        mallory_team=mallory_team,
        alice_session=alice_session,
        bob_team_session=_launch(bob, team.account),
        alice_card=_redeemed_card(alice, alice.account, 6),
        team_card=_redeemed_card(alice, team.account, 6),
        alice_token=alice_token,
        spare_code=spare_code,
        node=node,
        alice_upload=_alice_files(alice),
    )


def _alice_files(alice) -> str:
    """notes.txt in alice's home, and an upload half sent; the upload's id."""
    storage = home_storage()
    folder = workload_user(alice)
    notes = storage.upload_create(owner_id=alice.pk, folder=folder, path="notes.txt", size_bytes=5)
    storage.upload_append(owner_id=alice.pk, upload_id=notes.id, offset_bytes=0, length_bytes=5,
                          body=io.BytesIO(b"alice"))  # fmt: skip
    half = storage.upload_create(owner_id=alice.pk, folder=folder, path="thesis.pdf", size_bytes=4)
    storage.upload_append(owner_id=alice.pk, upload_id=half.id, offset_bytes=0, length_bytes=2,
                          body=io.BytesIO(b"ab"))  # fmt: skip
    return half.id


def state_of_the_world() -> dict:
    """Everything an intruder's call must leave as it was."""
    return {
        "sessions": sorted(Session.objects.values_list("id", "state", "owner_id", "account_id")),
        "cards": sorted(Card.objects.values_list("id", "state", "owner_id", "parent_id")),
        "codes": sorted(InviteCode.objects.values_list("id", "card__state")),
        "balances": sorted(LedgerAccount.objects.values_list("id", "balance_micros")),
        "transfers": Transfer.objects.count(),
        "entries": Entry.objects.count(),
        "topups": TopUp.objects.count(),
        "tokens": sorted(AccessToken.objects.values_list("id", "revoked_at")),
        "nodes": sorted(Node.objects.values_list("id", "state")),
        "quotas": sorted(Quota.objects.values_list("id", "updated_at")),
        "memberships": sorted(Membership.objects.values_list("id", "team_id", "user_id", "role")),
        "invites": sorted(TeamInvite.objects.values_list("id", "uses", "revoked_at")),
        "audit": AuditEntry.objects.count(),
        "prices": Price.objects.count(),
        "batches": CardBatch.objects.count(),
        "notices": sorted(Notice.objects.values_list("id", "read_at", "dismissed_at")),
        "files": sorted(
            (os.path.join(folder, name), os.lstat(os.path.join(folder, name)).st_size)
            for folder, _dirs, names in os.walk(django_settings.HOMES_SHARED_ROOT or "/nonexistent")
            for name in names
        ),
    }


# --- the matrix -------------------------------------------------------------------------------------


@dataclass
class Probe:
    """One intruder's call. ``expect``: the status; ``who``: the World attribute of the caller."""

    method: str
    url: Callable[[World], str]
    body: Callable[[World], dict] | None = None
    expect: int = 404
    who: str = "mallory"
    # tokens may not manage tokens (403 with any token), whoever owns the object
    expect_with_token: int | None = None


def own(w: World) -> int:
    return w.alice.account_id


def team(w: World) -> int:
    return w.team.account_id


def _stranger_probes(method: str, url, body=None, expect_with_token=None) -> list[Probe]:
    return [Probe(method, url, body, expect_with_token=expect_with_token)]


def _account_probes(method: str, path: str, body=None) -> list[Probe]:
    """Another tenant naming alice's account or the team's (not theirs) in ``?account=``."""
    return [
        Probe(method, lambda w: f"{path}?account={own(w)}", body),
        Probe(method, lambda w: f"{path}?account={team(w)}", body),
    ]


def _card_probes(method: str, suffix: str, body=None) -> list[Probe]:
    return [
        Probe(method, lambda w: f"/api/v1/cards/{w.alice_card.id}{suffix}", body),
        Probe(method, lambda w: f"/api/v1/cards/{w.alice_card.id}{suffix}?account={own(w)}", body),
        Probe(method, lambda w: f"/api/v1/cards/{w.team_card.id}{suffix}?account={team(w)}", body),
        # a member of the team asks for the team's card on their own account: it is not there
        Probe(method, lambda w: f"/api/v1/cards/{w.team_card.id}{suffix}", body, who="bob"),
    ]


def _session_probes(method: str, suffix: str, body=None) -> list[Probe]:
    return [
        Probe(method, lambda w: f"/api/v1/sessions/{w.alice_session.id}{suffix}", body),
        # the team's owner does not see a member's notebook, though the team pays for it
        Probe(method, lambda w: f"/api/v1/sessions/{w.bob_team_session.id}{suffix}", body, who="alice"),
        # nor does a fellow member see the owner's
        Probe(method, lambda w: f"/api/v1/sessions/{w.alice_session.id}{suffix}", body, who="bob"),
    ]


def _team_probes(method: str, suffix: Callable[[World], str], body=None) -> list[Probe]:
    """A stranger to the team, and staff (who are not in it), get 404 on the team and its members. With
    a token a write is refused before that (403): team changes take a browser session."""
    token = 403 if method != "GET" else None
    return [
        Probe(method, lambda w: f"/api/v1/teams/{w.team.slug}{suffix(w)}", body, expect_with_token=token),
        Probe(
            method,
            lambda w: f"/api/v1/teams/{w.team.slug}{suffix(w)}",
            body,
            who="staff",
            expect_with_token=token,
        ),
    ]


def _member_probes(method: str, suffix: str, body=None) -> list[Probe]:
    """Team writes on alice's team: a plain member may not (403), a stranger finds no team (404), and
    the owner of another team finds no such member in hers (404)."""
    return [
        *_team_probes(method, lambda w: f"/members/{w.alice.pk}{suffix}", body),
        Probe(
            method,
            lambda w: f"/api/v1/teams/{w.team.slug}/members/{w.alice.pk}{suffix}",
            body,
            expect=403,
            who="bob",
            expect_with_token=403,
        ),
        Probe(
            method,
            lambda w: f"/api/v1/teams/{w.team.slug}/members/{w.bob.pk}{suffix}",
            body,
            expect=403,
            who="bob",
            expect_with_token=403,
        ),
        Probe(
            method,
            lambda w: f"/api/v1/teams/{w.mallory_team.slug}/members/{w.bob.pk}{suffix}",
            body,
            expect_with_token=403,
        ),
    ]


def _staff_probes(method: str, url, body=None) -> list[Probe]:
    return [Probe(method, url, body, expect=403), Probe(method, url, body, expect=403, who="bob")]


LAUNCH = {"gpu_model": A100, "profile": "1/8", "environment": ENV}
QUOTA = {"limits": {"max_sessions": 99}, "reason": "intruder"}
CAP = {"max_eighths": 1, "monthly_spend_cap_micros": 1_000_000}
PRICE = {"gpu_model": A100, "profile": "whole", "price_micros_per_hour": 5_000_000, "reason": "new quarter"}
BATCH = {"hours": "2.5", "count": 3, "valid_days": 30, "label": "course"}

# Listing endpoints answer the caller's own objects (status 200): the check is that none of alice's
# data is in them. Everything else names an object the caller may not reach.
MATRIX: dict[tuple[str, str], list[Probe]] = {
    ("GET", "/api/v1/me"): [Probe("GET", lambda w: "/api/v1/me", expect=200)],
    ("GET", "/api/v1/tokens"): [Probe("GET", lambda w: "/api/v1/tokens", expect=200, expect_with_token=403)],
    ("POST", "/api/v1/tokens"): [
        Probe(
            "POST",
            lambda w: "/api/v1/tokens",
            lambda w: {"name": "mine", "scopes": ["read"]},
            expect=201,
            expect_with_token=403,
        )
    ],
    ("DELETE", "/api/v1/tokens/{token_id}"): _stranger_probes(
        "DELETE", lambda w: f"/api/v1/tokens/{w.alice_token.id}", expect_with_token=403
    ),
    ("GET", "/api/v1/wallet"): _account_probes("GET", "/api/v1/wallet")
    + [Probe("GET", lambda w: "/api/v1/wallet", expect=200)],
    ("GET", "/api/v1/ledger"): _account_probes("GET", "/api/v1/ledger")
    + [Probe("GET", lambda w: "/api/v1/ledger", expect=200)],
    ("POST", "/api/v1/wallet/topups"): _account_probes(
        "POST", "/api/v1/wallet/topups", lambda w: {"amount_micros": 5_000_000}
    ),
    ("GET", "/api/v1/cards"): _account_probes("GET", "/api/v1/cards")
    + [Probe("GET", lambda w: "/api/v1/cards", expect=200)],
    ("POST", "/api/v1/cards/redeem"): _account_probes(
        "POST", "/api/v1/cards/redeem", lambda w: {"code": w.spare_code}
    ),
    ("GET", "/api/v1/cards/{card_id}"): _card_probes("GET", ""),
    ("POST", "/api/v1/cards/{card_id}/split"): _card_probes(
        "POST", "/split", lambda w: {"parts": ["1", "1"]}
    ),
    ("POST", "/api/v1/cards/{card_id}/gift"): _card_probes("POST", "/gift"),
    ("POST", "/api/v1/cards/{card_id}/revoke"): _card_probes("POST", "/revoke"),
    ("GET", "/api/v1/catalog"): [Probe("GET", lambda w: "/api/v1/catalog", expect=200)],
    ("GET", "/api/v1/quota"): [Probe("GET", lambda w: "/api/v1/quota", expect=200)],
    ("GET", "/api/v1/sessions"): [
        Probe("GET", lambda w: "/api/v1/sessions", expect=200),
        Probe("GET", lambda w: "/api/v1/sessions", expect=200, who="bob"),
    ],
    ("POST", "/api/v1/sessions"): [
        Probe("POST", lambda w: "/api/v1/sessions", lambda w: {**LAUNCH, "account": own(w)}),
        Probe("POST", lambda w: "/api/v1/sessions", lambda w: {**LAUNCH, "account": team(w)}),
    ],
    ("GET", "/api/v1/sessions/{session_id}"): _session_probes("GET", ""),
    ("GET", "/api/v1/sessions/{session_id}/events"): _session_probes("GET", "/events"),
    ("GET", "/api/v1/sessions/{session_id}/metrics"): _session_probes("GET", "/metrics"),
    ("POST", "/api/v1/sessions/{session_id}/stop"): _session_probes(
        "POST", "/stop", lambda w: {"reason": "x"}
    ),
    ("GET", "/api/v1/sessions/{session_id}/notices"): _session_probes("GET", "/notices"),
    ("POST", "/api/v1/sessions/{session_id}/still-here"): _session_probes("POST", "/still-here"),
    ("GET", "/api/v1/teams"): [
        Probe("GET", lambda w: "/api/v1/teams", expect=200),
        Probe("GET", lambda w: "/api/v1/teams", expect=200, who="staff"),
    ],
    ("POST", "/api/v1/teams"): [  # anyone may create a team: a bad one is refused and makes nothing
        Probe("POST", lambda w: "/api/v1/teams", lambda w: {"name": "   "}, expect=400, expect_with_token=403)
    ],
    ("POST", "/api/v1/teams/join"): [
        Probe("POST", lambda w: "/api/v1/teams/join", lambda w: {"code": "NOT-A-CODE"}, expect_with_token=403)
    ],
    ("GET", "/api/v1/teams/{slug}"): _team_probes("GET", lambda w: ""),
    ("POST", "/api/v1/teams/{slug}/leave"): _team_probes("POST", lambda w: "/leave"),
    ("POST", "/api/v1/teams/{slug}/invites"): [
        *_team_probes("POST", lambda w: "/invites", lambda w: {}),
        Probe(
            "POST",
            lambda w: f"/api/v1/teams/{w.team.slug}/invites",
            lambda w: {},
            expect=403,
            who="bob",
            expect_with_token=403,
        ),
    ],
    ("DELETE", "/api/v1/teams/{slug}/invites/{invite_id}"): [
        *_team_probes("DELETE", lambda w: f"/invites/{TeamInvite.objects.get(team=w.team).id}"),
        Probe(
            "DELETE",
            lambda w: f"/api/v1/teams/{w.team.slug}/invites/{TeamInvite.objects.get(team=w.team).id}",
            expect=403,
            who="bob",
            expect_with_token=403,
        ),
    ],
    ("PUT", "/api/v1/teams/{slug}/members/{user_id}"): _member_probes(
        "PUT", "", lambda w: {"role": Membership.Role.OWNER}
    ),
    ("DELETE", "/api/v1/teams/{slug}/members/{user_id}"): _member_probes("DELETE", ""),
    ("PUT", "/api/v1/teams/{slug}/members/{user_id}/cap"): _member_probes("PUT", "/cap", lambda w: CAP),
    ("PUT", "/api/v1/teams/{slug}/members/{user_id}/folder"): _member_probes(
        "PUT", "/folder", lambda w: {"read_only": False}
    ),
    ("GET", "/api/v1/notices/"): [Probe("GET", lambda w: "/api/v1/notices/", expect=200)],
    ("POST", "/api/v1/notices/read-all"): [Probe("POST", lambda w: "/api/v1/notices/read-all", expect=200)],
    ("POST", "/api/v1/notices/{notice_id}/read"): [
        Probe("POST", lambda w: f"/api/v1/notices/{Notice.objects.get(user=w.alice).id}/read"),
        Probe("POST", lambda w: f"/api/v1/notices/{Notice.objects.get(user=w.alice).id}/read", who="bob"),
    ],
    ("POST", "/api/v1/notices/{notice_id}/dismiss"): [
        Probe("POST", lambda w: f"/api/v1/notices/{Notice.objects.get(user=w.alice).id}/dismiss"),
    ],
    ("GET", "/api/v1/admin/nodes"): _staff_probes("GET", lambda w: "/api/v1/admin/nodes"),
    ("POST", "/api/v1/admin/nodes"): _staff_probes(
        "POST", lambda w: "/api/v1/admin/nodes", lambda w: {"name": "rogue", "address": "http://10.0.0.9:1"}
    ),
    ("POST", "/api/v1/admin/nodes/{node_id}/{action}"): _staff_probes(
        "POST", lambda w: f"/api/v1/admin/nodes/{w.node.id}/drain", lambda w: {"reason": "x"}
    ),
    ("GET", "/api/v1/admin/prices"): _staff_probes("GET", lambda w: "/api/v1/admin/prices"),
    ("POST", "/api/v1/admin/prices"): _staff_probes(
        "POST", lambda w: "/api/v1/admin/prices", lambda w: {**PRICE, "price_micros_per_hour": 1}
    ),
    ("GET", "/api/v1/admin/card-batches"): _staff_probes("GET", lambda w: "/api/v1/admin/card-batches"),
    ("POST", "/api/v1/admin/card-batches"): _staff_probes(
        "POST", lambda w: "/api/v1/admin/card-batches", lambda w: BATCH
    ),
    ("GET", "/api/v1/admin/card-batches/{batch_id}"): _staff_probes(
        "GET", lambda w: f"/api/v1/admin/card-batches/{CardBatch.objects.order_by('id').first().id}"
    ),
    # files: always the caller's own home; another's upload is not there, nor is a path out of the home
    ("GET", "/api/v1/files"): [
        Probe("GET", lambda w: "/api/v1/files", expect=200),
        Probe("GET", lambda w: "/api/v1/files?path=..", expect=400),
    ],
    ("GET", "/api/v1/files/download"): [
        Probe("GET", lambda w: "/api/v1/files/download?path=notes.txt"),
        Probe("GET", lambda w: "/api/v1/files/download?path=../notes.txt", expect=400),
    ],
    ("DELETE", "/api/v1/files"): [
        Probe("DELETE", lambda w: "/api/v1/files?path=notes.txt"),  # the caller's own home has none
        Probe("DELETE", lambda w: "/api/v1/files?path=../notes.txt", expect=400),
        Probe("DELETE", lambda w: "/api/v1/files?path=..", expect=400),  # the root of every home
    ],
    ("POST", "/api/v1/files/uploads"): [
        Probe("POST", lambda w: "/api/v1/files/uploads", lambda w: {"path": "../x", "size": 1}, expect=400),
    ],
    ("GET", "/api/v1/files/uploads/{upload_id}"): [
        Probe("GET", lambda w: f"/api/v1/files/uploads/{w.alice_upload}"),
    ],
    ("PATCH", "/api/v1/files/uploads/{upload_id}"): [
        Probe("PATCH", lambda w: f"/api/v1/files/uploads/{w.alice_upload}"),
    ],
    ("GET", "/api/v1/admin/quotas"): _staff_probes("GET", lambda w: "/api/v1/admin/quotas"),
    ("PUT", "/api/v1/admin/quotas"): _staff_probes(
        "PUT", lambda w: "/api/v1/admin/quotas", lambda w: {**QUOTA, "user": w.mallory.pk}
    ),
}

PROBES = [
    pytest.param(endpoint, index, id=f"{endpoint[0]} {endpoint[1]} #{index}")
    for endpoint, probes in MATRIX.items()
    for index in range(len(probes))
]


def test_every_api_endpoint_is_in_the_matrix():
    endpoints = api_endpoints()
    missing = sorted(endpoints - set(MATRIX))
    assert not missing, f"endpoints without a row in the authorisation matrix: {missing}"
    stale = sorted(set(MATRIX) - endpoints)
    assert not stale, f"matrix rows for endpoints that no longer exist: {stale}"


def _client(world: World, who: str, auth: str) -> APIClient:
    user = getattr(world, who)
    client = APIClient()
    if auth == "token":
        _token, raw = access_token_create(user=user, name=f"{who}-probe", scopes=ALL_SCOPES)
        client.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
    else:
        client.force_login(user)
    return client


def _call(client: APIClient, probe: Probe, world: World):
    body = probe.body(world) if probe.body else None
    method = getattr(client, probe.method.lower())
    return method(probe.url(world), body, format="json") if body is not None else method(probe.url(world))


@pytest.mark.parametrize("auth", ["session", "token"])
@pytest.mark.parametrize(("endpoint", "index"), PROBES)
def test_another_tenant_gets_nothing_and_changes_nothing(world, endpoint, index, auth):
    probe = MATRIX[endpoint][index]
    client = _client(world, probe.who, auth)
    before = state_of_the_world()
    response = _call(client, probe, world)
    expected = probe.expect_with_token if auth == "token" and probe.expect_with_token else probe.expect
    assert response.status_code == expected, response.content[:500]
    text = response.content.decode()
    for secret in world.secrets(probe.who):
        assert secret not in text, f"{secret!r} leaked to {probe.who}"
    if expected >= 400:
        error = json.loads(text)["error"]
        assert set(error) == {"code", "message", "fields"}
    after = state_of_the_world()
    if expected < 300 and probe.method != "GET":  # the caller's own object was made: only that changed
        after["tokens"] = [t for t in after["tokens"] if t[0] in {t0 for t0, _ in before["tokens"]}]
        after["audit"] = before["audit"]
    assert after == before


@pytest.mark.parametrize("auth", ["session", "token"])
def test_a_team_member_may_pay_with_the_team_account(world, auth):
    """The positive half of the role rows: a plain member launches on the team's account."""
    client = _client(world, "bob", auth)
    sessions = Session.objects.count()
    response = client.post("/api/v1/sessions", {**LAUNCH, "account": team(world)}, format="json")
    assert response.status_code == 201, response.content
    assert Session.objects.count() == sessions + 1
    assert response.json()["account"]["id"] == world.team.account_id
    wallet = client.get(f"/api/v1/wallet?account={team(world)}")
    assert wallet.status_code == 200 and wallet.json()["account"]["id"] == world.team.account_id


def test_staff_reach_the_staff_endpoints(world):
    client = _client(world, "staff", "session")
    assert client.get("/api/v1/admin/nodes").status_code == 200
    assert client.get("/api/v1/admin/quotas").status_code == 200
    response = client.put("/api/v1/admin/quotas", {**QUOTA, "user": world.mallory.pk}, format="json")
    assert response.status_code == 200, response.content


def test_staff_publish_prices_and_issue_card_batches_audited(world):
    client = _client(world, "staff", "session")
    price = client.post("/api/v1/admin/prices", PRICE, format="json")
    assert price.status_code == 201, price.content
    assert price.json()["created_by"] == world.staff.username
    assert client.get("/api/v1/admin/prices").json()[0]["id"] == price.json()["id"]
    issued = client.post("/api/v1/admin/card-batches", BATCH, format="json")
    assert issued.status_code == 201, issued.content
    body = issued.json()
    assert len(body["codes"]) == 3 and body["batch"]["cards"] == 3 and body["batch"]["redeemed"] == 0
    assert body["batch"]["hours_micros"] == 2_500_000
    batch = client.get(f"/api/v1/admin/card-batches/{body['batch']['id']}").json()
    assert batch == body["batch"]
    assert AuditEntry.objects.filter(action="cards.batch_issue", actor=world.staff).exists()
    assert AuditEntry.objects.filter(actor=world.staff, action__startswith="price").exists()


@pytest.mark.parametrize(
    ("url", "body"),
    [
        ("/api/v1/admin/prices", {**PRICE, "price_micros_per_hour": -1}),
        ("/api/v1/admin/prices", {**PRICE, "profile": "1/3"}),
        ("/api/v1/admin/prices", {**PRICE, "gpu_model": "x" * 65}),
        ("/api/v1/admin/card-batches", {**BATCH, "count": 0}),
        ("/api/v1/admin/card-batches", {**BATCH, "count": 10_001}),
        ("/api/v1/admin/card-batches", {**BATCH, "hours": "-1"}),
        ("/api/v1/admin/card-batches", {key: v for key, v in BATCH.items() if key != "valid_days"}),
    ],
)
def test_bad_staff_input_is_a_400_and_writes_nothing(world, url, body):
    client = _client(world, "staff", "session")
    before = (Price.objects.count(), CardBatch.objects.count(), AuditEntry.objects.count())
    response = client.post(url, body, format="json")
    assert response.status_code == 400, response.content
    assert set(response.json()["error"]) == {"code", "message", "fields"}
    assert (Price.objects.count(), CardBatch.objects.count(), AuditEntry.objects.count()) == before
    assert client.get("/api/v1/admin/card-batches/999999").status_code == 404


def test_a_staff_users_read_token_cannot_change_staff_state(world):
    """A token of a staff user is still only as strong as its scopes: no token scope covers the staff
    writes, so a leaked token never enrols a node or changes a quota."""
    _token, raw = access_token_create(user=world.staff, name="ops", scopes=ALL_SCOPES)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
    before = state_of_the_world()
    assert client.get("/api/v1/admin/nodes").status_code == 200
    response = client.put("/api/v1/admin/quotas", {**QUOTA, "user": world.mallory.pk}, format="json")
    assert response.status_code == 403, response.content
    response = client.post(f"/api/v1/admin/nodes/{world.node.id}/drain", {"reason": "x"}, format="json")
    assert response.status_code == 403, response.content
    assert state_of_the_world() == before


# --- team roles × card and money actions -----------------------------------------------------------
#
# On the team's account (``?account=`` the team's): an owner and an admin split, gift and revoke its
# cards, top it up and cap members; a plain member sees it, redeems onto it and spends from it within
# their caps, and every other move is a 403 ``team_role_required`` that changes nothing; a stranger finds
# no such account (404). Each allowed move leaves an audit row naming its actor. The rules: docs/TEAMS.md.

ROLES = ("owner", "admin", "member", "stranger")
CALLER = {"owner": "alice", "admin": "carol", "member": "bob", "stranger": "mallory"}


@dataclass(frozen=True)
class MoneyAction:
    method: str
    url: Callable[[World, Card], str]
    body: Callable[[World], dict] | None
    allowed: tuple[str, ...]  # the roles that may
    status: int  # the status of an allowed call
    audit: str | None  # the audit action an allowed call writes


def _team_cards(path: str) -> Callable[[World, Card], str]:
    return lambda w, part: f"/api/v1/cards/{w.team_card.id}{path}?account={team(w)}"


MANAGERS = ("owner", "admin")
MEMBERS = ("owner", "admin", "member")
MONEY_ACTIONS: dict[str, MoneyAction] = {
    "split": MoneyAction(
        "POST", _team_cards("/split"), lambda w: {"parts": ["1"]}, MANAGERS, 201, "cards.split"
    ),
    "gift": MoneyAction("POST", _team_cards("/gift"), None, MANAGERS, 201, "cards.gift"),
    "revoke": MoneyAction(
        "POST",
        lambda w, part: f"/api/v1/cards/{part.id}/revoke?account={team(w)}",
        None,
        MANAGERS,
        200,
        "cards.revoke",
    ),
    "topup": MoneyAction(
        "POST",
        lambda w, part: f"/api/v1/wallet/topups?account={team(w)}",
        lambda w: {"amount_micros": 5_000_000},
        MANAGERS,
        201,
        "wallet.topup_create",
    ),
    "cap": MoneyAction(
        "PUT",
        lambda w, part: f"/api/v1/teams/{w.team.slug}/members/{w.bob.pk}/cap",
        lambda w: CAP,
        MANAGERS,
        200,
        "quota.set",
    ),
    "redeem": MoneyAction(
        "POST",
        lambda w, part: f"/api/v1/cards/redeem?account={team(w)}",
        lambda w: {"code": w.spare_code},
        MEMBERS,
        201,
        "cards.redeem",
    ),
    "launch": MoneyAction(
        "POST",
        lambda w, part: "/api/v1/sessions",
        lambda w: {**LAUNCH, "account": team(w)},
        MEMBERS,
        201,
        None,
    ),
    "wallet": MoneyAction(
        "GET", lambda w, part: f"/api/v1/wallet?account={team(w)}", None, MEMBERS, 200, None
    ),
}


@pytest.fixture
def team_world(world, localstripe_url, settings):  # noqa: F811  (the imported fixture)
    """The world, with carol as an admin of alice's team, a part of the team's card not yet redeemed
    (for revoke) and Stripe answering (the local fake) for top-ups."""
    settings.STRIPE_SECRET_KEY = "sk_test_x"
    settings.STRIPE_API_BASE = localstripe_url
    world.carol = make_user("carol")
    Membership.objects.create(team=world.team, user=world.carol, role=Membership.Role.ADMIN)
    ((part, _code),) = card_split(
        card_id=world.team_card.id, account=world.team.account, parts=[HOUR], actor=world.alice
    )
    yield world, part
    stripe.api_base = "https://api.stripe.com"


@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("action", list(MONEY_ACTIONS))
def test_team_money_follows_team_roles(team_world, action, role):
    world, part = team_world
    rule = MONEY_ACTIONS[action]
    caller = getattr(world, CALLER[role])
    client = _client(world, CALLER[role], "session")
    before = state_of_the_world()
    audits = AuditEntry.objects.count()
    body = rule.body(world) if rule.body else None
    method = getattr(client, rule.method.lower())
    url = rule.url(world, part)
    response = method(url, body, format="json") if body is not None else method(url)

    if role in rule.allowed:
        assert response.status_code == rule.status, response.content[:500]
        if rule.audit:
            entry = AuditEntry.objects.order_by("-id").first()
            assert AuditEntry.objects.count() > audits
            assert (entry.action, entry.actor_id) == (rule.audit, caller.pk), (entry.action, entry.actor_id)
        return
    expected = 404 if role == "stranger" else 403
    assert response.status_code == expected, response.content[:500]
    error = response.json()["error"]
    assert set(error) == {"code", "message", "fields"} and error["message"]
    if expected == 403:
        assert error["code"] == "team_role_required", error
    assert state_of_the_world() == before


def test_a_team_role_refusal_is_translated(team_world):
    world, _part = team_world
    world.bob.language = "zh-hans"
    world.bob.save(update_fields=["language"])
    client = _client(world, "bob", "session")
    response = client.post(f"/api/v1/cards/{world.team_card.id}/gift?account={team(world)}")
    assert response.status_code == 403
    message = response.json()["error"]["message"]
    assert "只有团队" in message, message
