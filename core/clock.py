"""The database clock: the one time every money and session decision is made by.

Workers and web processes on different machines disagree about the time; PostgreSQL's clock is the
one they share, so billing watermarks, expiries and heartbeats are all read from it.
"""

from __future__ import annotations

from datetime import datetime

from django.db import connection


def db_now() -> datetime:
    """The database's ``clock_timestamp()``: the current time, not the transaction's start."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT clock_timestamp()")
        return cursor.fetchone()[0]
