"""Turns domain errors and DRF's own into the one error body: ``{"error": {"code", "message", "fields"}}``."""

from __future__ import annotations

from django.core.exceptions import PermissionDenied as DjangoPermissionDenied
from django.http import Http404
from rest_framework import exceptions as drf_exceptions
from rest_framework.response import Response
from rest_framework.views import exception_handler

from core.errors import ApplicationError, RateLimited

# The errors any API call can answer, documented once for every operation (drf-spectacular hook below)
# rather than on each view: what the exception handler makes of bad input, a missing or scoped-out
# token, another tenant's object and a throttle.
ERROR_SCHEMA = {
    "type": "object",
    "properties": {
        "error": {
            "type": "object",
            "properties": {
                "code": {"type": "string"},
                "message": {"type": "string"},
                "fields": {"type": "object", "additionalProperties": {"type": "string"}},
            },
            "required": ["code", "message", "fields"],
        }
    },
    "required": ["error"],
}
ERRORS_OF_EVERY_CALL = {
    "400": "Invalid input",
    "401": "No credentials, or a token that is unknown, expired or revoked",
    "403": "Not allowed: a token without the scope, a staff-only endpoint, or not your role in a team",
    "404": "No such object (also another tenant's)",
    "429": "Rate limited",
}
ERRORS_OF_WRITES = {"402": "Not enough funds", "409": "Conflicts with the object's state"}
ERRORS_OF_AGENTS = {"400": "Invalid heartbeat", "401": "Unknown node token"}


def _flatten(detail, prefix: str = "") -> dict[str, str]:
    if isinstance(detail, dict):
        found: dict[str, str] = {}
        for key, value in detail.items():
            found.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
        return found
    if isinstance(detail, list):
        if all(not isinstance(item, dict | list) for item in detail):
            return {prefix or "non_field_errors": " ".join(str(item) for item in detail)}
        found = {}
        for index, item in enumerate(detail):
            found.update(_flatten(item, f"{prefix}.{index}" if prefix else str(index)))
        return found
    return {prefix or "non_field_errors": str(detail)}


def api_exception_handler(exc, context):
    if isinstance(exc, ApplicationError):
        response = Response(exc.as_body(), status=exc.status)
        if isinstance(exc, RateLimited) and exc.retry_after_seconds:
            response["Retry-After"] = str(exc.retry_after_seconds)
        return response
    if isinstance(exc, Http404):
        exc = drf_exceptions.NotFound()
    elif isinstance(exc, DjangoPermissionDenied):
        exc = drf_exceptions.PermissionDenied()
    response = exception_handler(exc, context)
    if response is None:
        return None
    if isinstance(exc, drf_exceptions.ValidationError):
        fields = _flatten(exc.detail)
        message = "; ".join(f"{k}: {v}" for k, v in fields.items())
        body = {"error": {"code": "invalid", "message": message or "Invalid input.", "fields": fields}}
    else:
        detail = exc.detail if isinstance(exc, drf_exceptions.APIException) else str(exc)
        code = exc.default_code if isinstance(exc, drf_exceptions.APIException) else "error"
        body = {"error": {"code": code, "message": str(detail), "fields": {}}}
    response.data = body
    return response


def schema_add_error_responses(result: dict, generator, request, public) -> dict:
    """drf-spectacular postprocessing hook: every API operation documents the standard error body for
    the errors it can answer (an operation's own annotation for a code wins)."""
    result.setdefault("components", {}).setdefault("schemas", {})["Error"] = ERROR_SCHEMA
    ref = {"$ref": "#/components/schemas/Error"}
    for path, operations in result.get("paths", {}).items():
        for method, operation in operations.items():
            if path.startswith("/api/agent/"):
                errors = ERRORS_OF_AGENTS
            elif method in ("get", "head", "options"):
                errors = ERRORS_OF_EVERY_CALL
            else:
                errors = ERRORS_OF_EVERY_CALL | ERRORS_OF_WRITES
            responses = operation.setdefault("responses", {})
            for status, description in errors.items():
                responses.setdefault(
                    status, {"description": description, "content": {"application/json": {"schema": ref}}}
                )
    return result
