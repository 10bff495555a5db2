"""Session lines are stored as a message key and its parameters, and rendered in the reader's language."""

from __future__ import annotations

import importlib
import re

import pytest
from django.apps import apps
from django.utils import translation

from provisioner.messages import TEMPLATES, message, message_columns, message_load, message_render
from provisioner.models import Session, SessionEvent
from provisioner.services.sessions import session_launch, session_stop
from tests.provisioner.conftest import A100, ENV, make_node, make_user

from_english = importlib.import_module("provisioner.migrations.0005_messages_from_english")

VALUES = {"user": "alice", "node": "node-a", "gpu_model": "A100-SXM4-80GB", "profile": "1/4", "why": "oops",
          "actor": "bob", "minutes": 15, "seconds": 300, "code": "409", "time": "12:00:01", "percent": 80,
          "spent": "¥12.00", "card_hours": "3.50", "count": 2, "session": "1a2b3c4d", "date": "2027-06-01",
          "days": 180, "environment": "torch-2.5", "team": "vision-lab", "used": "9.8 GB", "limit": "10.0 GB",
          "files": "1,200", "max_files": "5,000"}  # fmt: skip


def _filled(key: str):
    return message(key, **{name: VALUES[name] for name in re.findall(r"%\((\w+)\)s", TEMPLATES[key])})


def _zh(key: str, params: dict, stored: str = "") -> str:
    with translation.override("zh-hans"):
        return message_render(key, params, stored=stored)


@pytest.mark.parametrize("key", sorted(TEMPLATES))
def test_every_message_renders_as_its_english_text_and_in_chinese(key):
    stored_key, params, english = message_columns(_filled(key))
    with translation.override("en"):
        assert message_render(stored_key, params, stored=english) == english
    shown = _zh(stored_key, params, english)
    assert shown != english, f"no Chinese for {key!r}"
    for name in params:
        assert str(VALUES[name]) in shown


@pytest.fixture
def session(catalog, sent_tasks):
    make_node("node-a")
    user = make_user("alice")
    return session_launch(
        user=user,
        account=user.account,
        gpu_model=A100,
        profile="whole",
        environment=ENV,
        max_hours=1,
        idle_minutes=30,
        idempotency_key=None,
    ).session


def test_a_stored_event_renders_in_english_and_in_chinese(session):
    placed = SessionEvent.objects.get(session=session, to_state="placing")
    assert (placed.message_key, placed.message_params) == ("placed_on", {"node": "node-a"})
    assert placed.message == "Placed on node-a"  # the English text, for the admin and the API
    with translation.override("en"):
        assert placed.message_display == "Placed on node-a"
    with translation.override("zh-hans"):
        assert placed.message_display == "已分配到 node-a"
        assert SessionEvent.objects.get(session=session, kind="launch").message_display == "由 alice 启动"


def test_a_stop_reason_inside_a_stop_line_is_stored_nested_and_translated(session):
    session_stop(session=session, actor=make_user("bob"), reason=message("funds_exhausted"))
    stopped = Session.objects.get(id=session.id)
    assert stopped.reason == "Stop by bob: funds exhausted"
    assert stopped.reason_key == "stop_by"
    assert stopped.reason_params == {"actor": "bob", "why": {"key": "funds_exhausted", "params": {}}}
    with translation.override("zh-hans"):
        shown = Session.objects.get(id=session.id).reason_display
        assert "bob" in shown and translation.gettext("funds exhausted") in shown
        assert "funds exhausted" not in shown and "Stop by" not in shown


def test_names_are_shown_as_given_even_when_they_read_like_a_message():
    # A node and a user that happen to be named like lines this portal writes: names are not translated.
    with translation.override("zh-hans"):
        stopped = translation.gettext("Stopped")
    placed = message("placed_on", node="Stopped")
    assert "Stopped" in _zh(*message_columns(placed)) and stopped not in _zh(*message_columns(placed))
    by = message("stop_by", actor="funds exhausted", why=message("funds_exhausted"))
    shown = _zh(*message_columns(by))
    assert shown.count("funds exhausted") == 1  # the user's name, and the reason translated


def test_an_agents_own_words_are_shown_as_they_are(session):
    exited = message("jupyter_exited", why="exit code 1: CUDA error: out of memory")
    assert "exit code 1: CUDA error: out of memory" in _zh(*message_columns(exited))
    session_stop(session=session, actor=None, reason="done for today")  # an owner's own reason
    session.refresh_from_db()
    assert session.reason_params == {"why": "done for today"}
    with translation.override("zh-hans"):
        assert "done for today" in session.reason_display and "Stop" not in session.reason_display


def test_free_text_and_unknown_keys_are_shown_as_stored():
    assert message_columns("the agent said something new") == ("", {}, "the agent said something new")
    assert _zh("", {}, "the agent said something new") == "the agent said something new"
    assert _zh("a_key_from_a_later_release", {"x": 1}, "as written") == "as written"
    assert _zh("stop", {"why": {"key": "no_such_reason", "params": {}}}, "Stop: later") == "Stop: later"
    assert _zh("placed_on", {}, "Placed on n") == "Placed on n"  # parameters that no longer fit
    assert _zh("", {}, "") == ""


def test_a_writer_that_names_no_such_message_or_the_wrong_parameters_fails_at_once():
    with pytest.raises(ValueError, match="unknown message key"):
        message("stoped")
    with pytest.raises(ValueError, match="takes"):
        message("stop_by", actor="bob")


def test_the_migration_parses_an_old_english_line_into_key_and_parameters():
    assert from_english.line_parse("Stop by bob: funds exhausted") == (
        "stop_by",
        {"actor": "bob", "why": {"key": "funds_exhausted", "params": {}}},
    )
    assert from_english.line_parse("Stop: idle for 30 minutes") == (
        "stop",
        {"why": {"key": "idle_for", "params": {"minutes": 30}}},
    )
    assert from_english.line_parse("Jupyter exited: exit code 1") == (
        "jupyter_exited",
        {"why": "exit code 1"},
    )
    assert from_english.line_parse("Placed on Stopped") == ("placed_on", {"node": "Stopped"})  # a name
    assert from_english.line_parse("the agent said something new") is None


def test_the_migration_converts_old_rows_and_leaves_free_text_as_it_was(session):
    Session.objects.filter(id=session.id).update(
        reason="Stop by bob: funds exhausted", reason_key="", reason_params={}
    )
    SessionEvent.objects.filter(session=session).update(message_key="", message_params={})
    SessionEvent.objects.create(session=session, kind="state", message="the agent said something new")

    from_english.messages_from_english(apps, None)

    session.refresh_from_db()
    assert session.reason_key == "stop_by"
    with translation.override("zh-hans"):
        assert "funds exhausted" not in session.reason_display and "bob" in session.reason_display
        shown = {e.message: e.message_display for e in SessionEvent.objects.filter(session=session)}
    assert shown["Placed on node-a"] == "已分配到 node-a"
    assert shown["the agent said something new"] == "the agent said something new"
    free = SessionEvent.objects.get(session=session, message="the agent said something new")
    assert (free.message_key, free.message_params) == ("", {})


def test_a_stored_line_loads_back_as_its_message_or_else_as_its_text():
    stop = message("stop", why=message("funds_exhausted"))
    assert message_load(*message_columns(stop)) == stop
    assert message_load("", {}, "the agent said so") == "the agent said so"
    assert message_load("a_key_from_a_later_release", {}, "as written") == "as written"
    assert message_load("placed_on", {}, "Placed on n") == "Placed on n"
