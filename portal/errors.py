"""Turns domain errors and DRF's own into the one error body: ``{"error": {"code", "message", "fields"}}``."""

from __future__ import annotations

from django.core.exceptions import PermissionDenied as DjangoPermissionDenied
from django.http import Http404
from rest_framework import exceptions as drf_exceptions
from rest_framework.response import Response
from rest_framework.views import exception_handler

from billing.errors import ApplicationError


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
        return Response(exc.as_body(), status=exc.status)
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
