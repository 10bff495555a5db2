"""Session lines are stored in English and shown in the reader's language."""

from __future__ import annotations

import re

import pytest
from django.utils import translation

from provisioner import messages as M
from provisioner.messages import TEMPLATES, line, line_translate

VALUES = {"user": "alice", "node": "node-a", "gpu_model": "A100-SXM4-80GB", "profile": "1/4", "why": "oops",
          "actor": "bob", "minutes": "15", "seconds": "300", "code": "409", "time": "12:00:01"}  # fmt: skip


def _filled(template: str) -> str:
    return line(template, **{name: VALUES[name] for name in re.findall(r"%\((\w+)\)s", template)})


@pytest.mark.parametrize("template", TEMPLATES)
def test_every_line_reads_back_as_stored_in_english_and_translated_in_chinese(template):
    stored = _filled(template)
    with translation.override("en"):
        assert line_translate(stored) == stored
    with translation.override("zh-hans"):
        shown = line_translate(stored)
    assert shown != stored, f"no Chinese for {template!r}"
    for name in re.findall(r"%\((\w+)\)s", template):
        assert VALUES[name] in shown


def test_a_reason_inside_a_stop_line_is_translated_too():
    stored = line(M.STOP_BY, actor="bob", why=M.FUNDS_EXHAUSTED)
    assert stored == "Stop by bob: funds exhausted"
    with translation.override("zh-hans"):
        shown = line_translate(stored)
        assert translation.gettext(M.FUNDS_EXHAUSTED) in shown and "bob" in shown
        assert "funds exhausted" not in shown


def test_a_line_from_no_template_is_shown_as_stored():
    with translation.override("zh-hans"):
        assert line_translate("the agent said something new") == "the agent said something new"
        assert line_translate("") == ""
