"""The node-local cache of fetched objects: what it keeps, and pruning that never removes what is
in use.

Layout (written by `store.fetch_object`): `<cache>/<run>/<version:06d>/<object>`. Only such
version directories are ever pruned; anything else in the cache (the `pulled-*` directories of
`stitch publish`, lock files, other files) is neither counted nor touched.

**In use** is a shared `flock` on a version directory. A follower holds one on the version it is
fetching and applying (an engine loads a snapshot from that directory) and one on the version its
target holds; `stitch pull` holds the versions it reads. A hold is taken under the run's lock file
`<cache>/<run>/.lock` (exclusive, held briefly), and a pruner removes a directory only under that
same lock and only after taking an exclusive non-blocking lock on the directory itself, so a
directory someone holds is never removed and one being removed is never handed out. Locks die
with their process: a crashed follower leaves nothing held. Every process sharing a cache (two
engines on one host, a `stitch pull`) so protects what it uses; the cache must be on a local file
system (flock).

**What a follower keeps** (`prune`, after every step it applies): for a follower at version `H`
whose newest snapshot version is `S` (the newest version of kind snapshot it has reached, whether
it loaded its weights or applied its patch), the directories `S..H` of its run: the current
version and the newest snapshot plus what leads from it, which is what a restart or a catch-up
from there needs. Directories of its run below `S` are removed unless in use. Before the follower
has passed a snapshot, `S` is taken as `H`. Versions above `H` are left alone (another follower
sharing the cache may be there, or this one is about to need them) unless the cap needs room.

**The cap** (`max_bytes`, `STITCH_CACHE_MAX_BYTES`, default `DEFAULT_MAX_BYTES`) bounds the bytes
of all version directories in the cache (every run). Over it, unused directories are removed:
other runs' first, least recently modified first (left over by earlier runs), then this run's,
oldest version first, never the current one. What is in use is never removed, so the cap is a
bound on everything but that: a snapshot being loaded may exceed it on its own (logged).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import shutil
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from stitch_core.settings import CACHE_MAX_BYTES
from stitch_core.versions.manifest import RUN_RE, check_run

log = logging.getLogger("stitch.cache")

# one bf16 snapshot of an 8B model (16 GB) plus a few GB of patches; a bigger model's snapshot in
# use is never removed, so there the cache holds what is in use and little else
DEFAULT_MAX_BYTES = CACHE_MAX_BYTES  # STITCH_CACHE_MAX_BYTES's default
LOCK_NAME = ".lock"
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def version_name(version: int) -> str:
    """The cache directory name of a version (as `store.fetch_object` writes it)."""
    return f"{version:06d}"


@contextlib.contextmanager
def run_lock(run_dir: Path) -> Iterator[None]:
    """Hold the run directory's lock file (exclusive) for the body; the directory must exist."""
    fd = os.open(run_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


class Hold:
    """A shared lock on one version directory: while it is held no pruner removes it."""

    def __init__(self, fd: int, run: str, version: int, path: Path):
        self._fd: int | None = fd
        self._lock = threading.Lock()  # released from a follower's thread and from close/GC
        self.run, self.version, self.path = run, version, path

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Close the lock's descriptor once, whichever thread gets here first (a second close of
        the same number could close a descriptor another thread has since opened)."""
        with self._lock:
            fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def __enter__(self) -> Hold:
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # e.g. at interpreter shutdown
            self.release()


def hold(cache: str | os.PathLike, run: str, version: int, *, create: bool = True) -> Hold | None:
    """Hold `run` v`version`'s directory in `cache` (created if missing, unless `create` is
    false: then None when there is none). Blocks while a prune of the run is under way."""
    run_dir = Path(cache) / check_run(run)
    d = run_dir / version_name(version)
    if not create and not d.is_dir():
        return None
    run_dir.mkdir(parents=True, exist_ok=True)
    with run_lock(run_dir):
        if create:
            d.mkdir(exist_ok=True)
        try:
            fd = os.open(d, _DIR_FLAGS)
        except FileNotFoundError:  # removed meanwhile (create=False)
            return None
        fcntl.flock(fd, fcntl.LOCK_SH)  # never waits: pruners lock directories under run_lock
    return Hold(fd, run, version, d)


class CacheUse:
    """What one follower holds in a cache: the version it is fetching and applying (`busy`) and
    the version its target holds (`current`). Synchronous (call it in a thread: a hold may wait
    for a prune); `close` releases both."""

    def __init__(self, cache: str | os.PathLike, run: str):
        self.cache, self.run = Path(cache), check_run(run)
        self.busy: Hold | None = None
        self.current: Hold | None = None

    def begin(self, version: int) -> None:
        """About to fetch and apply `version`: hold it (the previous busy hold is released)."""
        new = hold(self.cache, self.run, version)
        if self.busy is not None:
            self.busy.release()
        self.busy = new

    def done(self, version: int) -> None:
        """The target now holds `version`: it becomes the current hold, nothing is busy."""
        if self.busy is not None and self.busy.version == version:
            new, self.busy = self.busy, None
        else:
            new = hold(self.cache, self.run, version, create=False)
        if self.current is not None:
            self.current.release()
        self.current = new

    def close(self) -> None:
        for h in (self.busy, self.current):
            if h is not None:
                h.release()
        self.busy = self.current = None


def version_dirs(run_dir: Path) -> dict[int, Path]:
    """The version directories of one run's cache directory (none if it does not exist)."""
    try:
        entries = list(os.scandir(run_dir))
    except (FileNotFoundError, NotADirectoryError):
        return {}
    return {int(e.name): Path(e.path) for e in entries
            if e.name.isascii() and e.name.isdigit() and e.is_dir(follow_symlinks=False)}


