"""The Celery application shared by the worker and beat processes."""

import os

from celery import Celery
from celery.fixups.django import DjangoFixup, DjangoWorkerFixup

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")


class _TaskConnections(DjangoWorkerFixup):
    """A task is to the database what a request is to Django: before and after it, the thread's
    connections are closed only when unusable or older than ``CONN_MAX_AGE`` (and health-checked at
    their next use, ``CONN_HEALTH_CHECKS``). Celery's own fixup closes them around every task, so each
    task opened a new PostgreSQL connection: a backend started and ended per task, and a tenth of the
    worker's CPU under load."""

    def close_database(self, **kwargs) -> None:
        from django.db import close_old_connections

        close_old_connections()


class Fixup(DjangoFixup):
    """Celery's Django fixup (``django.setup()``, task discovery, the fork-safe closes of a prefork
    child), with the task connections above."""

    @property
    def worker_fixup(self) -> DjangoWorkerFixup:
        if self._worker_fixup is None:
            self._worker_fixup = _TaskConnections(self.app)
        return self._worker_fixup

    @worker_fixup.setter
    def worker_fixup(self, value: DjangoWorkerFixup) -> None:
        self._worker_fixup = value


def fixup(app: Celery) -> Fixup:
    return Fixup(app).install()


app = Celery("suanli", fixups=["portal.celery:fixup"])
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
