"""Squashed spans (stitch_core.versions.squash): `stitch squash` writes, for each new version,
a span from each of the `horizon` versions before it; the planner takes one when it is the
cheapest path; a follower k behind applies it in one step and holds the exact version; spans
are signed, and a forged, unsigned or corrupt one is never used (the chain is)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from stitch_core.format.patch import diff
from stitch_core.versions.board import LocalBoard
from stitch_core.versions.follower import Follower
from stitch_core.versions.manifest import span_key
from stitch_core.versions.memory_replica import MemoryReplica
from stitch_core.versions.span_index import span_bases
from stitch_core.versions.squash import Squasher
from stitch_core.versions.store import path_bytes, plan, read_span
from stitch_core.versions.trust import SigningKey, TrustSet, new_key
from stitch_trainer.publisher import Publisher

RUN = "squash"


def _publish(board: Path, n: int, *, pub_kw=None) -> list[dict[str, torch.Tensor]]:
    """`n` versions of a small model under a random-walk update (flips that flip back, as
    Adam's at RL learning rates do); the served (bf16) views published."""
    g = torch.Generator().manual_seed(0)
    masters = {f"layer{i}.w": torch.randn(96, 128, generator=g) * 0.02 for i in range(4)}
    masters["norm"] = torch.ones(128)
    views = []
    with Publisher(str(board), RUN, "bf16", snapshot_every=0, **(pub_kw or {})) as pub:
        for step in range(n):
            pub.publish(step, masters).result()
            views.append({k: v.to(torch.bfloat16) for k, v in masters.items()})
            masters = {k: v + torch.randn(v.shape, generator=g) * 4e-6 for k, v in
                       masters.items()}
    return views


def _equal(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k].view(torch.int16),
                                                    b[k].view(torch.int16)) for k in a)


def _direct_bytes(a, b) -> int:
    """Bytes of a direct diff of two views (what a span must come close to)."""
    return len(diff(a, b).to_bytes())


async def _squash_all(sq: Squasher) -> list:
    out = []
    while (r := await sq.step()) is not None:
        out.append(r)
    return out


async def test_spans_to_latest_are_the_net_difference_and_the_planner_takes_them(tmp_path):
    board_dir = tmp_path / "board"
    views = _publish(board_dir, 12)  # v0 snapshot, v1..v11 patches
    board = LocalBoard(board_dir)
    sq = Squasher(board, RUN, tmp_path / "cache", horizon=8)
    await _squash_all(sq)
    assert sq.version == 11
    bases = await span_bases(board, RUN, 11)
    assert bases == list(range(3, 10))  # 8 back, without v10 (v11's own patch)
    for k in (2, 3, 5, 8):
        have = 11 - k
        steps = await plan(board, RUN, have, 11)
        assert [s.label for s in steps] == ["span"], k
        chain = await plan(board, RUN, have, 11, spans=False)
        assert [s.label for s in chain] == ["patch"] * k
        direct = _direct_bytes(views[have], views[11])
        assert path_bytes(steps) <= 1.25 * direct, (k, path_bytes(steps), direct)
        assert path_bytes(steps) < path_bytes(chain)
        # a follower k behind: one step, the exact version
        rep = MemoryReplica()
        f = Follower(str(board_dir), RUN, rep, cache_dir=tmp_path / f"c{k}")
        await f.catch_up(have)
        n = len(f.history)
        await f.catch_up(11)
        assert f.version == 11 and _equal(rep.tensors, views[11])
        assert len(f.history) == n + 1
        await f.stop()
    # beyond the horizon: no span from there, the chain
    steps = await plan(board, RUN, 1, 11)
    assert all(s.label == "patch" for s in steps) and len(steps) == 10


async def test_squash_follows_new_versions_and_deletes_old_targets(tmp_path):
    board_dir = tmp_path / "board"
    board = LocalBoard(board_dir)
    sq = Squasher(board, RUN, tmp_path / "cache", horizon=4, keep_targets=2)
    g = torch.Generator().manual_seed(0)
    masters = {f"w{i}": torch.randn(96, 128, generator=g) * 0.02 for i in range(3)}
    views = []
    with Publisher(str(board_dir), RUN, "bf16", snapshot_every=0) as pub:
        for step in range(9):
            pub.publish(step, masters).result()
            views.append({k: v.to(torch.bfloat16) for k, v in masters.items()})
            masters = {k: v + torch.randn(v.shape, generator=g) * 4e-6 for k, v in
                       masters.items()}
            if step == 5:
                await _squash_all(sq)
                assert await span_bases(board, RUN, 5) == [1, 2, 3]
    reports = await _squash_all(sq)
    assert [r.version for r in reports] == [8]  # one round walks every new version
    assert await span_bases(board, RUN, 8) == [4, 5, 6]
    # only the newest keep_targets targets keep spans
    assert await span_bases(board, RUN, 7) == [3, 4, 5]
    assert await span_bases(board, RUN, 6) == []
    assert not (board_dir / RUN / "versions" / "000006" / "span-000003.stp").exists()
    assert (board_dir / RUN / "versions" / "000006" / "patch.stp").exists()
    # the spans to the newest reconstruct it exactly
    rep = MemoryReplica()
    f = Follower(str(board_dir), RUN, rep, cache_dir=tmp_path / "c")
    await f.catch_up(4)
    n = len(f.history)
    await f.catch_up(8)
    assert _equal(rep.tensors, views[8]) and len(f.history) == n + 1
    await f.stop()


