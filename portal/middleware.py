from __future__ import annotations

import time
import zoneinfo

from django.utils import timezone, translation


class UserPreferencesMiddleware:
    """Applies the logged-in user's language and time zone (the switcher stores them on the user)."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        user = getattr(request, "user", None)
        if user is not None and user.is_authenticated:
            translation.activate(user.language)
            request.LANGUAGE_CODE = translation.get_language()
            try:
                timezone.activate(zoneinfo.ZoneInfo(user.time_zone))
            except (zoneinfo.ZoneInfoNotFoundError, ValueError):
                timezone.deactivate()
        response = self.get_response(request)
        response.headers.setdefault("Content-Language", translation.get_language())
        return response


class ServerTimingMiddleware:
    """``Server-Timing: app;dur=<ms>`` on every answer: the time spent in Django for it, so that a load
    generator (``make load``) can tell the server's time from the queueing and the network's."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        started = time.perf_counter()
        response = self.get_response(request)
        response.headers["Server-Timing"] = f"app;dur={(time.perf_counter() - started) * 1000:.1f}"
        return response
