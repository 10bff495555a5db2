"""Users' homes as the portal reaches them: a base class and a registry of storage backends by name
(docs/STORAGE.md), after the agent's runtimes. ``local`` homes live on each GPU host and the portal has
no way to them; ``shared`` homes live under a root every GPU host of the pool and the portal mount, and
the portal lists them and moves files in and out of them (``portal.homes.shared``).

``home_storage()`` is the backend the settings name.
"""

from __future__ import annotations

from functools import cache

from django.conf import settings

from portal.homes import local, shared  # noqa: F401  registers the backends
from portal.homes.base import CHUNK_MAX_BYTES, FilesUnavailable, HomeStorage, backend_class

__all__ = ["CHUNK_MAX_BYTES", "FilesUnavailable", "HomeStorage", "home_storage"]


@cache
def _storage(name: str, root: str) -> HomeStorage:
    return backend_class(name)(root)


def home_storage() -> HomeStorage:
    """The backend ``HOMES_BACKEND`` names (``HOMES_SHARED_ROOT`` for ``shared``), one per process."""
    return _storage(settings.HOMES_BACKEND, settings.HOMES_SHARED_ROOT)
