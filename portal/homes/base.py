"""The homes backends' base class, registry and what they answer (``portal.homes``)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import BinaryIO, ClassVar

from django.utils.translation import gettext_lazy as _

from core.errors import ApplicationError, Conflict

_BACKENDS: dict[str, type[HomeStorage]] = {}
CHUNK_MAX_BYTES = 16 * 2**20  # one PATCH of an upload


class FilesUnavailable(ApplicationError):
    """This portal cannot reach homes (the ``local`` backend): the user's files are on the GPU hosts."""

    status = 409
    code = "files_unavailable"


@dataclass(frozen=True)
class Entry:
    name: str
    kind: str  # file | folder | link | other
    size_bytes: int
    modified: float  # seconds since the epoch


@dataclass(frozen=True)
class Upload:
    id: str
    path: str
    size_bytes: int
    offset_bytes: int

    @property
    def complete(self) -> bool:
        return self.offset_bytes == self.size_bytes


@dataclass(frozen=True)
class Removed:
    """What a delete took out of a home, counted as the agent's meter counts (agents/home_usage.py):
    ``bytes`` allocated (``st_blocks * 512``), ``entries`` files, folders and links. A file another hard
    link still holds frees nothing and is not counted."""

    path: str
    bytes: int
    entries: int


class DeleteIncomplete(Conflict):
    """A delete stopped part-way (something in it changed meanwhile, or is protected): ``removed`` is
    what went before it stopped, which the caller still counts."""

    code = "delete_incomplete"

    def __init__(self, message: str, *, removed: Removed):
        fields = {"path": removed.path, "bytes": str(removed.bytes), "entries": str(removed.entries)}
        super().__init__(message, fields=fields)
        self.removed = removed


@dataclass
class Download:
    name: str
    size_bytes: int
    file: BinaryIO


class HomeStorage:
    """One user's home is addressed by ``folder``, the agent's name for the user
    (``provisioner.selectors.workload_user``); ``path`` is relative to the home."""

    name: ClassVar[str]

    def __init__(self, root: str = "") -> None:
        self.root = root

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        _BACKENDS[cls.name] = cls

    def listing(self, *, folder: str, path: str) -> Iterator[Entry]:
        raise FilesUnavailable(_unavailable())

    def download_open(self, *, folder: str, path: str) -> Download:
        raise FilesUnavailable(_unavailable())

    def upload_create(self, *, owner_id: int, folder: str, path: str, size_bytes: int) -> Upload:
        raise FilesUnavailable(_unavailable())

    def upload_status(self, *, owner_id: int, upload_id: str) -> Upload:
        raise FilesUnavailable(_unavailable())

    def upload_append(
        self, *, owner_id: int, upload_id: str, offset_bytes: int, length_bytes: int, body: BinaryIO
    ) -> Upload:
        raise FilesUnavailable(_unavailable())

    def delete(self, *, folder: str, path: str) -> Removed:
        raise FilesUnavailable(_unavailable())

    def uploads_expire(self, *, idle_seconds: float) -> int:
        """Discard partial uploads that no part reached for ``idle_seconds``; how many went."""
        return 0


def _unavailable():
    return _(
        "Your files live on the GPU host of each session here: open them in JupyterLab. Uploads and "
        "downloads from the portal need shared homes, which this site has not set up."
    )


def backend_class(name: str) -> type[HomeStorage]:
    try:
        return _BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown homes backend {name!r} (known: {', '.join(sorted(_BACKENDS))})")
