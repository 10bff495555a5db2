"""The notices JupyterLab shows inside a session (``GET …/notices``) and its "I'm still here" button
(``POST …/still-here``): only live warnings of a running session, in the reader's language, and only to
the session's owner; the button restarts the idle clock once, whatever the number of clicks."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from provisioner.messages import message, message_columns
from provisioner.models import Session, SessionEvent, StopWarning
from tests.provisioner.conftest import A100, ENV, beat, client_for, gpu, make_node, make_user, workload_status

pytestmark = pytest.mark.django_db


@pytest.fixture
def node(catalog):
    node, _token = make_node("node-n", [gpu(0, "GPU-n-0")], sharing_policy="best-effort")
    return node


def _running(node, client: APIClient) -> Session:
    body = {"gpu_model": A100, "profile": "whole", "environment": ENV}
    sid = client.post("/api/v1/sessions", body, format="json").json()["id"]
    beat(node, [workload_status(Session.objects.get(id=sid), "running")])
    session = Session.objects.get(id=sid)
    assert session.state == Session.State.RUNNING
    return session


def _warn(session: Session, kind: str = StopWarning.Kind.IDLE, *, in_seconds: int = 300, **fields):
    line = message("idle_warning", minutes=in_seconds // 60)
    if kind != StopWarning.Kind.IDLE:
        line = message("funds_exhausted")
    key, params, _text = message_columns(line)
    return StopWarning.objects.create(
        session=session,
        kind=kind,
        due_at=timezone.now() + timedelta(seconds=in_seconds),
        message_key=key,
        message_params=params,
        **fields,
    )


def _notices(client: APIClient, session: Session) -> dict:
    response = client.get(f"/api/v1/sessions/{session.id}/notices")
    assert response.status_code == 200, response.content
    return response.json()


# --- notices -----------------------------------------------------------------------------------------


def test_notices_list_the_live_warnings_of_a_running_session_soonest_first(node, sent_tasks):
    client = client_for(make_user())
    session = _running(node, client)
    assert _notices(client, session)["warnings"] == []
    _warn(session, StopWarning.Kind.IDLE, in_seconds=600)
    _warn(session, StopWarning.Kind.FUNDS, in_seconds=120)
    _warn(session, StopWarning.Kind.MAX_HOURS, in_seconds=60, cleared_at=timezone.now())  # gone

    body = _notices(client, session)
    assert [w["kind"] for w in body["warnings"]] == ["funds", "idle"]
    funds, idle = body["warnings"]
    assert idle["message"] == "No activity: this session stops in about 10 minutes unless used."
    assert 590 <= idle["seconds_left"] <= 600 and idle["still_here"] is True
    assert funds["still_here"] is False and funds["due_at"].endswith("Z")
    assert body["labels"] == {"still_here": "I'm still here", "stops_in": "Stops in {time}"}
    assert body["poll_seconds"] > 0


def test_a_session_that_no_longer_runs_has_no_notices(node, sent_tasks):
    client = client_for(make_user())
    session = _running(node, client)
    _warn(session)
    client.post(f"/api/v1/sessions/{session.id}/stop")
    assert Session.objects.get(id=session.id).state == Session.State.STOPPING
    assert _notices(client, session)["warnings"] == []


def test_notices_are_in_the_readers_language(node, sent_tasks):
    user = make_user()
    client = client_for(user)
    session = _running(node, client)
    _warn(session, in_seconds=300)
    user.language = "zh-hans"
    user.save(update_fields=["language"])
    browser = APIClient()  # the lab's requests carry the portal's session cookie
    browser.force_login(user)

    body = _notices(browser, session)
    assert body["warnings"][0]["message"] == "没有活动：如不使用，此会话将在约 5 分钟后停止。"
    assert body["labels"] == {"still_here": "我还在", "stops_in": "{time} 后停止"}


def test_another_users_session_has_no_notices_and_cannot_be_kept_alive(node, sent_tasks):
    session = _running(node, client_for(make_user()))
    warning = _warn(session)
    stranger = client_for(make_user())
    for response in (
        stranger.get(f"/api/v1/sessions/{session.id}/notices"),
        stranger.post(f"/api/v1/sessions/{session.id}/still-here"),
    ):
        assert response.status_code == 404, response.content
        assert response.json()["error"]["code"] == "not_found"
    warning.refresh_from_db()
    assert warning.cleared_at is None
    assert not SessionEvent.objects.filter(session=session, kind="kept_alive").exists()


def test_notices_hand_the_browser_a_csrf_cookie(node, sent_tasks):
    user = make_user()
    session = _running(node, client_for(user))
    browser = APIClient(enforce_csrf_checks=True)
    browser.force_login(user)
    response = browser.get(f"/api/v1/sessions/{session.id}/notices")
    assert response.status_code == 200 and response.cookies["csrftoken"].value


# --- still here --------------------------------------------------------------------------------------


def test_still_here_clears_the_idle_warning_and_restarts_the_clock_once(node, sent_tasks):
    client = client_for(make_user())
    session = _running(node, client)
    long_ago = timezone.now() - timedelta(hours=1)
    Session.objects.filter(id=session.id).update(last_active_at=long_ago)
    idle = _warn(session, StopWarning.Kind.IDLE)
    funds = _warn(session, StopWarning.Kind.FUNDS)
    before = timezone.now()

    response = client.post(f"/api/v1/sessions/{session.id}/still-here")
    assert response.status_code == 200, response.content
    assert [w["kind"] for w in response.json()["warnings"]] == ["funds"]  # money is not put off
    session.refresh_from_db()
    assert session.last_active_at >= before
    idle.refresh_from_db()
    funds.refresh_from_db()
    assert idle.cleared_at is not None and funds.cleared_at is None
    kept = SessionEvent.objects.get(session=session, kind="kept_alive")
    assert kept.message == "Kept alive by its owner" and kept.message_key == "kept_alive"
    history = client.get(f"/api/v1/sessions/{session.id}/events").json()
    assert history[-1]["message"] == "Kept alive by its owner"

    first_active = session.last_active_at
    again = client.post(f"/api/v1/sessions/{session.id}/still-here")
    assert again.status_code == 200
    session.refresh_from_db()
    assert session.last_active_at >= first_active
    assert SessionEvent.objects.filter(session=session, kind="kept_alive").count() == 1
    assert StopWarning.objects.filter(session=session, kind="idle").count() == 1


def test_still_here_on_a_session_that_is_not_running_is_a_409(node, sent_tasks):
    client = client_for(make_user())
    session = _running(node, client)
    idle = _warn(session)
    client.post(f"/api/v1/sessions/{session.id}/stop")

    response = client.post(f"/api/v1/sessions/{session.id}/still-here")
    assert response.status_code == 409, response.content
    error = response.json()["error"]
    assert error["code"] == "session_not_running" and error["message"] == "This session is not running."
    idle.refresh_from_db()
    assert idle.cleared_at is None
    assert not SessionEvent.objects.filter(session=session, kind="kept_alive").exists()


def test_still_here_from_a_browser_needs_the_csrf_token(node, sent_tasks):
    user = make_user()
    session = _running(node, client_for(user))
    idle = _warn(session)
    browser = APIClient(enforce_csrf_checks=True)
    browser.force_login(user)

    refused = browser.post(f"/api/v1/sessions/{session.id}/still-here")
    assert refused.status_code == 403
    idle.refresh_from_db()
    assert idle.cleared_at is None

    token = browser.get(f"/api/v1/sessions/{session.id}/notices").cookies["csrftoken"].value
    kept = browser.post(f"/api/v1/sessions/{session.id}/still-here", HTTP_X_CSRFTOKEN=token)
    assert kept.status_code == 200, kept.content
    idle.refresh_from_db()
    assert idle.cleared_at is not None