def cached_runs(cache: Path) -> list[str]:
    """Names of the run directories in `cache`."""
    try:
        entries = list(os.scandir(cache))
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(e.name for e in entries
                  if RUN_RE.match(e.name) and e.is_dir(follow_symlinks=False))


def dir_bytes(d: Path) -> int:
    """Bytes of the regular files under `d` (apparent sizes; links are not followed)."""
    total = 0
    try:
        entries = list(os.scandir(d))
    except (FileNotFoundError, NotADirectoryError):
        return 0
    for e in entries:
        try:
            if e.is_dir(follow_symlinks=False):
                total += dir_bytes(Path(e.path))
            elif e.is_file(follow_symlinks=False):
                total += e.stat(follow_symlinks=False).st_size
        except FileNotFoundError:
            continue
    return total


def cache_bytes(cache: str | os.PathLike) -> int:
    """Bytes of every version directory in `cache` (all runs): what the cap bounds."""
    c = Path(cache)
    return sum(dir_bytes(d) for r in cached_runs(c) for d in version_dirs(c / r).values())


def remove_unused(d: Path) -> bool:
    """Remove version directory `d` unless someone holds it; the caller holds its run's lock.
    True if it was removed."""
    try:
        fd = os.open(d, _DIR_FLAGS)
    except FileNotFoundError:
        return False
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):  # not a directory we made: leave it
            return False
        raise
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # in use
        shutil.rmtree(d)
        return True
    finally:
        os.close(fd)


@dataclass
class PruneReport:
    """What a prune removed: (run, version) directories and their bytes; `total` is the bytes of
    version directories left in the cache (None when no cap was given: not measured)."""

    removed: list[tuple[str, int]] = field(default_factory=list)
    freed: int = 0
    total: int | None = None
    max_bytes: int | None = None

    @property
    def over_cap(self) -> bool:
        """What is left is more than the cap (all of it in use, or not prunable)."""
        return self.max_bytes is not None and self.total is not None and \
            self.total > self.max_bytes


def prune(cache: str | os.PathLike, run: str, *, current: int | None,
          keep_from: int | None = None, max_bytes: int | None = DEFAULT_MAX_BYTES) -> PruneReport:
    """Prune `cache` for a follower of `run` whose target holds `current` and whose newest
    snapshot version is `keep_from` (see the module doc): `run`'s directories below
    `keep_from` (or below `current` without one), then, over `max_bytes` (None: no cap), unused
    directories of other runs and then of `run`. Never removes a held directory. Synchronous."""
    c = Path(cache)
    run_dir = c / check_run(run)
    report = PruneReport(max_bytes=max_bytes)
    if current is not None and run_dir.is_dir():
        lo = current if keep_from is None or keep_from > current else keep_from
        with run_lock(run_dir):
            for v, d in sorted(version_dirs(run_dir).items()):
                if v >= lo:
                    break
                n = dir_bytes(d)
                if remove_unused(d):
                    report.removed.append((run, v))
                    report.freed += n
    if max_bytes is None:
        return report
    sizes = {(r, v): (d, dir_bytes(d)) for r in cached_runs(c)
             for v, d in version_dirs(c / r).items()}
    total = sum(n for _, n in sizes.values())
    if total > max_bytes:
        def mtime(d: Path) -> float:
            try:
                return d.stat().st_mtime
            except FileNotFoundError:
                return 0.0

        others = sorted((k for k in sizes if k[0] != run), key=lambda k: mtime(sizes[k][0]))
        own = sorted(k for k in sizes if k[0] == run and k[1] != current)
        for r, v in others + own:
            if total <= max_bytes:
                break
            d, n = sizes[(r, v)]
            try:
                with run_lock(c / r):
                    gone = remove_unused(d)
            except FileNotFoundError:  # the run's directory went meanwhile
                gone = False
            if gone:
                total -= n
                report.removed.append((r, v))
                report.freed += n
    report.total = total
    return report
