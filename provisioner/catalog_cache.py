"""The catalog (models, profiles, prices, environments, availability) is the same for everyone: it is
built once and kept in the cache under a version, which every change that could alter it replaces.

What changes it: the offer (models, profiles, environments, prices, card burn rates: their signals), the
fleet (a node's saved state, labels or name and any device saved: their signals; bulk updates of
devices and a node marked down by the liveness sweep call ``catalog_changed`` where they happen), and
the slots in use (placement and every release of an allocation). Anything
missed is bounded by ``CATALOG_CACHE_SECONDS``; a price that takes effect later caps the entry's life at
its ``effective_from``. The cache failing (Redis down) means the catalog is built for each request.
"""

from __future__ import annotations

import logging
import uuid

from django.core.cache import cache
from django.db import transaction

VERSION_KEY = "catalog:version"
logger = logging.getLogger(__name__)


def catalog_version() -> str:
    version = cache.get(VERSION_KEY)
    if version is None:
        version = uuid.uuid4().hex
        if not cache.add(VERSION_KEY, version, timeout=None):
            version = cache.get(VERSION_KEY) or version
    return version


def catalog_changed() -> None:
    """Drop the cached catalog now, and again once the current transaction commits: a request that
    rebuilt it in between from the rows before the commit cached them under a version nobody reads."""
    _replace_version()
    transaction.on_commit(_replace_version, robust=True)


def _replace_version() -> None:
    try:
        cache.set(VERSION_KEY, uuid.uuid4().hex, timeout=None)
    except Exception:  # a cache that is down holds no stale catalog; never fail the change for it
        logger.warning("could not drop the cached catalog", exc_info=True)


def on_offer_saved(sender, **kwargs) -> None:
    """post_save / post_delete of what the catalog shows (models, profiles, environments, prices, burn
    rates, devices) and of nodes removed."""
    catalog_changed()


NODE_FIELDS_SHOWN = frozenset({"state", "labels", "name", "interfaces"})


def on_node_saved(sender, update_fields=None, **kwargs) -> None:
    """post_save of a node: a change of what placement and availability read (an admin's edit saves
    every field). Every heartbeat saves its node's own fields, which change nothing shown."""
    if update_fields is None or NODE_FIELDS_SHOWN & set(update_fields):
        catalog_changed()
