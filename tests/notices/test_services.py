"""notify: one notice per person, once per dedupe key, emailed in the recipient's language unless they
opted out; read and dismiss by the owner only."""

from __future__ import annotations

import pytest
from django.core import mail

from core.errors import NotFound
from core.messages import message
from notices.models import Notice
from notices.selectors import notice_email_choices, notices_recent, notices_unread_count
from notices.services import (
    notice_dismiss,
    notice_preference_set,
    notice_read,
    notices_mark_all_read,
    notify,
)
from tests.notices.conftest import make_user

pytestmark = pytest.mark.django_db

STOPPED = {"session": "A100 whole", "why": message("idle_for", minutes=30)}


def _stopped(users, dedupe_key: str = "session:1:session_stopped") -> int:
    return notify(
        users=users, kind="session_stopped", key="session_stopped", params=STOPPED,
        dedupe_key=dedupe_key, url="/sessions/1/",
    )  # fmt: skip


def test_notify_makes_one_notice_per_person_and_a_repeat_makes_nothing(django_capture_on_commit_callbacks):
    ada, bo = make_user("ada"), make_user("bo")
    with django_capture_on_commit_callbacks(execute=True):
        assert _stopped([ada, bo, ada]) == 2
        assert _stopped([ada, bo]) == 0
    assert Notice.objects.filter(dedupe_key="session:1:session_stopped").count() == 2
    assert len(mail.outbox) == 2  # the repeat sent nothing either


def test_each_recipient_is_emailed_in_their_own_language(django_capture_on_commit_callbacks, settings):
    settings.SITE_URL = "https://gpu.example.edu"
    users = [make_user("en_user"), make_user("zh_user", language="zh-hans")]
    with django_capture_on_commit_callbacks(execute=True):
        _stopped(users)
    sent = {m.to[0]: m for m in mail.outbox}
    english, chinese = sent["en_user@example.com"], sent["zh_user@example.com"]
    assert english.subject == "A session ended"
    assert english.body == (
        "Your A100 whole session ended: idle for 30 minutes\n\nhttps://gpu.example.edu/sessions/1/"
    )
    assert chinese.subject != english.subject and "A100 whole" in chinese.body and "30" in chinese.body
    assert "idle" not in chinese.body and chinese.body.endswith("https://gpu.example.edu/sessions/1/")
    assert Notice.objects.filter(emailed_at__isnull=False).count() == 2


def test_no_email_for_an_opted_out_kind_or_without_an_address(django_capture_on_commit_callbacks):
    quiet, no_address, keen = make_user("quiet"), make_user("noaddr", email=False), make_user("keen")
    notice_preference_set(user=quiet, kind="session_stopped", email=False)
    notice_preference_set(user=keen, kind="session_started", email=True)  # off by default, on for keen
    with django_capture_on_commit_callbacks(execute=True):
        _stopped([quiet, no_address, keen])
        for user in (quiet, keen):
            notify(users=[user], kind="session_started", key="session_started",
                   params={"session": "T4 1/2"}, dedupe_key="session:2:session_started")  # fmt: skip
    assert sorted((m.to[0], m.subject) for m in mail.outbox) == [
        ("keen@example.com", "A session ended"),
        ("keen@example.com", "A session started"),
    ]
    assert Notice.objects.filter(user=quiet).count() == 2  # shown under the bell all the same
    assert {kind.name: on for kind, on in notice_email_choices(user=quiet)}["session_stopped"] is False


def test_a_preference_back_to_the_default_keeps_no_row():
    user = make_user("ada")
    notice_preference_set(user=user, kind="runway_low", email=False)
    assert user.notice_preferences.count() == 1
    notice_preference_set(user=user, kind="runway_low", email=True)
    assert user.notice_preferences.count() == 0


def test_notify_refuses_an_unknown_kind_or_wrong_parameters():
    user = make_user("ada")
    with pytest.raises(ValueError):
        notify(users=[user], kind="gossip", key="session_started", params={"session": "x"}, dedupe_key="k")
    with pytest.raises(ValueError):
        notify(users=[user], kind="session_started", key="session_started", params={}, dedupe_key="k")
    assert not Notice.objects.exists()


def test_read_and_dismiss_by_the_owner_only_and_idempotent():
    ada, eve = make_user("ada"), make_user("eve")
    _stopped([ada])
    notice = Notice.objects.get(user=ada)
    for change in (notice_read, notice_dismiss):
        with pytest.raises(NotFound):
            change(user=eve, notice_id=notice.id)
    assert notices_unread_count(user=ada) == 1
    first = notice_read(user=ada, notice_id=notice.id).read_at
    assert notice_read(user=ada, notice_id=notice.id).read_at == first
    assert notices_unread_count(user=ada) == 0 and list(notices_recent(user=ada)) == [notice]
    notice_dismiss(user=ada, notice_id=notice.id)
    assert notice_dismiss(user=ada, notice_id=notice.id).dismissed_at is not None
    assert list(notices_recent(user=ada)) == []


def test_mark_all_read_touches_only_the_callers_notices():
    ada, bo = make_user("ada"), make_user("bo")
    _stopped([ada, bo])
    _stopped([ada], dedupe_key="other")
    assert notices_mark_all_read(user=ada) == 2
    assert notices_unread_count(user=ada) == 0 and notices_unread_count(user=bo) == 1
