"""``make chaos``'s verdict on what users saw during a web restart (chaos/checks.py): only what a
restarting process cannot help is excused, and only inside the restart's window."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from chaos.checks import users_no_server_errors
from chaos.faults import Fault
from chaos.stack import Timings
from chaos.traffic import Failure

pytestmark = pytest.mark.django_db

RESTART = datetime(2026, 12, 6, 2, 28, 10, tzinfo=UTC)
WS = "WS /jupyter/<id>/api/kernels/<k>/channels"


class _Traffic:
    def __init__(self, *failures: Failure) -> None:
        self.failures = list(failures)


def _verdict(*failures: Failure):
    restart = Fault("web-restart", "web", RESTART, RESTART + timedelta(seconds=5))
    return users_no_server_errors(_Traffic(*failures), [restart], Timings())


def _at(seconds: float) -> float:
    return (RESTART + timedelta(seconds=seconds)).timestamp()


def test_a_handshake_cut_by_the_restart_and_no_answer_while_it_lasts_are_excused():
    check = _verdict(Failure(_at(1), WS, "500"), Failure(_at(2), "GET /dashboard/", "ConnectError"))
    assert check.passed, check


def test_a_500_outside_the_restart_or_to_a_plain_request_during_it_is_not():
    assert not _verdict(Failure(_at(60), WS, "500")).passed
    assert not _verdict(Failure(_at(1), "GET /api/v1/sessions/x", "500")).passed
    assert not _verdict(Failure(_at(1), WS, "503")).passed
