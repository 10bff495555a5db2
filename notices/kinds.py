"""What a notice can be about: each kind has a title (an email's subject, a heading in the list) and
whether it is emailed unless its recipient turned that off (``NoticePreference``)."""

from __future__ import annotations

from dataclasses import dataclass

from django.utils.functional import Promise
from django.utils.translation import gettext_lazy as _


@dataclass(frozen=True)
class Kind:
    name: str
    title: Promise
    email_default: bool


KINDS: dict[str, Kind] = {
    kind.name: kind
    for kind in (
        Kind("card_expiring", _("A compute card expires soon"), True),
        Kind("card_received", _("A gifted compute card was received"), True),
        Kind("runway_low", _("Funds are running low"), True),
        Kind("session_started", _("A session started"), False),
        Kind("session_stopped", _("A session ended"), True),
        Kind("session_placed", _("A queued session was placed"), True),
        Kind("budget_threshold", _("A budget reached a threshold"), True),
        Kind("topup_credited", _("A top-up was credited"), True),
        Kind("stop_warning", _("A session stops soon"), True),
        Kind("ledger_hold", _("The ledger check found a problem"), True),
        Kind("home_removal", _("Your home folder is to be removed"), True),
    )
}
KIND_MAX_LENGTH = 32
KIND_CHOICES = [(kind.name, kind.title) for kind in KINDS.values()]
