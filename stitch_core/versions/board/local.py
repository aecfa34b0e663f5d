"""A board in a local directory: create-only object writes (private temp file, fsync, link,
directory fsync), flock-guarded CAS of `latest` (temp file, fsync, rename, directory fsync).

Durability: a `put` returns once the object's data and its directory entry are on disk (and the
entries of any directory it created, up to the board root), so everything a version holds is
durable before `move_latest` writes the pointer, which is itself durable when it returns. On a
power loss the board therefore holds `latest` as of its last completed move and every object it
names (with a file system that honours fsync: a local one, not a network mount that lies)."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import shutil
import tempfile
from pathlib import Path

from stitch_core.versions.board.base import (
    Board,
    BoardError,
    LatestConflictError,
    NotFoundError,
    check_key,
    open_part,
    part_path,
    too_large,
)
from stitch_core.versions.manifest import MAX_LATEST_BYTES, Latest, check_run, latest_key


def fsync_dir(d: Path) -> None:
    """fsync a directory: the entries made in it (links, renames, new directories) are durable."""
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _makedirs(d: Path) -> None:
    """`mkdir -p d`, durably: every directory it creates has its entry fsynced in its parent
    (a version directory, the run's `versions/`, the run itself), so the objects and `latest`
    linked into them later cannot vanish with a directory that was never written out."""
    missing: list[Path] = []
    while not d.is_dir():
        missing.append(d)
        d = d.parent
    for p in reversed(missing):
        try:
            p.mkdir()
        except FileExistsError:  # made meanwhile by another writer (fsynced again: cheap)
            if not p.is_dir():
                raise
        fsync_dir(p.parent)


def _same_content(path: Path, src: bytes | Path) -> bool:
    if isinstance(src, Path):
        if path.stat().st_size != src.stat().st_size:
            return False
        with open(path, "rb") as a, open(src, "rb") as b:
            while True:
                x, y = a.read(1 << 20), b.read(1 << 20)
                if x != y:
                    return False
                if not x:
                    return True
    return path.read_bytes() == src


class LocalBoard(Board):
    """A board in the local directory `root`."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root).expanduser().resolve()
        self.url = str(self.root)

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    async def get(self, key: str, max_bytes: int | None = None) -> bytes:
        try:
            with open(self._path(key), "rb") as f:
                if max_bytes is not None:
                    size = os.fstat(f.fileno()).st_size
                    if size > max_bytes:
                        raise too_large(key, size, max_bytes)
                    return f.read(max_bytes + 1)
                return f.read()
        except FileNotFoundError:
            raise NotFoundError(f"{key} not on board {self.url}") from None

    async def get_file(self, key: str, dest: Path, size: int | None = None) -> None:
        src = self._path(key)
        if not src.is_file():
            raise NotFoundError(f"{key} not on board {self.url}")
        tmp = part_path(dest)

        def copy() -> None:
            with open(src, "rb") as s, open_part(tmp) as d:
                shutil.copyfileobj(s, d, 1 << 20)

        await asyncio.to_thread(copy)
        tmp.replace(dest)

    def _put(self, key: str, src: bytes | Path) -> None:
        """Create-only: the object is written to a private temporary file, fsynced, then linked
        into place, which fails atomically if the key exists, and its directory fsynced (new
        directories on the way are made durably, `_makedirs`). A second writer of the same key
        with other content gets a BoardError, never a silent replace (the same bytes again are
        accepted: a retried upload)."""
        path = self._path(key)
        if path.exists():
            if _same_content(path, src):
                _fsync_file(path)  # a retry after a crash: durable before we say so
                fsync_dir(path.parent)
                return
            raise BoardError(f"{key} already exists with other content (versions are immutable)")
        _makedirs(path.parent)
        fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        tmp = Path(name)
        try:
            with os.fdopen(fd, "wb") as f:
                if isinstance(src, Path):
                    with open(src, "rb") as s:
                        shutil.copyfileobj(s, f, 1 << 20)
                else:
                    f.write(src)
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(tmp, path)
            except FileExistsError:
                if _same_content(path, src):
                    _fsync_file(path)
                    fsync_dir(path.parent)
                    return
                raise BoardError(f"{key} already exists with other content: another writer "
                                 "stored it first (versions are immutable)") from None
            fsync_dir(path.parent)
        finally:
            tmp.unlink(missing_ok=True)

    async def put(self, key: str, src: bytes | Path, *, sha256: str | None = None) -> None:
        await asyncio.to_thread(self._put, key, src)

    async def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def _delete(self, key: str) -> None:
        path = self._path(key)
        try:
            path.unlink()
        except FileNotFoundError:
            return
        fsync_dir(path.parent)  # gone for good before the caller deletes what it lists
        with contextlib.suppress(OSError):  # the version directory, once empty
            path.parent.rmdir()

    async def delete(self, key: str) -> None:
        """Unlink the object (a reader that has it open keeps reading it); its directory goes
        with its last object."""
        await asyncio.to_thread(self._delete, key)

    async def read_latest(self, run: str) -> Latest | None:
        try:
            return Latest.model_validate_json(await self.get(latest_key(run), MAX_LATEST_BYTES))
        except NotFoundError:
            return None

    def _move(self, run: str, expected: int | None, new: Latest) -> None:
        path = self._path(latest_key(run))
        _makedirs(path.parent)
        with open(path.parent / ".latest.lock", "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            cur = path.read_bytes() if path.exists() else None
            cur_v = Latest.model_validate_json(cur).version if cur else None
            if cur_v != expected:
                raise LatestConflictError(f"latest of {run} is {cur_v}, expected {expected}")
            if cur_v is not None and new.version <= cur_v:
                raise LatestConflictError(f"latest of {run} would move back from {cur_v} to "
                                     f"{new.version}")
            fd, name = tempfile.mkstemp(dir=path.parent, prefix=".latest.", suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                f.write(new.model_dump_json())
                f.flush()
                os.fsync(f.fileno())
            os.replace(name, path)
            fsync_dir(path.parent)

    async def move_latest(self, run: str, expected: int | None, new: Latest) -> None:
        check_run(run)
        await asyncio.to_thread(self._move, run, expected, new)

    async def list_versions(self, run: str) -> list[int]:
        d = self.root / check_run(run) / "versions"
        if not d.is_dir():
            return []
        return sorted(int(p.name) for p in d.iterdir()
                      if p.name.isdigit() and (p / "manifest.json").is_file())

    async def list_keys(self, prefix: str) -> list[str]:
        """The keys of the files under the directory `prefix` (temporary and other dot files
        are not keys)."""
        d = self._path(prefix)

        def walk() -> list[str]:
            if not d.is_dir():
                return []
            out = []
            for dirpath, dirnames, files in os.walk(d):
                dirnames[:] = [n for n in dirnames if not n.startswith(".")]
                for name in files:
                    if not name.startswith("."):
                        out.append((Path(dirpath) / name).relative_to(self.root).as_posix())
            return sorted(out)

        return await asyncio.to_thread(walk)