async def test_signed_spans_and_what_a_trust_set_refuses(tmp_path):
    key = tmp_path / "k"
    pub = new_key(key)
    trust = TrustSet.parse([pub.text])
    board_dir = tmp_path / "board"
    views = _publish(board_dir, 6, pub_kw={"signing_key": str(key)})
    board = LocalBoard(board_dir)
    await _squash_all(Squasher(board, RUN, tmp_path / "cache", horizon=4, trust=trust,
                               signer=SigningKey.load(key)))
    sp = await read_span(board, RUN, 5, 2, trust)
    assert sp is not None and sp.signed_by == pub.id
    assert [s.label for s in await plan(board, RUN, 2, 5, trust=trust)] == ["span"]
    # forged: the document edited (its object swapped for the one of another span)
    p = board_dir / span_key(RUN, 5, 2)
    doc = json.loads(p.read_text())
    other = json.loads((board_dir / span_key(RUN, 5, 1)).read_text())
    doc["objects"] = other["objects"]
    p.write_text(json.dumps(doc))
    with pytest.raises(Exception, match="does not match"):
        await read_span(board, RUN, 5, 2, trust)
    steps = await plan(board, RUN, 2, 5, trust=trust)
    # around the forged span: the span to v4 (the previous target's, still kept) + v5's patch
    assert [(s.label, s.base, s.version) for s in steps] == [("span", 2, 4), ("patch", 4, 5)]
    # an unsigned span is refused under a trust set, taken without one
    p3 = board_dir / span_key(RUN, 5, 3)
    d3 = json.loads(p3.read_text())
    d3.pop("signature")
    d3["signed_by"] = None
    p3.write_text(json.dumps(d3))
    assert [s.label for s in await plan(board, RUN, 3, 5, trust=trust)] == ["patch", "patch"]
    assert [s.label for s in await plan(board, RUN, 3, 5)] == ["span"]
    rep = MemoryReplica()
    f = Follower(str(board_dir), RUN, rep, cache_dir=tmp_path / "c", trust=trust)
    await f.catch_up(3)
    await f.catch_up(5)
    assert _equal(rep.tensors, views[5]) and f.version == 5
    assert [h["kind"] for h in f.history][-2:] == ["patch", "patch"]
    await f.stop()


async def test_a_corrupt_span_is_used_once_then_the_chain(tmp_path):
    board_dir = tmp_path / "board"
    views = _publish(board_dir, 6)
    board = LocalBoard(board_dir)
    await _squash_all(Squasher(board, RUN, tmp_path / "cache", horizon=4))
    obj = board_dir / RUN / "versions" / "000005" / "span-000002.stp"
    data = bytearray(obj.read_bytes())
    data[len(data) // 2] ^= 0xFF
    obj.write_bytes(bytes(data))
    rep = MemoryReplica()
    f = Follower(str(board_dir), RUN, rep, cache_dir=tmp_path / "c")
    await f.catch_up(2)
    with pytest.raises(Exception, match="checksum"):
        await f.catch_up(5)
    assert f.version == 2
    await f.catch_up(5)  # the failed span is avoided: the chain
    assert f.version == 5 and _equal(rep.tensors, views[5])
    await f.stop()


def test_stitch_plan_and_squash_cli(tmp_path):
    board_dir = tmp_path / "board"
    _publish(board_dir, 7)

    def stitch(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "stitch_core.cli", *args],
                              capture_output=True, text=True, timeout=300)

    r = stitch("plan", str(board_dir), "--run", RUN, "--from", "2", "--json")
    assert r.returncode == 0, r.stderr
    before = json.loads(r.stdout)
    assert [s["kind"] for s in before["steps"]] == ["patch"] * 4
    assert before["bytes"] == sum(s["bytes"] for s in before["steps"]) > 0
    assert [(s["from"], s["to"]) for s in before["steps"]] == [(2, 3), (3, 4), (4, 5), (5, 6)]
    r = stitch("squash", str(board_dir), "--run", RUN, "--once", "--horizon", "8", "--json",
               "--cache-dir", str(tmp_path / "cache"))
    assert r.returncode == 0, r.stderr
    rounds = json.loads(r.stdout)["rounds"]
    assert rounds and rounds[-1]["version"] == 6
    r = stitch("plan", str(board_dir), "--run", RUN, "--from", "2", "--json")
    after = json.loads(r.stdout)
    assert after["steps"] == [{"kind": "span", "from": 2, "to": 6,
                               "bytes": after["bytes"]}]
    assert after["bytes"] < before["bytes"]
    r = stitch("plan", str(board_dir), "--run", RUN, "--from", "none", "--json")
    first = json.loads(r.stdout)["steps"][0]
    assert first["kind"] == "snapshot" and first["from"] is None and first["to"] == 0
    r = stitch("plan", str(board_dir), "--run", RUN, "--from", "2")
    assert r.returncode == 0 and "span" in r.stdout and "1 step(s)" in r.stdout


