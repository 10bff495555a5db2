"""``get_FOO_display()`` without translating every choice of the field on each call."""

from __future__ import annotations

import functools

from django.utils.encoding import force_str


@functools.cache
def _labels(field) -> dict:
    return dict(field.flatchoices)


class ChoiceLabels:
    """Put before ``models.Model`` in a model's bases: its ``get_FOO_display()`` then reads the label
    from a map of the field's choices made once per process. Django's own builds that map on every call,
    hashing each choice's lazy label, which translates it: all the kinds of a transfer translated for
    one line of a wallet (a fifth of the wallet page). The label is still translated when shown, into
    the request's language."""

    def _get_FIELD_display(self, field):
        value = getattr(self, field.attname)
        return force_str(_labels(field).get(value, value), strings_only=True)
