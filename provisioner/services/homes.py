"""Users' homes as the provisioner counts them (``HomeUsage``, measured by the agents)."""

from __future__ import annotations

from django.db.models import F, Value
from django.db.models.functions import Greatest

from provisioner.models import HomeUsage


def home_usage_lower(*, user_id: int, bytes_removed: int, entries_removed: int) -> bool:
    """Lower the user's last measured home by what the portal just deleted from it, in one UPDATE and
    never below 0, so a user who was over their home quota may launch at once. ``measured_at`` stays:
    the agent's next measurement (any newer one) replaces these figures with what it finds. False where
    no agent has measured the home yet (nothing to lower, and a home never measured is never refused)."""
    if bytes_removed < 0 or entries_removed < 0:
        raise ValueError("what was removed is not negative")
    lowered = HomeUsage.objects.filter(user_id=user_id).update(
        bytes=Greatest(F("bytes") - bytes_removed, Value(0)),
        files=Greatest(F("files") - entries_removed, Value(0)),
    )
    return lowered == 1
