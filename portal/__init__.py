"""Suanli portal: the Django project and the user-facing app."""

from portal.celery import app as celery_app

__all__ = ["celery_app"]
