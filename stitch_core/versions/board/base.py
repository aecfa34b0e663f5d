"""The board interface: immutable objects by key, plus a per-run `latest` pointer with CAS.

Keys are relative paths such as `run/versions/000042/manifest.json` (see
stitch_core.versions.manifest).
Everything here is async so one follower can drive HTTP, NATS and local boards alike; the
`versions` module builds publishing and reading versions on top of these few calls.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from pathlib import Path

from stitch_core.errors import StitchError
from stitch_core.versions.manifest import Latest

KEY_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9][A-Za-z0-9_.-]*)*$")


class BoardError(StitchError, RuntimeError):
    """Raised when a board operation fails; the base of every board error."""



class NotFound(BoardError):
    """Raised when a key names no object on the board."""



class LatestConflict(BoardError):
    """`latest` was not what the writer expected (a race) or the move would rewind it."""


class ReadOnlyBoard(BoardError):
    """Raised on a write (put, move_latest) to a read-only board."""



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
    async def get(self, key: str) -> bytes:
        """Whole object; raises NotFound."""

    async def get_file(self, key: str, dest: Path, size: int | None = None) -> None:
        """Stream an object to `dest` (written atomically). Backends may resume partial files."""
        data = await self.get(key)
        tmp = dest.with_name(dest.name + ".part")
        tmp.write_bytes(data)
        tmp.replace(dest)

    @abstractmethod
    async def put(self, key: str, src: bytes | Path) -> None:
        """Store an immutable object durably. Rewriting a key with other content is an error."""

    @abstractmethod
    async def exists(self, key: str) -> bool: ...

    @abstractmethod
    async def read_latest(self, run: str) -> Latest | None: ...

    @abstractmethod
    async def move_latest(self, run: str, expected: int | None, new: Latest) -> None:
        """Compare-and-swap `latest` from `expected` to `new.version`; only forward.

        Raises LatestConflict if the current value is not `expected` or new.version <= current.
        """

    async def list_versions(self, run: str) -> list[int] | None:
        """Versions present on the board, if the backend can list (None: it cannot)."""
        return None

    async def close(self) -> None:  # noqa: B027 - optional hook
        pass

    async def __aenter__(self) -> Board:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
