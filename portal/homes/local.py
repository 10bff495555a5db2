"""``local`` homes: each GPU host keeps ``<state-dir>/homes/<user>``; the portal reaches none of them, so
every transfer answers ``files_unavailable`` (the base class's behaviour)."""

from __future__ import annotations

from portal.homes.base import HomeStorage


class LocalHomes(HomeStorage):
    name = "local"
