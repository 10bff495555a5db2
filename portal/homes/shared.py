"""``shared`` homes: ``<root>/<user>/`` on a filesystem every GPU host of the pool mounts, and the portal.

Tenant files are hostile: a session may have planted a symbolic link anywhere in its home (to ``/etc``,
to another user's home) or a FIFO. Every path a request names is relative to the home, normalised, and
refused with ``..``, a NUL or a leading ``/`` (``path_parts``). It is then walked one component at a time
from a descriptor of the home with ``O_NOFOLLOW`` (``openat``), so no symbolic link is followed, however
it is swapped in while the walk runs; a file is opened ``O_NONBLOCK`` and must be a regular file owned by
the home's owner (not a FIFO, not a hard link to someone else's file).

Uploads follow a small resumable protocol (docs/STORAGE.md): ``upload_create`` records the target and
its size; ``upload_append`` appends one chunk at the offset the client names, which must be the offset
the server holds (else ``Conflict`` with the server's offset); the last chunk moves the file into place
with one ``rename`` (atomic: the target is the old file or the whole new one). Partial uploads live
beside the homes in ``<root>/.suanli/uploads/`` (same filesystem, so the rename never copies), which no
session sees: the agent hides the whole homes root and binds each session's own home only. Files and
folders the portal makes get the home's owner, the uid the agents run that user's sessions as.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import secrets
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from django.conf import settings
from django.utils.translation import gettext as _

from core.errors import Conflict, NotFound, ValidationFailed
from portal.homes.base import (
    CHUNK_MAX_BYTES,
    DeleteIncomplete,
    Download,
    Entry,
    HomeStorage,
    Removed,
    Upload,
)

STATE_DIR = ".suanli"  # beside the homes; the agents keep their uid table there too
LISTING_MAX_ENTRIES = 2000
PATH_MAX_BYTES = 1024
COPY_BYTES = 1 << 20
_UPLOAD_ID = re.compile(r"[0-9a-f]{32}")
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# A delete that stops part-way for these says what went (DeleteIncomplete); other errors are the server's.
_INCOMPLETE = (errno.ENOTEMPTY, errno.EBUSY, errno.EISDIR, errno.EPERM, errno.EACCES, errno.EROFS)


def path_parts(path: str, *, allow_home: bool = False) -> tuple[str, ...]:
    """``path``'s components, relative to the home: ``a//./b/`` is ``("a", "b")``. Raises
    ValidationFailed for an absolute path, ``..``, a NUL, or (unless ``allow_home``) the home itself."""
    if (
        not isinstance(path, str)
        or path.startswith("/")
        or "\x00" in path
        or len(path.encode("utf-8", "surrogateescape")) > PATH_MAX_BYTES
    ):
        raise ValidationFailed(
            _("Name a path inside your home, such as data/train.csv."), fields={"path": path}
        )
    parts = tuple(part for part in path.split("/") if part not in ("", "."))
    if ".." in parts or any(len(part.encode()) > 255 for part in parts) or (not parts and not allow_home):
        raise ValidationFailed(
            _("Name a path inside your home, such as data/train.csv."), fields={"path": path}
        )
    return parts


def _not_found(path: str) -> NotFound:
    return NotFound(_("There is no such file or folder in your home."), fields={"path": path})


class SharedHomes(HomeStorage):
    name = "shared"

    def __init__(self, root: str = "") -> None:
        super().__init__(root)
        self.uploads = Path(root) / STATE_DIR / "uploads"

    # -- walking ----------------------------------------------------------------------------------

    def _home_fd(self, folder: str, *, create: bool) -> int:
        """A descriptor of the user's home (made, owned by the portal, when ``create`` and missing: the
        agent gives it to the user's uid at their first session)."""
        if not folder or folder.startswith(".") or "/" in folder:
            raise ValueError(f"not a home folder name: {folder!r}")
        root_fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # the operator's: followed
        try:
            try:
                return os.open(folder, _DIR, dir_fd=root_fd)
            except FileNotFoundError:
                if not create:
                    raise
                with contextlib.suppress(FileExistsError):
                    os.mkdir(folder, 0o700, dir_fd=root_fd)
                return os.open(folder, _DIR, dir_fd=root_fd)
        finally:
            os.close(root_fd)

    def _walk(self, home_fd: int, parts: tuple[str, ...], path: str, *, create: bool = False) -> int:
        """A descriptor of the folder ``parts`` names under the home, never through a symbolic link;
        missing folders are made (the home's owner, 0755) when ``create``. NotFound otherwise."""
        fd = os.dup(home_fd)
        owner = os.fstat(home_fd)
        try:
            for part in parts:
                try:
                    child = os.open(part, _DIR, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        raise _not_found(path)
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(part, 0o755, dir_fd=fd)
                        _give(part, owner, dir_fd=fd)
                    child = os.open(part, _DIR, dir_fd=fd)
                except OSError as exc:  # ELOOP: a symbolic link; ENOTDIR: a file where a folder goes
                    if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EACCES):
                        raise _not_found(path)
                    raise
                os.close(fd)
                fd = child
            return fd
        except BaseException:
            os.close(fd)
            raise

    # -- reading ----------------------------------------------------------------------------------

    def listing(self, *, folder: str, path: str) -> Iterator[Entry]:
        parts = path_parts(path, allow_home=True)
        try:
            home_fd = self._home_fd(folder, create=False)
        except FileNotFoundError:
            if parts:
                raise _not_found(path)
            return iter(())  # no session and no upload yet: an empty home
        try:
            fd = self._walk(home_fd, parts, path)
        finally:
            os.close(home_fd)
        try:
            entries = []
            with os.scandir(fd) as found:
                for item in found:
                    if len(entries) == LISTING_MAX_ENTRIES:
                        break
                    try:
                        info = item.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    entries.append(Entry(item.name, _kind(info.st_mode), info.st_size, info.st_mtime))
        finally:
            os.close(fd)
        return iter(sorted(entries, key=lambda e: (e.kind != "folder", e.name.lower())))

    def download_open(self, *, folder: str, path: str) -> Download:
        parts = path_parts(path)
        try:
            home_fd = self._home_fd(folder, create=False)
        except FileNotFoundError:
            raise _not_found(path)
        try:
            home = os.fstat(home_fd)
            parent = self._walk(home_fd, parts[:-1], path)
        finally:
            os.close(home_fd)
        try:
            fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=parent)
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.ELOOP, errno.ENOTDIR, errno.EACCES, errno.ENXIO):
                raise _not_found(path)
            raise
        finally:
            os.close(parent)
        info = os.fstat(fd)
        # Only the home's own files: a hard link to another user's file is refused too.
        if not stat.S_ISREG(info.st_mode) or info.st_uid not in (home.st_uid, os.geteuid()):
            os.close(fd)
            raise _not_found(path)
        os.set_blocking(fd, True)
        return Download(parts[-1], info.st_size, os.fdopen(fd, "rb"))

    # -- deleting ---------------------------------------------------------------------------------

    def delete(self, *, folder: str, path: str) -> Removed:
        """Remove the file, symbolic link (itself, never its target) or folder with everything under it
        that ``path`` names. The home itself is refused (ValidationFailed), as are ``..`` and absolute
        paths; a path through a symbolic link, or to nothing, is NotFound. The tree is removed from
        descriptors (``dir_fd``) opened ``O_NOFOLLOW``, so a link planted inside it, or swapped in while
        it is removed, is unlinked and never followed. Not atomic: where part of it cannot go (a session
        writing into the folder meanwhile, an immutable file) the rest stays and DeleteIncomplete says
        what went."""
        parts = path_parts(path)
        try:
            home_fd = self._home_fd(folder, create=False)
        except FileNotFoundError:
            raise _not_found(path)
        try:
            parent = self._walk(home_fd, parts[:-1], path)
        finally:
            os.close(home_fd)
        tally = _Tally()
        try:
            try:
                _remove(parent, parts[-1], tally)
            except (FileNotFoundError, NotADirectoryError):
                raise _not_found(path)
            except OSError as exc:
                if exc.errno in _INCOMPLETE:
                    raise DeleteIncomplete(
                        _(
                            "Part of it could not be deleted: it changed meanwhile (a session writing into "
                            "it?) or is protected. What is left is still there; try again."
                        ),
                        removed=Removed("/".join(parts), tally.bytes, tally.entries),
                    )
                raise
        finally:
            os.close(parent)
        return Removed("/".join(parts), tally.bytes, tally.entries)

    # -- uploads ----------------------------------------------------------------------------------

    def upload_create(self, *, owner_id: int, folder: str, path: str, size_bytes: int) -> Upload:
        parts = path_parts(path)
        if not 0 <= size_bytes <= settings.HOMES_UPLOAD_MAX_BYTES:
            raise ValidationFailed(
                _("A file may hold up to %(limit)s bytes.") % {"limit": settings.HOMES_UPLOAD_MAX_BYTES},
                fields={"size": str(size_bytes)},
            )
        self.uploads.mkdir(parents=True, exist_ok=True, mode=0o700)
        if self._open_uploads(owner_id) >= settings.HOMES_UPLOADS_OPEN_MAX:
            raise Conflict(
                _(
                    "You have %(count)s uploads under way, the most at once: finish or wait for one "
                    "of them (an upload not resumed for %(hours)s hours is discarded)."
                )
                % {"count": settings.HOMES_UPLOADS_OPEN_MAX, "hours": settings.HOMES_UPLOAD_ABANDONED_HOURS},
                code="uploads_open",
            )
        upload_id = secrets.token_hex(16)
        record = {"owner_id": owner_id, "folder": folder, "path": "/".join(parts), "size_bytes": size_bytes}
        fd = os.open(self.uploads / f"{upload_id}.part", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.close(fd)
        tmp = self.uploads / f"{upload_id}.json.tmp"
        tmp.write_text(json.dumps(record))
        os.replace(tmp, self.uploads / f"{upload_id}.json")
        upload = Upload(upload_id, record["path"], size_bytes, 0)
        if size_bytes == 0:
            self._finish(upload_id, record)
        return upload

    def _open_uploads(self, owner_id: int) -> int:
        count = 0
        for entry in os.scandir(self.uploads):
            if entry.name.endswith(".json") and _UPLOAD_ID.fullmatch(entry.name[:-5]):
                with contextlib.suppress(OSError, ValueError):
                    count += json.loads(Path(entry.path).read_text()).get("owner_id") == owner_id
        return count

    def uploads_expire(self, *, idle_seconds: float) -> int:
        """A partial upload is idle since its part file last grew (or since it began); one idle for
        ``idle_seconds`` loses its record first (so a late part gets 404, never half a file), then its
        part file."""
        if not self.uploads.is_dir():
            return 0
        cutoff, expired = time.time() - idle_seconds, 0
        for entry in os.scandir(self.uploads):
            if not (entry.name.endswith(".json") and _UPLOAD_ID.fullmatch(entry.name[:-5])):
                continue
            upload_id = entry.name[:-5]
            part = self.uploads / f"{upload_id}.part"
            try:
                touched = max(entry.stat().st_mtime, part.stat().st_mtime)
            except FileNotFoundError:  # finished or expired meanwhile
                continue
            if touched >= cutoff:
                continue
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
                part.unlink(missing_ok=True)
                expired += 1
        return expired

    def _record(self, owner_id: int, upload_id: str) -> dict:
        """The upload's record, for its owner only (anyone else gets the same NotFound as a bad id)."""
        try:
            if not _UPLOAD_ID.fullmatch(upload_id):
                raise FileNotFoundError
            record = json.loads((self.uploads / f"{upload_id}.json").read_text())
        except (OSError, ValueError):
            raise NotFound(_("There is no such upload: it finished, or never began."))
        if record.get("owner_id") != owner_id:
            raise NotFound(_("There is no such upload: it finished, or never began."))
        return record

    def upload_status(self, *, owner_id: int, upload_id: str) -> Upload:
        record = self._record(owner_id, upload_id)
        try:
            offset = (self.uploads / f"{upload_id}.part").stat().st_size
        except FileNotFoundError:  # finished between the two reads
            offset = record["size_bytes"]
        return Upload(upload_id, record["path"], record["size_bytes"], offset)

    def upload_append(
        self, *, owner_id: int, upload_id: str, offset_bytes: int, length_bytes: int, body: BinaryIO
    ) -> Upload:
        """Append ``length_bytes`` of ``body`` at ``offset_bytes``, which must be where the upload stands.

        Holds an exclusive ``flock`` of the partial file while it writes, so two clients resuming at
        once cannot interleave (the second gets Conflict). A body shorter than it said leaves the
        upload where it was. The last chunk moves the file into the home (``_finish``)."""
        record = self._record(owner_id, upload_id)
        size = record["size_bytes"]
        if not 0 < length_bytes <= CHUNK_MAX_BYTES or offset_bytes + length_bytes > size:
            raise ValidationFailed(
                _("Send the file in parts of up to 16 MiB, none past its announced size."),
                fields={"length": str(length_bytes)},
            )
        try:
            fd = os.open(self.uploads / f"{upload_id}.part", os.O_WRONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise _offset_conflict(size)
        with os.fdopen(fd, "wb") as part:
            try:
                fcntl.flock(part, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise Conflict(_("Another part of this upload is arriving now."), code="upload_busy")
            held = os.fstat(part.fileno()).st_size
            if held != offset_bytes:
                raise _offset_conflict(held)
            part.seek(held)
            left = length_bytes
            while left:
                piece = body.read(min(COPY_BYTES, left))
                if not piece:
                    break
                part.write(piece)
                left -= len(piece)
            part.flush()
            if left:  # the connection ended early: keep the upload where it stood
                part.truncate(held)
                raise ValidationFailed(_("The part ended before its stated length."), code="upload_short")
            offset = held + length_bytes
            if offset == size:
                os.fsync(part.fileno())
                self._finish(upload_id, record)
        return Upload(upload_id, record["path"], size, offset)

    def _finish(self, upload_id: str, record: dict) -> None:
        """Move the whole file into the home at its path (parents made), the home's owner's, in one
        rename that never follows a link: one planted at the target is replaced, not written through."""
        path = record["path"]
        parts = path_parts(path)
        uploads_fd = os.open(self.uploads, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            home_fd = self._home_fd(record["folder"], create=True)
            try:
                owner = os.fstat(home_fd)
                parent = self._walk(home_fd, parts[:-1], path, create=True)
            finally:
                os.close(home_fd)
            try:
                source = f"{upload_id}.part"
                os.chmod(source, 0o644, dir_fd=uploads_fd)
                _give(source, owner, dir_fd=uploads_fd)
                try:
                    os.rename(source, parts[-1], src_dir_fd=uploads_fd, dst_dir_fd=parent)
                except (IsADirectoryError, NotADirectoryError):
                    raise Conflict(_("A folder of that name is in the way."), fields={"path": path})
            finally:
                os.close(parent)
            os.unlink(f"{upload_id}.json", dir_fd=uploads_fd)
        finally:
            os.close(uploads_fd)


class _Tally:
    """What a delete removed so far, counted as the agent counts (``Removed``)."""

    def __init__(self) -> None:
        self.bytes = 0
        self.entries = 0

    def add(self, info: os.stat_result) -> None:
        if info.st_nlink > 1 and not stat.S_ISDIR(info.st_mode):
            return  # another link keeps the inode, and the agent counts it there
        self.bytes += info.st_blocks * 512
        self.entries += 1


def _remove(parent: int, name: str, tally: _Tally) -> None:
    """Remove ``name`` under the folder open at ``parent``: unlink a file, a link or anything else not a
    folder; empty a folder (``_empty``), then remove it. Never follows a symbolic link: a folder swapped
    for a link between the read and the open is unlinked as the link it now is."""
    info = os.stat(name, dir_fd=parent, follow_symlinks=False)
    if stat.S_ISDIR(info.st_mode):
        try:
            fd = os.open(name, _DIR, dir_fd=parent)
        except OSError as exc:
            if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                raise
            info = os.stat(name, dir_fd=parent, follow_symlinks=False)
        else:
            _empty(fd, tally)
            os.rmdir(name, dir_fd=parent)
            tally.add(info)
            return
    os.unlink(name, dir_fd=parent)
    tally.add(info)


def _empty(top: int, tally: _Tally) -> None:
    """Remove everything under the folder open at ``top`` (and close it). Depth first without recursion
    (a tenant's tree may be deeper than Python's stack), one descriptor per level: each entry is read
    with ``lstat`` through its folder's descriptor and a folder opened ``O_NOFOLLOW`` from it. An entry
    gone meanwhile is skipped."""
    stack: list[tuple[int, str, os.stat_result | None]] = [(top, "", None)]
    try:
        while stack:
            fd = stack[-1][0]
            deeper = None
            with os.scandir(fd) as found:
                for item in found:
                    try:
                        info = item.stat(follow_symlinks=False)
                        if stat.S_ISDIR(info.st_mode):
                            try:
                                deeper = (os.open(item.name, _DIR, dir_fd=fd), item.name, info)
                                break
                            except OSError as exc:
                                if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                                    raise
                                info = os.stat(item.name, dir_fd=fd, follow_symlinks=False)  # swapped in
                        os.unlink(item.name, dir_fd=fd)
                    except FileNotFoundError:
                        continue
                    tally.add(info)
            if deeper is not None:
                stack.append(deeper)
                continue
            fd, name, info = stack.pop()
            os.close(fd)
            if stack:  # the top folder is removed by the caller, through its parent
                try:
                    os.rmdir(name, dir_fd=stack[-1][0])
                except FileNotFoundError:
                    continue  # gone meanwhile
                tally.add(info)
    finally:
        for fd, _name, _info in stack:
            os.close(fd)


def _give(name: str, owner: os.stat_result, *, dir_fd: int) -> None:
    """Make ``name`` the home owner's (the uid its sessions run as), where the portal may."""
    if os.geteuid() == 0 and owner.st_uid != 0:
        os.chown(name, owner.st_uid, owner.st_gid, dir_fd=dir_fd, follow_symlinks=False)


def _offset_conflict(held: int) -> Conflict:
    return Conflict(
        _("The upload stands at byte %(offset)s: resume from there.") % {"offset": held},
        code="upload_offset",
        fields={"offset": str(held)},
    )


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "folder"
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISLNK(mode):
        return "link"
    return "other"
