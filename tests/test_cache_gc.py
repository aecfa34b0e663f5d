"""Bounded disk: the follower's cache keeps only what serving and catching up need (within a cap,
never removing what is in use), and board retention (`stitch gc`, `Publisher(keep_snapshots=)`)
deletes old versions without breaking any follower's path from the newest snapshots.

Real files, real boards (local and a real nats-server), a real AdamW-trained model; every
follower checked bit for bit."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from stitch_core.cli.main import main
from stitch_core.format import fingerprint as fpr
from stitch_core.node import Settings
from stitch_core.versions.board import LocalBoard, NotFoundError, ReadOnlyBoardError, open_board
from stitch_core.versions.board.http import HttpBoard
from stitch_core.versions.cache import (
    DEFAULT_MAX_BYTES,
    cache_bytes,
    dir_bytes,
    hold,
    prune,
    version_dirs,
)
from stitch_core.versions.follower import Follower
from stitch_core.versions.manifest import latest_key, manifest_key
from stitch_core.versions.memory_replica import MemoryReplica
from stitch_core.versions.retention import gc
from stitch_core.versions.store import list_manifests
from stitch_core.versions.trust import TrustSet, new_key
from stitch_trainer.publisher import Publisher

from .test_versions import TinyLM, bf16_view

RUN = "gc"
N = 30
EVERY = 8  # snapshots at 0, 8, 16, 24


def train(board: str, run: str, n: int, every: int, **kw) -> list[dict[str, torch.Tensor]]:
    """Publish `n` AdamW steps of TinyLM (a snapshot every `every`); the bf16 view of each."""
    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    views = []
    with Publisher(board, run, "bf16", snapshot_every=every, **kw) as pub:
        for step in range(n):
            x = torch.randint(0, 512, (4, 12))
            loss = torch.nn.functional.cross_entropy(model(x)[:, :-1].reshape(-1, 512),
                                                     x[:, 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            info = pub.publish(step, model)
            views.append(bf16_view(model))
            assert info.version == step
        pub.flush()
    return views


@pytest.fixture(scope="module")
def published(tmp_path_factory) -> tuple[Path, list[dict[str, torch.Tensor]]]:
    root = tmp_path_factory.mktemp("gc")
    views = train(str(root / "board"), RUN, N, EVERY)
    return root / "board", views


def same(replica: MemoryReplica, view: dict[str, torch.Tensor]) -> bool:
    return replica.fingerprints == fpr.state_fingerprints(view) and replica.tensors.keys() == \
        view.keys() and all(torch.equal(replica.tensors[k].view(torch.int16),
                                        view[k].view(torch.int16)) for k in view)


def holding(view: dict[str, torch.Tensor]) -> MemoryReplica:
    r = MemoryReplica()
    r.tensors = {k: v.clone() for k, v in view.items()}
    r.fingerprints = fpr.state_fingerprints(view)
    return r


def cached(cache: Path, run: str = RUN) -> list[int]:
    return sorted(version_dirs(cache / run))


def copy_board(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def board_versions(board: Path, run: str = RUN) -> list[int]:
    return sorted(int(p.name) for p in (board / run / "versions").iterdir())


# ------------------------------------------------------------------ the follower's cache


async def test_follower_cache_keeps_the_current_version_and_the_newest_snapshots_chain(
        published, tmp_path):
    board, views = published
    cache = tmp_path / "cache"
    replica = MemoryReplica()
    f = Follower(str(board), RUN, replica, cache_dir=cache)
    for v in range(N):  # step through every version: the cache never holds more than needed
        await f.catch_up(v)
        assert f.version == v and same(replica, views[v])
        snap = v - v % EVERY  # the newest snapshot version at or before v
        assert cached(cache) == list(range(snap, v + 1)), v
    # only v0's weights were ever fetched (later snapshot versions came as their patches), and
    # v0 went once the follower passed snapshot version 8
    assert not list(cache.rglob("*.safetensors"))
    assert sorted(p.name for p in (cache / RUN).iterdir()) == \
        [".lock"] + [f"{v:06d}" for v in range(24, N)]
    await f.stop()

    # a newcomer loads the newest snapshot and its patches: exactly what is kept
    fresh = tmp_path / "fresh"
    r2 = MemoryReplica()
    f2 = Follower(str(board), RUN, r2, cache_dir=fresh)
    assert await f2.sync() == N - 1 and same(r2, views[-1])
    assert f2.applied == list(range(24, N)) and cached(fresh) == list(range(24, N))
    assert list((fresh / RUN / "000024").glob("*.safetensors"))
    await f2.stop()


@pytest.mark.parametrize("cap", [1, 150_000, 600_000])
async def test_cache_cap_holds_while_following_bit_exact(published, tmp_path, cap):
    board, views = published
    cache = tmp_path / "cache"
    # leftovers of an earlier run and things that are not version directories
    (cache / "oldrun" / "000003").mkdir(parents=True)
    (cache / "oldrun" / "000003" / "model.safetensors").write_bytes(b"x" * 300_000)
    (cache / "oldrun" / "pulled-000003").mkdir()
    (cache / "oldrun" / "pulled-000003" / "model.safetensors").write_bytes(b"y" * 300_000)
    (cache / "notes.txt").write_text("not a version")
    replica = MemoryReplica()
    f = Follower(str(board), RUN, replica, cache_dir=cache, cache_max_bytes=cap)
    for v in range(N):  # through every version from scratch (v0 is a snapshot)
        await f.catch_up(v)
        assert f.version == v and same(replica, views[v])
        total = cache_bytes(cache)
        current = dir_bytes(cache / RUN / f"{v:06d}")
        # within the cap, or nothing left but the current version (in use)
        assert total <= cap or (total == current and cached(cache) == [v]), (v, total, cap)
        if cap < 600_000:
            assert not (cache / "oldrun" / "000003").exists()  # unused: went first
        elif v == 0:  # 300 kB of leftovers + the 200 kB snapshot: within the cap, all kept
            assert (cache / "oldrun" / "000003").exists() and cached(cache) == [0]
    # the leftovers went as soon as room was needed, before anything of the run followed
    assert not (cache / "oldrun" / "000003").exists()
    if cap == 600_000:  # the run's own rule alone: the newest snapshot version and its chain
        assert cached(cache) == list(range(24, N))
    # never touched: what is not a version directory
    assert (cache / "oldrun" / "pulled-000003" / "model.safetensors").stat().st_size == 300_000
    assert (cache / "notes.txt").read_text() == "not a version"
    await f.stop()


async def test_default_cap_leaves_other_runs_alone(published, tmp_path):
    board, views = published
    cache = tmp_path / "cache"
    (cache / "oldrun" / "000003").mkdir(parents=True)
    (cache / "oldrun" / "000003" / "patch.stp").write_bytes(b"x" * 1000)
    f = Follower(str(board), RUN, MemoryReplica(), cache_dir=cache)
    assert f.cache_max_bytes == DEFAULT_MAX_BYTES == Settings().cache_max_bytes
    assert await f.sync() == N - 1
    assert (cache / "oldrun" / "000003" / "patch.stp").exists()
    await f.stop()
    assert Settings.from_env({"STITCH_CACHE_MAX_BYTES": "8GiB"}).cache_max_bytes == 8 << 30
    assert Settings.from_env({"STITCH_CACHE_MAX_BYTES": "12345"}).cache_max_bytes == 12345


class Gated:
    """An apply target that waits for `go` before each step (a follower mid-apply)."""

    def __init__(self) -> None:
        self.replica = MemoryReplica()
        self.go = asyncio.Event()
        self.waiting = asyncio.Event()

    async def __call__(self, step, path):
        self.waiting.set()
        await self.go.wait()
        assert path.exists(), f"{path} removed while in use"
        await self.replica(step, path)


async def test_an_object_in_use_is_never_removed(published, tmp_path):
    """Two followers share one cache: B is loading snapshot 16 (slow), A races to latest with a
    cap of one byte. A prunes everything it can, never B's snapshot; B then finishes bit for
    bit."""
    board, views = published
    cache = tmp_path / "cache"
    gated = Gated()
    b = Follower(str(board), RUN, gated, cache_dir=cache, engine_id="b")
    task = asyncio.create_task(b.catch_up(20))  # plan: snapshot 16, patches 17..20
    await asyncio.wait_for(gated.waiting.wait(), 30)
    snap16 = cache / RUN / "000016"
    weights = sorted(snap16.glob("*.safetensors"))
    assert weights
    a_rep = MemoryReplica()
    a = Follower(str(board), RUN, a_rep, cache_dir=cache, cache_max_bytes=1, engine_id="a")
    for v in range(N):  # A steps through everything, pruning after each step
        await a.catch_up(v)
        assert same(a_rep, views[v])
        assert sorted(snap16.glob("*.safetensors")) == weights  # B's, in use: kept
    assert cached(cache) == [16, N - 1]  # B's busy snapshot and A's current version
    gated.go.set()
    await asyncio.wait_for(task, 30)
    assert b.version == 20 and same(gated.replica, views[20])
    # B moved on to 20; its snapshot is its newest snapshot (kept by B's rule, no cap)
    assert cached(cache) == [16, 17, 18, 19, 20, N - 1]
    await a.stop()
    await b.stop()


def test_holds_across_processes_and_die_with_them(tmp_path):
    cache = tmp_path / "cache"
    for v in (1, 2, 3):
        (cache / RUN / f"{v:06d}").mkdir(parents=True)
        (cache / RUN / f"{v:06d}" / "patch.stp").write_bytes(b"p" * 100)
    code = ("import sys, time; from stitch_core.versions.cache import hold; "
            f"h = hold({str(cache)!r}, {RUN!r}, 2); print('held', flush=True); "
            "sys.stdin.readline()")
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "held"
        r = prune(cache, RUN, current=3, keep_from=None, max_bytes=0)
        assert r.removed == [(RUN, 1)] and cached(cache) == [2, 3] and r.over_cap
        local = hold(cache, RUN, 3)  # this process holds 3 as well
        r = prune(cache, RUN, current=None, max_bytes=0)
        assert r.removed == [] and cached(cache) == [2, 3]
        local.release()
    finally:
        child.kill()  # a crashed holder: its lock dies with it
        child.wait()
    r = prune(cache, RUN, current=None, max_bytes=0)
    assert sorted(r.removed) == [(RUN, 2), (RUN, 3)] and cached(cache) == []
    assert r.freed == 200 and r.total == 0 and not r.over_cap


# ------------------------------------------------------------------ board retention


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


async def arun_cli(capsys, *argv: str) -> tuple[int, str, str]:
    """`run_cli` from a test's event loop (the command runs its own)."""
    return await asyncio.to_thread(run_cli, capsys, *argv)


