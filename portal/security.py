"""Security headers the Django settings do not set by themselves."""

from __future__ import annotations

from django.conf import settings

# Pages use only our own scripts and styles (no CDN); inline styles are allowed for the SVG charts.
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
    "connect-src 'self'; frame-ancestors 'self'; form-action 'self' https://checkout.stripe.com; "
    "base-uri 'self'"
)


class ContentSecurityPolicyMiddleware:
    def __init__(self, get_response):
        self.get_response = get_response
        self.enforce = not settings.DEBUG

    def __call__(self, request):
        response = self.get_response(request)
        header = "Content-Security-Policy" if self.enforce else "Content-Security-Policy-Report-Only"
        if not request.path.startswith(("/api/docs/", "/admin/")):
            response.headers.setdefault(header, CONTENT_SECURITY_POLICY)
        return response
