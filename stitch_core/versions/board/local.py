"""A board in a local directory: atomic temp+rename writes, fsync, flock-guarded CAS."""

from __future__ import annotations

import asyncio
import fcntl
import os
import shutil
from pathlib import Path

from stitch_core.versions.board.base import Board, BoardError, LatestConflict, NotFound, check_key
from stitch_core.versions.manifest import Latest, check_run, latest_key


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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

    async def get(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            raise NotFound(f"{key} not on board {self.url}") from None

    async def get_file(self, key: str, dest: Path, size: int | None = None) -> None:
        src = self._path(key)
        if not src.is_file():
            raise NotFound(f"{key} not on board {self.url}")
        tmp = dest.with_name(dest.name + ".part")
        await asyncio.to_thread(shutil.copyfile, src, tmp)
        tmp.replace(dest)

    def _put(self, key: str, src: bytes | Path) -> None:
        path = self._path(key)
        if path.exists():
            if _same_content(path, src):
                return
            raise BoardError(f"{key} already exists with other content (versions are immutable)")
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        if isinstance(src, Path):
            shutil.copyfile(src, tmp)
        else:
            tmp.write_bytes(src)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)

    async def put(self, key: str, src: bytes | Path) -> None:
        await asyncio.to_thread(self._put, key, src)

    async def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    async def read_latest(self, run: str) -> Latest | None:
        try:
            return Latest.model_validate_json(self._path(latest_key(run)).read_bytes())
        except FileNotFoundError:
            return None

    def _move(self, run: str, expected: int | None, new: Latest) -> None:
        path = self._path(latest_key(run))
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.parent / ".latest.lock", "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            cur = path.read_bytes() if path.exists() else None
            cur_v = Latest.model_validate_json(cur).version if cur else None
            if cur_v != expected:
                raise LatestConflict(f"latest of {run} is {cur_v}, expected {expected}")
            if cur_v is not None and new.version <= cur_v:
                raise LatestConflict(f"latest of {run} would move back from {cur_v} to "
                                     f"{new.version}")
            tmp = path.with_name(f".latest.tmp-{os.getpid()}")
            tmp.write_text(new.model_dump_json())
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(tmp, path)
            _fsync_dir(path.parent)

    async def move_latest(self, run: str, expected: int | None, new: Latest) -> None:
        check_run(run)
        await asyncio.to_thread(self._move, run, expected, new)

    async def list_versions(self, run: str) -> list[int]:
        d = self.root / check_run(run) / "versions"
        if not d.is_dir():
            return []
        return sorted(int(p.name) for p in d.iterdir()
                      if p.name.isdigit() and (p / "manifest.json").is_file())