async def test_gc_keeps_the_newest_snapshots_and_their_chains(published, tmp_path, capsys):
    src, views = published
    board = copy_board(src, tmp_path / "board")
    latest_before = (board / latest_key(RUN)).read_bytes()
    sizes = {v: dir_bytes(board / RUN / "versions" / f"{v:06d}") for v in range(N)}

    rc, out, _ = await arun_cli(capsys, "gc", str(board), "--run", RUN, "--keep-snapshots", "2",
                         "--dry-run", "--json")
    r = json.loads(out)
    assert rc == 0 and r["dry_run"] and r["kept_snapshots"] == [24, 16] and r["cut"] == 16
    assert [d["version"] for d in r["deleted"]] == list(range(16))
    assert r["bytes_freed"] == sum(sizes[v] for v in range(16))
    assert board_versions(board) == list(range(N))  # a dry run deletes nothing

    rc, out, _ = await arun_cli(capsys, "gc", str(board), "--run", RUN, "--keep-snapshots", "2")
    assert rc == 0 and "deleted 16 versions below v16" in out and "kept snapshots v24, v16" in out
    assert board_versions(board) == list(range(16, N))
    assert (board / latest_key(RUN)).read_bytes() == latest_before  # latest never moves
    assert [m.version for m in await list_manifests(LocalBoard(board), RUN)] == \
        list(range(16, N))

    # every follower at a kept version reaches latest bit for bit through its chain
    for start in range(16, N):
        rep = holding(views[start])
        f = Follower(str(board), RUN, rep, version=start, cache_dir=tmp_path / f"c{start}")
        assert await f.sync() == N - 1 and same(rep, views[-1])
        assert f.applied == list(range(start + 1, N))
        await f.stop()
    # a newcomer (the newest snapshot) and a follower whose version was deleted (the oldest
    # kept snapshot its broken chain reaches) start from a kept snapshot
    for start, first in ((None, 24), (5, 16)):
        rep = MemoryReplica() if start is None else holding(views[start])
        f = Follower(str(board), RUN, rep, version=start, cache_dir=tmp_path / f"n{start}")
        assert await f.sync() == N - 1 and same(rep, views[-1])
        assert f.applied == list(range(first, N))
        await f.stop()

    # again: nothing more to delete; K beyond the snapshots there are: nothing deleted
    rc, out, _ = await arun_cli(capsys, "gc", str(board), "--run", RUN, "--keep-snapshots", "2",
                         "--json")
    assert json.loads(out)["deleted"] == []
    rc, out, _ = await arun_cli(capsys, "gc", str(board), "--run", RUN, "--keep-snapshots", "3",
                         "--json")
    r = json.loads(out)
    assert r["deleted"] == [] and r["kept_snapshots"] == [24, 16] and "breaks at v15" in r["reason"]
    rc, out, _ = await arun_cli(capsys, "gc", str(board), "--run", RUN, "--keep-snapshots", "1")
    assert rc == 0 and board_versions(board) == list(range(24, N))
    assert (board / latest_key(RUN)).read_bytes() == latest_before


