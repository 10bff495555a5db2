"""The one family of domain errors every service raises.

It lives in core, the bottom layer: every app imports it and it imports none of them. One handler
(``portal.errors``) turns these into HTTP answers with the standard error body
``{"error": {"code", "message", "fields"}}``; pages show ``message`` to the user.
"""

from __future__ import annotations


class ApplicationError(Exception):
    status = 400
    code = "invalid"

    def __init__(self, message: str, *, code: str | None = None, fields: dict[str, str] | None = None):
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        self.fields = fields or {}

    def as_body(self) -> dict:
        return {"error": {"code": self.code, "message": str(self.message), "fields": self.fields}}


class ValidationFailed(ApplicationError):
    status = 400
    code = "invalid"


class NotFound(ApplicationError):
    """Also what a tenant gets for another tenant's object: no hint that it exists."""

    status = 404
    code = "not_found"


class Forbidden(ApplicationError):
    status = 403
    code = "forbidden"


class Conflict(ApplicationError):
    status = 409
    code = "conflict"


class InsufficientFunds(ApplicationError):
    status = 402
    code = "insufficient_funds"


class QuotaExceeded(ApplicationError):
    status = 403
    code = "quota_exceeded"


class RateLimited(ApplicationError):
    """``retry_after_seconds``, when known, goes out as the Retry-After header."""

    status = 429
    code = "rate_limited"

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        fields: dict[str, str] | None = None,
        retry_after_seconds: int | None = None,
    ):
        super().__init__(message, code=code, fields=fields)
        self.retry_after_seconds = retry_after_seconds
