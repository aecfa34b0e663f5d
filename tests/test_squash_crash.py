"""`stitch squash` and `stitch gc` killed at any point leak no spans: the span documents (and
what the board lists in a version directory), not the rewritten `spans.json`, are the truth, so
a restarted squasher's retention and the next gc find whatever a killed one left.

The board is a real local directory; the kill is injected at the N-th write (put or delete) of
a squash round + a gc, for every N (the board refuses every write from then on, as a dead
process makes none), and once with a real child process SIGKILLed between the index's delete
and its rewrite (the failpoint `squash:after-index-delete`)."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from stitch_core.versions.board import LocalBoard
from stitch_core.versions.manifest import Latest, latest_key
from stitch_core.versions.retention import gc
from stitch_core.versions.span_index import span_bases
from stitch_core.versions.squash import Squasher
from stitch_trainer.publisher import Publisher

RUN = "crash"
HORIZON, KEEP_TARGETS, KEEP_SNAPSHOTS = 3, 2, 2


class Killed(BaseException):
    """The process died here (a BaseException: nothing in the code under test catches it)."""


class DyingBoard(LocalBoard):
    """A local board whose process dies at its `kill_at`-th write: that write and every later
    one never happen."""

    def __init__(self, root: Path, kill_at: int | None):
        super().__init__(root)
        self.kill_at, self.writes = kill_at, 0

    def _write(self) -> None:
        self.writes += 1
        if self.kill_at is not None and self.writes >= self.kill_at:
            raise Killed(f"write {self.writes}")

    async def put(self, key, src, *, sha256=None) -> None:
        self._write()
        await super().put(key, src, sha256=sha256)

    async def delete(self, key) -> None:
        self._write()
        await super().delete(key)


@pytest.fixture(scope="module")
def published(tmp_path_factory) -> tuple[Path, dict[int, bytes]]:
    """v0..v10 (snapshots every 4: v0, v4, v8) and each version's `latest` document."""
    root = tmp_path_factory.mktemp("crash") / "board"
    g = torch.Generator().manual_seed(0)
    masters = {f"w{i}": torch.randn(64, 96, generator=g) * 0.02 for i in range(2)}
    latest: dict[int, bytes] = {}
    with Publisher(str(root), RUN, "bf16", snapshot_every=4) as pub:
        for step in range(11):
            m = pub.publish(step, masters).result()
            latest[m.version] = (root / latest_key(RUN)).read_bytes()
            masters = {k: v + torch.randn(v.shape, generator=g) * 4e-6 for k, v in
                       masters.items()}
    return root, latest


def _at(root: Path, latest: dict[int, bytes], v: int) -> None:
    """Point `latest` at v (the versions after it play the part of versions not published yet:
    the squasher and gc never look past `latest`)."""
    assert Latest.model_validate_json(latest[v]).version == v
    (root / latest_key(RUN)).write_bytes(latest[v])


async def _squash(board, cache: Path) -> None:
    sq = Squasher(board, RUN, cache, horizon=HORIZON, keep_targets=KEEP_TARGETS, workers=1)
    while await sq.step() is not None:
        pass


def _files(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*")
                  if p.is_file() and not p.name.startswith("."))


async def _scenario(root: Path, latest: dict[int, bytes], cache: Path,
                    kill_at: int | None) -> tuple[list[str], int]:
    """Spans to v5 and v6, then (at latest v8) a squash round and a gc, killed at the
    `kill_at`-th write; then recovery: the run moves on to v10, a fresh squasher and a gc run
    to the end. The board's files after recovery, and the writes the killed part made."""
    _at(root, latest, 6)
    await _squash(LocalBoard(root), cache / "a")
    _at(root, latest, 8)
    dying = DyingBoard(root, kill_at)
    try:
        await _squash(dying, cache / "b")
        await gc(dying, RUN, keep_snapshots=KEEP_SNAPSHOTS)
    except Killed:
        pass
    _at(root, latest, 10)
    board = LocalBoard(root)
    await _squash(board, cache / "c")
    await gc(board, RUN, keep_snapshots=KEEP_SNAPSHOTS)
    return _files(root), dying.writes


