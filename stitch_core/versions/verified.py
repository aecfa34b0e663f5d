"""Files this process has verified against a manifest's SHA-256, so that each object is hashed
once on the following side.

`fetch_object` records a file once its bytes matched the manifest (hashed while checking the
download, or once at a cache hit); a reader opening it later (`PatchReader(...,
verified=identity(path, sha256))`) compares the identity with `fstat` of its own descriptor and
skips its own hash pass only on an exact match. The record lives in this process's memory only:
a marker on disk could be forged by whoever can write the cache. The identity is (device, inode,
size, mtime, ctime) in nanoseconds: writing to the file, replacing it, or `utime` (which sets
ctime to now) all change it. Another process, or this one after a restart, finds no record and
hashes once itself.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

Identity = tuple[int, int, int, int, int]

_lock = threading.Lock()
_verified: dict[str, tuple[Identity, str]] = {}
MAX_RECORDS = 65536  # a follower holds a few versions' parts; the oldest are dropped past this


def of_stat(st: os.stat_result) -> Identity:
    """The identity of a file from its stat result."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def record(path: Path, sha256: str) -> None:
    """`path`'s bytes (as they are now) matched `sha256`."""
    ident = of_stat(os.stat(path))
    with _lock:
        _verified.pop(str(path), None)
        _verified[str(path)] = (ident, sha256)
        while len(_verified) > MAX_RECORDS:
            _verified.pop(next(iter(_verified)))


def identity(path: Path, sha256: str | None) -> Identity | None:
    """The identity under which `path` was verified against `sha256` in this process, if it
    was and the file still has it (None: hash it)."""
    if sha256 is None:
        return None
    with _lock:
        got = _verified.get(str(path))
    if got is None or got[1] != sha256:
        return None
    try:
        now = of_stat(os.stat(path))
    except OSError:
        return None
    return got[0] if now == got[0] else None


def forget(path: Path) -> None:
    with _lock:
        _verified.pop(str(path), None)