async def test_gc_deletes_the_spans_of_the_versions_it_deletes(tmp_path):
    from stitch_core.versions.retention import gc

    board_dir = tmp_path / "board"
    g = torch.Generator().manual_seed(0)
    masters = {"w": torch.randn(96, 128, generator=g) * 0.02}
    board = LocalBoard(board_dir)
    sq = Squasher(board, RUN, tmp_path / "cache", horizon=3, keep_targets=8)
    with Publisher(str(board_dir), RUN, "bf16", snapshot_every=4) as pub:
        for step in range(9):
            pub.publish(step, masters).result()
            masters = {k: v + torch.randn(v.shape, generator=g) * 4e-6 for k, v in
                       masters.items()}
            await _squash_all(sq)
    assert await span_bases(board, RUN, 3) == [0, 1]
    report = await gc(board, RUN, keep_snapshots=1)  # snapshots v0, v4, v8: below v8 goes
    assert [d.version for d in report.deleted] == list(range(8))
    left = sorted(p.relative_to(board_dir / RUN / "versions").as_posix()
                  for p in (board_dir / RUN / "versions").rglob("*") if p.is_file())
    assert all(n.startswith("000008/") for n in left), left  # spans of deleted versions too
    # v8 keeps its spans: a follower still at v5 or v6 takes one
    assert await span_bases(board, RUN, 8) == [5, 6]


async def test_a_restarted_squasher_keeps_what_is_there_and_replaces_orphans(tmp_path):
    board_dir = tmp_path / "board"
    views = _publish(board_dir, 6)
    board = LocalBoard(board_dir)
    await _squash_all(Squasher(board, RUN, tmp_path / "cache", horizon=4))
    vdir = board_dir / RUN / "versions" / "000005"
    kept = (vdir / "span-000001.json").read_bytes()
    (vdir / "span-000002.json").unlink()  # killed between the object and its document
    (vdir / "span-000002.stp").write_bytes(b"partial")
    await _squash_all(Squasher(board, RUN, tmp_path / "cache2", horizon=4))
    assert (vdir / "span-000001.json").read_bytes() == kept
    assert await span_bases(board, RUN, 5) == [1, 2, 3]
    rep = MemoryReplica()
    f = Follower(str(board_dir), RUN, rep, cache_dir=tmp_path / "c")
    await f.catch_up(2)
    await f.catch_up(5)
    assert _equal(rep.tensors, views[5]) and f.history[-1]["kind"] == "span"
    await f.stop()


def test_merge_matches_a_dense_reference():
    from stitch_core.versions.squash import _Diff, _merge

    g = torch.Generator().manual_seed(3)
    n = 5000
    states = [torch.randint(0, 4, (n,), generator=g, dtype=torch.int16)]
    for _ in range(12):  # few values: positions often change back
        nxt = states[-1].clone()
        idx = torch.randperm(n, generator=g)[:400]
        nxt[idx] = torch.randint(0, 4, (400,), generator=g, dtype=torch.int16)
        states.append(nxt)
    d = _Diff(torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int16))
    for prev, cur in zip(states, states[1:], strict=False):
        pos = torch.nonzero(prev != cur).reshape(-1)
        d = _merge(d, pos, prev[pos], cur)
    want = torch.nonzero(states[0] != states[-1]).reshape(-1)
    assert torch.equal(d.pos, want) and torch.equal(d.bits, states[0][want])