async def test_squash_and_gc_killed_at_every_write_leak_nothing(published, tmp_path):
    src, latest = published
    ref_root = tmp_path / "ref"
    shutil.copytree(src, ref_root)
    want, writes = await _scenario(ref_root, latest, tmp_path / "cache-ref", None)
    # what a run without a kill leaves: versions from the cut (v4) on, spans only to the two
    # newest targets, each index naming exactly its documents
    spans = [f for f in want if "/span" in f]
    assert {f.split("/")[2] for f in spans} == {"000009", "000010"}, spans
    assert not any(f.split("/")[2] < "000004" for f in want if "/versions/" in f)
    board = LocalBoard(ref_root)
    assert await span_bases(board, RUN, 10) == [7, 8]
    assert writes > 20  # the killed part: spans to v7 and v8, v5's and v6's deleted, a gc
    for kill_at in range(1, writes + 1):
        root = tmp_path / f"k{kill_at}"
        shutil.copytree(src, root)
        got, _ = await _scenario(root, latest, tmp_path / f"cache{kill_at}", kill_at)
        assert got == want, (kill_at, sorted(set(got) ^ set(want)))
        shutil.rmtree(root)


def test_a_squasher_sigkilled_between_index_delete_and_put_leaks_nothing(published, tmp_path):
    """A real `stitch squash` child killed (SIGKILL) after it deleted v7's `spans.json` for a
    rewrite (restarted with a longer horizon, it added a span to v7) and before it put the new
    one: a restarted squasher's retention and a gc still find and delete every span to v7."""
    src, latest = published
    root = tmp_path / "board"
    shutil.copytree(src, root)
    _at(root, latest, 8)

    def squash_child(horizon: int, failpoint: str = "") -> int:
        env = {**os.environ, "STITCH_FAILPOINTS": failpoint}
        return subprocess.run([sys.executable, "-m", "stitch_core.cli", "squash", str(root),
                               "--run", RUN, "--once", "--horizon", str(horizon),
                               "--cache-dir", str(tmp_path / "cache")], env=env,
                              capture_output=True, timeout=120).returncode

    assert squash_child(HORIZON) == 0
    v7 = root / RUN / "versions" / "000007"
    assert (v7 / "spans.json").is_file() and not (v7 / "span-000004.json").exists()
    assert squash_child(HORIZON + 1, "squash:after-index-delete") == -9
    assert not (v7 / "spans.json").exists() and (v7 / "span-000004.json").is_file()
    _at(root, latest, 10)

    async def recover():
        board = LocalBoard(root)
        await _squash(board, tmp_path / "c2")
        await gc(board, RUN, keep_snapshots=KEEP_SNAPSHOTS)

    asyncio.run(recover())
    spans = [f for f in _files(root) if "/span" in f]
    assert {f.split("/")[2] for f in spans} == {"000009", "000010"}, spans


async def test_nats_board_lists_span_files_and_deletes_what_a_killed_writer_left(nats_server):
    """The NATS board lists keys too (its bucket's metadata subjects): an orphaned span object
    and a stale index are found and deleted through the listing, not the index."""
    import uuid

    from stitch_core.versions.board.nats import NatsBoard
    from stitch_core.versions.manifest import span_index_key, span_key
    from stitch_core.versions.span_index import delete_spans, span_targets, write_span_index

    b = NatsBoard(f"{nats_server.url}/l{uuid.uuid4().hex[:8]}", timeout=5)
    try:
        vdir = f"{RUN}/versions/000007"
        await b.put(f"{vdir}/manifest.json", b"{}")
        await b.put(f"{vdir}/span-000003.stp", b"orphan: its document never written")
        await b.put(span_key(RUN, 7, 4), b"{}")
        await b.put(f"{vdir}/span-000004.stp", b"x")
        await b.put(f"{RUN}/versions/000070/patch.stp", b"y")  # another directory, same prefix
        assert await b.list_keys(vdir) == [f"{vdir}/manifest.json", f"{vdir}/span-000003.stp",
                                           f"{vdir}/span-000004.json", f"{vdir}/span-000004.stp"]
        assert await write_span_index(b, RUN, 7) == [4]  # from the documents
        assert await span_bases(b, RUN, 7) == [4] and await span_targets(b, RUN) == [7]
        assert await b.exists(span_index_key(RUN, 7))
        assert await delete_spans(b, RUN, 7) == 4
        assert await b.list_keys(vdir) == [f"{vdir}/manifest.json"]
        assert await span_targets(b, RUN) == []
    finally:
        await b.close()