async def test_gc_refusals(published, tmp_path, capsys):
    src, _ = published
    board = copy_board(src, tmp_path / "board")
    with pytest.raises(SystemExit) as e:  # K < 1: refused by the command line
        await asyncio.to_thread(main, ["gc", str(board), "--run", RUN, "--keep-snapshots", "0"])
    assert e.value.code == 2 and "at least 1" in capsys.readouterr().err
    with pytest.raises(ValueError, match="at least 1"):
        await gc(LocalBoard(board), RUN, 0)
    # an HTTP board is read-only: refused clearly, before anything is read
    rc, _, err = await arun_cli(capsys, "gc", "http://127.0.0.1:9/board", "--run", RUN,
                         "--keep-snapshots", "1")
    assert rc == 1 and "read-only" in err
    with pytest.raises(ReadOnlyBoardError, match="read-only"):
        await HttpBoard("http://127.0.0.1:9/board").delete(manifest_key(RUN, 0))
    # with a trust set, unsigned snapshots do not count: nothing goes
    pub = new_key(tmp_path / "k")
    r = await gc(LocalBoard(board), RUN, 1, trust=TrustSet.parse([pub.text]))
    assert r.deleted == [] and r.kept_snapshots == [] and "breaks at v29" in r.reason
    assert board_versions(board) == list(range(N))
    # a run without versions: nothing to do
    r = await gc(LocalBoard(board), "nothing", 1)
    assert r.latest is None and r.deleted == []


