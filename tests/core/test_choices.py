"""A model's choice labels: the request's language, and one translation per label shown."""

from unittest import mock

from django.utils import translation

from billing.models import Transfer
from provisioner.models import Session


def test_a_label_is_translated_once_into_the_active_language_and_an_unknown_value_shows_as_itself():
    transfer = Transfer(kind=Transfer.Kind.CARD_BURN)
    assert len(Transfer.Kind.choices) > 5
    with translation.override("en"):
        assert transfer.get_kind_display() == "Card burn"
    with (
        translation.override("zh-hans"),
        mock.patch.object(translation._trans, "gettext", wraps=translation._trans.gettext) as said,
    ):
        label = transfer.get_kind_display()
    assert label != "Card burn" and said.call_count == 1  # Django's own translates every kind each call
    assert Session(state="no-such-state").get_state_display() == "no-such-state"
