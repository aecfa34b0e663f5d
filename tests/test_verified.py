"""Each patch object is hashed once on each side: the publisher lists the SHA-256 it computed
while writing; a follower that verified a download (or a cache hit) records the file's identity
in memory and the reader that opens it next does not hash it again, unless the file changed
(size, inode, mtime or ctime), which makes it hash, and refuse changed bytes."""

from __future__ import annotations

import asyncio
import hashlib
import os

import pytest
import torch

from stitch_core.format import stp
from stitch_core.versions import verified
from stitch_core.versions.board import LocalBoard
from stitch_core.versions.manifest import version_dir
from stitch_core.versions.store import fetch_object, read_manifest
from stitch_trainer.publisher import Publisher

RUN = "hash-once"


@pytest.fixture
def published(tmp_path):
    g = torch.Generator().manual_seed(0)
    w = {"a.weight": (torch.randn(256, 128, generator=g) * 0.02).bfloat16()}
    with Publisher(str(tmp_path / "board"), RUN, "bf16") as pub:
        pub.publish(0, w).result()
        w2 = {"a.weight": w["a.weight"].clone()}
        w2["a.weight"].view(-1)[::9] += 1
        pub.publish(1, w2).result()
    board = LocalBoard(tmp_path / "board")
    m = asyncio.run(read_manifest(board, RUN, 1))
    return board, m


def _count_sha256(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = hashlib.sha256

    def counting(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(stp.hashlib, "sha256", counting)
    return calls


def test_the_manifest_lists_the_hash_the_publisher_computed_while_writing(published):
    board, m = published
    (ref,) = m.patches
    data = (board.root / version_dir(RUN, m.version) / ref.path).read_bytes()
    assert hashlib.sha256(data).hexdigest() == ref.sha256 and ref.size == len(data)


def test_a_fetched_patch_is_not_hashed_again_unless_it_changed(published, tmp_path, monkeypatch):
    board, m = published
    (ref,) = m.patches
    path = asyncio.run(fetch_object(board, m, ref, tmp_path / "cache"))
    ident = verified.identity(path, ref.sha256)
    assert ident is not None
    calls = _count_sha256(monkeypatch)
    with stp.PatchReader(path, sha256=ref.sha256, verified=ident) as r:
        assert r.header.target_version == m.version
    assert calls == []  # verified at fetch: not hashed again
    assert verified.identity(path, "0" * 64) is None  # another digest: no record
    # the same bytes written again (new mtime/ctime): the record no longer holds, it hashes
    data = path.read_bytes()
    path.write_bytes(data)
    assert verified.identity(path, ref.sha256) is None
    with stp.PatchReader(path, sha256=ref.sha256, verified=ident):
        pass
    assert calls == [1]
    # one byte changed, mtime put back: ctime moved, so the stale identity is refused and the
    # hash catches the change
    st = os.stat(path)
    bad = bytearray(data)
    bad[len(bad) // 2] ^= 1
    path.write_bytes(bytes(bad))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(stp.PatchError, match="not the ones the manifest lists"):
        stp.PatchReader(path, sha256=ref.sha256, verified=ident)


def test_a_cache_hit_is_hashed_once_per_process(published, tmp_path, monkeypatch):
    board, m = published
    (ref,) = m.patches
    cache = tmp_path / "cache"
    path = asyncio.run(fetch_object(board, m, ref, cache))
    verified.forget(path)  # as a new process: the cache holds the file, memory no record
    hashes: list[int] = []
    from stitch_core.versions import store

    real = store.sha256_file
    monkeypatch.setattr(store, "sha256_file", lambda p: hashes.append(1) or real(p))
    assert asyncio.run(fetch_object(board, m, ref, cache)) == path
    assert asyncio.run(fetch_object(board, m, ref, cache)) == path
    assert hashes == [1]  # the first cache hit hashes; the second finds the record
