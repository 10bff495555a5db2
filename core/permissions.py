"""Permissions every app's API uses."""

from __future__ import annotations

from rest_framework import permissions


class StaffOnly(permissions.IsAdminUser):
    """The staff endpoints (``/api/v1/admin/…``): with the default classes, so token scopes still apply."""

    message = "Staff only."
