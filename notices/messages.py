"""The lines notices say, as message keys (``core.messages``) registered at import: a notice is stored as
a key and its parameters and rendered when it is read, in the reader's language."""

from __future__ import annotations

from django.utils.translation import gettext_noop

from core.messages import templates_register

TEMPLATES: dict[str, str] = {
    "card_expiring": gettext_noop(
        "Your compute card #%(card)s with %(hours)s h left expires on %(expires)s UTC: use its hours before "
        "then, what is left expires."
    ),
    "card_gift_received": gettext_noop(
        "You received compute card #%(card)s with %(hours)s h, a gift from %(giver)s."
    ),
    "card_gift_redeemed": gettext_noop(
        "Your gift of %(hours)s h (compute card #%(card)s) was redeemed by %(user)s."
    ),
    "runway_low": gettext_noop(
        "The funds of %(account)s run out in about %(minutes)s minutes at the current rate: top up, or your "
        "sessions on it will stop."
    ),
    "session_started": gettext_noop("Your %(session)s session is running."),
    "session_stopped": gettext_noop("Your %(session)s session ended: %(why)s"),
    "session_placed": gettext_noop("Your queued %(session)s session found a GPU and is starting."),
    "topup_credited": gettext_noop("Your top-up of %(amount)s %(currency)s was credited to %(account)s."),
    "ledger_hold": gettext_noop(
        "Ledger check failed (%(problem)s) on %(subject)s, account %(account)s. Launches on that account are "
        "blocked until staff resolve hold #%(hold)s in the admin."
    ),
}
templates_register(TEMPLATES)
