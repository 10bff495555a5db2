"""Where logins live: Django's database session store, its read compiled once per process.

Every signed-in request reads its login row; Django's store builds that query anew each time (about a
millisecond and a half of the request's CPU). This store reads the same row with the same condition
(the key, not yet expired), compiled once; everything else is Django's."""

from __future__ import annotations

from django.contrib.sessions.backends import db
from django.contrib.sessions.models import Session
from django.db.models.functions import Now

from core.compiled import Lookup

_UNEXPIRED = Lookup(
    lambda key: Session.objects.filter(session_key=key, expire_date__gt=Now()), key_types=(str,)
)


class SessionStore(db.SessionStore):
    def _get_session_from_db(self):
        found = _UNEXPIRED.first(self.session_key)
        if found is None:
            self._session_key = None  # as Django's: a missing or expired login starts a new one
        return found
