from functools import cache

from notices.selectors import notices_recent, notices_unread_count

BELL_SIZE = 5


def bell(request) -> dict:
    """The bell in the nav: the unread count and the newest notices, each one query, made only when a
    page shows them (templates call these) and once per page."""
    user = getattr(request, "user", None)
    if user is None or not user.is_authenticated:
        return {}
    return {
        "notices_unread": cache(lambda: notices_unread_count(user=user)),
        "notices_bell": cache(lambda: list(notices_recent(user=user, limit=BELL_SIZE))),
    }
