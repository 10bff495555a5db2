"""Invite codes: 80 random bits in Crockford base32, grouped ``ABCD-EFGH-JKMN-PQRS``, plus a Crockford
mod-37 check symbol (``-X``) that catches a typo before any lookup. Only an HMAC-SHA256 of the code,
keyed with SECRET_KEY, is ever stored."""

from __future__ import annotations

import csv
import hashlib
import hmac
import io
import secrets

from django.conf import settings

from core.units import micros_to_hours

ALPHABET = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
CHECK_ALPHABET = ALPHABET + "*~$=U"
DATA_LENGTH = 16  # 16 × 5 = 80 bits
_READ_AS = {"O": "0", "I": "1", "L": "1"}
MAX_INPUT_LENGTH = 64


class CodeMistyped(ValueError):
    """The check symbol does not match: a typo."""


class CodeMalformed(ValueError):
    """Not shaped like a code at all."""


def _value(data: str) -> int:
    value = 0
    for char in data:
        value = value * 32 + ALPHABET.index(char)
    return value


def check_symbol(data: str) -> str:
    return CHECK_ALPHABET[_value(data) % 37]


def code_generate() -> str:
    data = "".join(secrets.choice(ALPHABET) for _ in range(DATA_LENGTH))
    groups = [data[i : i + 4] for i in range(0, DATA_LENGTH, 4)]
    return "-".join(groups) + "-" + check_symbol(data)


def code_normalize(raw: str) -> str:
    """The 16 data symbols of a typed code. Raises CodeMalformed or CodeMistyped."""
    if not isinstance(raw, str) or len(raw) > MAX_INPUT_LENGTH:
        raise CodeMalformed("not a code")
    cleaned = "".join(_READ_AS.get(c, c) for c in raw.upper() if c not in " -\t")
    if len(cleaned) != DATA_LENGTH + 1:
        raise CodeMalformed("not a code")
    data, check = cleaned[:DATA_LENGTH], cleaned[DATA_LENGTH]
    if any(c not in ALPHABET for c in data) or check not in CHECK_ALPHABET:
        raise CodeMalformed("not a code")
    if check_symbol(data) != check:
        raise CodeMistyped("check symbol mismatch")
    return data


def code_hash(data: str) -> str:
    return hmac.new(settings.SECRET_KEY.encode(), data.encode(), hashlib.sha256).hexdigest()


def codes_csv(*, batch, codes: list[str]) -> str:
    """The one-time export of a freshly issued batch: one row per code (the codes are not stored)."""
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(["code", "hours", "label", "batch", "valid_days", "valid_until", "gpu_models"])
    for code in codes:
        writer.writerow(
            [
                code,
                f"{micros_to_hours(batch.hours_micros):g}",
                batch.label,
                batch.pk,
                batch.valid_days or "",
                batch.valid_until.isoformat() if batch.valid_until else "",
                " ".join(batch.gpu_models),
            ]
        )
    return out.getvalue()
