"""Every string in the Simplified Chinese catalogue is translated, and the compiled catalogue is current."""

from __future__ import annotations

import subprocess
from pathlib import Path

LOCALE = Path(__file__).resolve().parents[2] / "locale" / "zh_Hans" / "LC_MESSAGES"


def test_every_message_has_a_chinese_translation(tmp_path):
    compiled = tmp_path / "django.mo"
    result = subprocess.run(
        ["msgfmt", "--check", "--statistics", "-o", str(compiled), str(LOCALE / "django.po")],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    assert "untranslated" not in result.stderr and "fuzzy" not in result.stderr, result.stderr
    assert compiled.read_bytes() == (LOCALE / "django.mo").read_bytes(), "run `make messages`"
