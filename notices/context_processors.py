from functools import cache

from notices.selectors import notices_bell

BELL_SIZE = 5  # of the newest notices the bell reads (BELL_ROWS), the dashboard lists the unread


def bell(request) -> dict:
    """The bell in the nav: the unread count and the newest notices, in one query made only when a page
    shows them (templates call these) and once per page."""
    user = getattr(request, "user", None)
    if user is None or not user.is_authenticated:
        return {}
    read = cache(lambda: notices_bell(user=user))
    return {
        "notices_unread": lambda: read()[0],
        "notices_bell": lambda: read()[1][:BELL_SIZE],
        "notices_recent_unread": lambda: [n for n in read()[1] if n.read_at is None],
    }