async def test_local_board_delete(tmp_path):
    b = LocalBoard(tmp_path / "b")
    key = f"{RUN}/versions/000001/patch.stp"
    await b.put(key, b"data")
    await b.delete(key)
    assert not await b.exists(key) and not (tmp_path / "b" / RUN / "versions" / "000001").exists()
    await b.delete(key)  # not there: no error
    with pytest.raises(NotFoundError):
        await b.get(key)


def test_publisher_keeps_snapshots(tmp_path):
    board = tmp_path / "board"
    views = train(str(board), "pk", 20, 4, keep_snapshots=2)  # snapshots 0, 4, 8, 12, 16
    assert board_versions(board, "pk") == list(range(12, 20))

    async def follow() -> MemoryReplica:
        rep = MemoryReplica()
        f = Follower(str(board), "pk", rep, cache_dir=tmp_path / "c")
        await f.sync()
        await f.stop()
        return rep

    assert same(asyncio.run(follow()), views[-1])
    with pytest.raises(ValueError, match="at least 1"):
        Publisher(str(board), "pk", "bf16", keep_snapshots=0)


async def test_gc_on_a_nats_board(nats_server, tmp_path):
    url = f"{nats_server.url}/gc{uuid.uuid4().hex[:8]}"
    views = await asyncio.to_thread(train, url, RUN, 12, 4)  # snapshots 0, 4, 8
    board = open_board(url)
    try:
        latest = await board.read_latest(RUN)
        doomed = [m for m in await list_manifests(board, RUN) if m.version < 8]
        r = await gc(board, RUN, 2, dry_run=True)
        assert r.cut == 4 and [d.version for d in r.deleted] == [0, 1, 2, 3]
        assert await board.list_versions(RUN) == list(range(12))
        r = await gc(board, RUN, 1)
        assert r.kept_snapshots == [8] and [d.version for d in r.deleted] == list(range(8))
        assert await board.list_versions(RUN) == list(range(8, 12))
        assert await board.read_latest(RUN) == latest
        for m in doomed:  # the manifest and every object are gone
            for key in [manifest_key(RUN, m.version)] + \
                    [f"{RUN}/versions/{m.version:06d}/{o.path}" for o in m.objects]:
                assert not await board.exists(key)
                with pytest.raises(NotFoundError):
                    await board.get(key)
        await board.delete(manifest_key(RUN, 0))  # not there: no error
        for start in (None, 3, 9):
            rep = MemoryReplica() if start is None else holding(views[start])
            f = Follower(url, RUN, rep, version=start, cache_dir=tmp_path / f"c{start}")
            assert await f.sync() == 11 and same(rep, views[-1])
            assert f.applied == ([10, 11] if start == 9 else [8, 9, 10, 11])
            await f.stop()
    finally:
        await board.close()


def test_stitch_publish_keeps_snapshots_and_drops_pulled_dirs(tmp_path, capsys):
    """`stitch publish --keep-snapshots`: gc after each snapshot; the materialised base of each
    publish (`pulled-N`) is removed once a newer version is on the board."""
    from safetensors.torch import save_file

    board, cache = tmp_path / "board", tmp_path / "cache"
    torch.manual_seed(0)
    model = TinyLM()
    for step in range(7):
        with torch.no_grad():
            model.up.weight[step] += 0.5
        src = tmp_path / f"m{step}.safetensors"
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, src)
        rc, out, err = run_cli(capsys, "publish", str(board), str(src), "--run", "cli",
                               "--snapshot-every", "3", "--keep-snapshots", "1", "--cache-dir",
                               str(cache), "--json")
        assert rc == 0, err
        assert json.loads(out)["version"] == step
        assert not list((cache / "cli").glob("pulled-*"))
    assert board_versions(board, "cli") == [6]  # snapshots 0, 3, 6: only the newest kept
