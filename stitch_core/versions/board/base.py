"""The board interface: immutable objects by key, plus a per-run `latest` pointer with CAS.

Keys are relative paths such as `run/versions/000042/manifest.json` (see
stitch_core.versions.manifest).
Everything here is async so one follower can drive HTTP, NATS and local boards alike; the
`versions` module builds publishing and reading versions on top of these few calls.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import os
import re
import stat
from abc import ABC, abstractmethod
from pathlib import Path
from typing import BinaryIO

from stitch_core.errors import StitchError
from stitch_core.versions.manifest import Latest

KEY_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9][A-Za-z0-9_.-]*)*$")


class BoardError(StitchError, RuntimeError):
    """Raised when a board operation fails; the base of every board error."""



class NotFoundError(BoardError):
    """Raised when a key names no object on the board."""



class TooLargeError(BoardError):
    """An object is larger than the reader's limit for it (a manifest, `latest`): refused
    without reading it whole."""


def too_large(key: str, size: int | None, limit: int) -> TooLargeError:
    """The error for `key` of `size` bytes (None: unknown, over `limit` so far)."""
    got = f"{size:,} bytes" if size is not None else "more"
    return TooLargeError(f"{key} is {got}, over the {limit:,}-byte limit for it")


class LatestConflictError(BoardError):
    """`latest` was not what the writer expected (a race) or the move would rewind it."""


class ReadOnlyBoardError(BoardError):
    """Raised on a write (put, move_latest, delete) to a read-only board."""


class BadCopyError(BoardError):
    """A board answered an object whose bytes are not the ones its manifest lists (size or
    SHA-256): a corrupted or tampered copy. The downloaded file is removed; a FallbackBoard
    fetches the object again from the next board (docs/relays.md)."""


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of the file at `path`."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(1 << 20):
            h.update(b)
    return h.hexdigest()


def check_copy(dest: Path, key: str, size: int, sha256: str, where: str) -> None:
    """BadCopyError (and `dest` removed) unless the file at `dest` is `size` bytes with SHA-256
    `sha256` (blocking: it hashes the file, only when the size is right)."""
    got = dest.stat().st_size
    digest = sha256_file(dest) if got == size else "-"
    if got != size or digest != sha256:
        dest.unlink(missing_ok=True)
        raise BadCopyError(f"{key} from {where}: {got} bytes, sha256 {digest[:12]}…; the manifest "
                      f"says {size}, {sha256[:12]}…")



def check_key(key: str) -> str:
    """`key` itself if it is a safe relative board key, else BoardError."""
    if not KEY_RE.match(key) or ".." in key.split("/"):
        raise BoardError(f"unsafe board key {key!r}")
    return key


class Board(ABC):
    """A store of immutable objects by key plus a per-run `latest` pointer (abstract, async)."""

    url: str
    readonly: bool = False

    @abstractmethod
    async def get(self, key: str, max_bytes: int | None = None) -> bytes:
        """Whole object; raises NotFoundError, or TooLargeError if it is over `max_bytes` (checked
        before it is read whole where the backend knows the size)."""

    async def get_file(self, key: str, dest: Path, size: int | None = None) -> None:
        """Stream an object to `dest` (written atomically). Backends may resume partial files."""
        data = await self.get(key)
        tmp = part_path(dest)
        with open_part(tmp) as f:
            f.write(data)
        tmp.replace(dest)

    async def get_verified(self, key: str, dest: Path, size: int, sha256: str) -> None:
        """`get_file`, then check the copy against the `size` and `sha256` a manifest lists;
        BadCopyError (nothing left at `dest`) if it differs. A FallbackBoard overrides it to fetch
        a bad copy again from the next board."""
        await self.get_file(key, dest, size=size)
        await asyncio.to_thread(check_copy, dest, key, size, sha256, self.url)

    async def get_refreshed(self, key: str, dest: Path, size: int) -> bool:
        """Fetch `key` again asking a caching replica (an HTTP relay) to replace its copy from
        its origin; False (nothing fetched) where this board keeps no copy to refresh."""
        return False

    @abstractmethod
    async def put(self, key: str, src: bytes | Path, *, sha256: str | None = None) -> None:
        """Store an immutable object durably. Rewriting a key with other content is an error.
        `sha256`: the content's digest where the caller already has it (a manifest's object
        entry, computed by the patch writer as it wrote), so a board that stores a digest
        beside the object (NATS) need not hash it again; readers check objects against the
        manifest either way."""

    @abstractmethod
    async def exists(self, key: str) -> bool: ...

    @abstractmethod
    async def read_latest(self, run: str) -> Latest | None: ...

    @abstractmethod
    async def move_latest(self, run: str, expected: int | None, new: Latest) -> None:
        """Compare-and-swap `latest` from `expected` to `new.version`; only forward.

        Raises LatestConflictError if the current value is not `expected` or new.version <= current.
        """

    async def list_versions(self, run: str) -> list[int] | None:
        """Versions present on the board, if the backend can list (None: it cannot)."""
        return None

    async def list_keys(self, prefix: str) -> list[str] | None:
        """Every key under the directory `prefix` (`run/versions/000042`: the keys that start
        with `prefix + "/"`), sorted, if the backend can list (None: it cannot, e.g. HTTP).
        Writable boards list: retention finds what to delete this way, never through an index
        a killed writer may have left behind (docs/versions.md)."""
        return None

    async def delete(self, key: str) -> None:
        """Remove an object (retention: `stitch gc`); no reader finds it once this returns, and
        a key that is not there is no error. Boards that cannot delete raise ReadOnlyBoardError."""
        raise ReadOnlyBoardError(f"board {self.url} cannot delete objects")

    async def close(self) -> None:  # noqa: B027 - optional hook
        pass

    async def __aenter__(self) -> Board:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


def part_path(dest: Path) -> Path:
    """Where a download of `dest` is written before it is renamed into place."""
    return dest.with_name(dest.name + ".part")


def part_size(tmp: Path) -> int:
    """Bytes already in a download's temporary file (to resume it); a symlink or anything but a
    regular file planted there is removed (never followed) and counts as nothing."""
    try:
        st = os.lstat(tmp)
    except FileNotFoundError:
        return 0
    if not stat.S_ISREG(st.st_mode):
        os.unlink(tmp)
        return 0
    return st.st_size


def open_part(tmp: Path, *, append: bool = False) -> BinaryIO:
    """Open a download's temporary file for writing (mode 0600) without following a symlink:
    a link planted at `tmp` is removed and the file created anew, so a download can never write
    through it into another file."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | (os.O_APPEND if append else os.O_TRUNC)
    for _ in range(2):
        try:
            fd = os.open(tmp, flags, 0o600)
        except OSError as e:
            if e.errno != errno.ELOOP:
                raise
            os.unlink(tmp)  # a symlink: remove the link itself, then create the file
            continue
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise BoardError(f"{tmp} is not a regular file")
        return os.fdopen(fd, "ab" if append else "wb")
    raise BoardError(f"{tmp}: could not be created without following a link")
