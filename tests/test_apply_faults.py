"""An apply is a transaction across ranks (stitch_core.engine.coordinator): a rank that raises or
hangs once another has written is undone everywhere and the old version proven; when the old
version cannot be proven the engine stops serving (version None: requests get not_ready) and a
snapshot load through the verified path brings it back. Real Coordinator, real RankReplicas on a
TP=2 toy engine (stitch_dev/toy_engine.py), faults injected in the transport or by the ranks' own
failpoints (stitch_core.engine.failpoints; the same faults on real vLLM and SGLang engines:
stitch_dev/engine_faults.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from stitch_core.engine import rpc as rpc_
from stitch_core.engine.coordinator import Coordinator
from stitch_core.engine.failpoints import FailpointError
from stitch_core.engine.proof import EngineStateError
from stitch_core.engine.replica import RankReplica
from stitch_core.serve.gate import VersionGate
from stitch_core.versions.board import LocalBoard
from stitch_core.versions.materialize import pull
from stitch_core.versions.store import fetch_patch, read_manifest
from stitch_dev.toy_engine import publish_toy_run

from .test_engine_apply import RUN, _engines, _same


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    return root, publish_toy_run(root / "board", RUN, 8)

Fault = Callable[[int, object], object]  # (rank, request) -> "raise" | "hang" | None


def _faulty_rpc(replicas: list[RankReplica], fault: dict):
    """The engine's transport, rank by rank in order; `fault["fn"](rank, req)` may say "raise"
    (the rank's handler raises, as a failing rank does) or "hang" (it never answers)."""
    async def rpc(req):
        req = rpc_.decode(rpc_.encode(req))
        out = []
        for i, r in enumerate(replicas):
            what = fault["fn"](i, req) if fault.get("fn") else None
            if what == "hang":
                await asyncio.sleep(3600)
            if what == "raise":
                raise RuntimeError(f"rank {i}: injected failure in {type(req).__name__}")
            out.append(rpc_.decode(rpc_.encode(r.handle(req))))
        return out
    return rpc


async def _start(root, views, fault: dict, timeout: float = 2.0, **hooks):
    d = root / "pulled-faults-0"
    if not d.exists():
        await pull(LocalBoard(root / "board"), RUN, 0, d, root / "cache", quiet=True)
    engines = _engines(2, views[0])
    replicas = [RankReplica(e, rank_info={"rank": i}) for i, e in enumerate(engines)]
    gate = VersionGate(RUN)
    coord = Coordinator(_faulty_rpc(replicas, fault), run=RUN, gate=gate, loader_fallback=True,
                        rpc_timeout=timeout, **hooks)
    assert await coord.start(d) == 0
    return engines, replicas, coord, gate


async def _v1(root, tmp_path):
    board = LocalBoard(root / "board")
    m1 = await read_manifest(board, RUN, 1)
    return m1, await fetch_patch(board, m1, tmp_path / "cache")


def _on(rank: int, kind: type, what: str, times: int = 1):
    left = {"n": times}

    def fn(i, req):
        if i == rank and isinstance(req, kind) and left["n"] > 0:
            left["n"] -= 1
            return what
        return None
    return fn


@pytest.mark.parametrize("what", ["raise", "hang"])
async def test_a_rank_failing_mid_write_is_undone_on_every_rank(published, tmp_path, what):
    """Rank 0 has written v1 when rank 1 raises (or hangs past the RPC timeout): rank 0 is
    undone, v0 is proven on both ranks and still served; the next try applies v1."""
    root, views = published
    fault: dict = {"fn": _on(1, rpc_.Write, what)}
    engines, _, coord, gate = await _start(root, views, fault, timeout=1.0)
    m1, paths = await _v1(root, tmp_path)
    with pytest.raises((RuntimeError, EngineStateError)):
        await coord.apply_patch(m1, paths)
    assert coord.version == 0 and gate.version == 0  # still serving the proven v0
    assert all(_same(a, b) for a, b in zip(engines, _engines(2, views[0]), strict=True))
    assert (await coord.verify())["ok"] is True
    await coord.apply_patch(m1, paths)  # the fault is gone: v1 applies
    assert coord.version == 1
    assert all(_same(a, b) for a, b in zip(engines, _engines(2, views[1]), strict=True))


async def test_an_unprovable_undo_stops_serving_until_a_snapshot_is_loaded(published, tmp_path):
    """Rank 1 fails its write and then cannot answer (gone): v0 cannot be proven after the
    undo, so the engine holds no version (requests: not_ready) rather than serving mixed
    weights; a snapshot loaded through the verified path serves again."""
    root, views = published
    gone = {"gone": False}

    def fn(i, req):
        if i == 1 and isinstance(req, rpc_.Write):
            gone["gone"] = True
            return "raise"
        return "raise" if i == 1 and gone["gone"] else None

    fault: dict = {"fn": fn}
    engines, _, coord, gate = await _start(root, views, fault)
    m1, paths = await _v1(root, tmp_path)
    with pytest.raises(EngineStateError, match="could not be proven"):
        await coord.apply_patch(m1, paths)
    assert coord.version is None and gate.version is None
    assert gate.state == "not_ready"
    gone["gone"] = False  # the rank is back (restarted): recover through a snapshot
    d = root / "pulled-faults-7"
    await pull(LocalBoard(root / "board"), RUN, 7, d, root / "cache", quiet=True)
    await coord.load_snapshot(await read_manifest(LocalBoard(root / "board"), RUN, 7), d)
    assert coord.version == 7 and gate.version == 7
    assert all(_same(a, b) for a, b in zip(engines, _engines(2, views[7]), strict=True))


async def test_a_snapshot_load_failing_part_way_stops_serving(published, tmp_path):
    """A snapshot load has no undo: rank 0 loaded, rank 1 failed. The old version's label must
    not stay on mixed weights: not serving until a load is proven."""
    root, views = published
    fault: dict = {"fn": _on(1, rpc_.LoadFiles, "raise")}
    engines, _, coord, gate = await _start(root, views, fault)
    d = root / "pulled-faults-5"
    await pull(LocalBoard(root / "board"), RUN, 5, d, root / "cache", quiet=True)
    m5 = await read_manifest(LocalBoard(root / "board"), RUN, 5)
    with pytest.raises(EngineStateError):
        await coord.load_snapshot(m5, d)
    assert coord.version is None and gate.version is None
    await coord.load_snapshot(m5, d)  # a second try succeeds and is proven
    assert coord.version == 5
    assert all(_same(a, b) for a, b in zip(engines, _engines(2, views[5]), strict=True))


async def test_a_hung_gather_fails_the_apply_without_writing(published, tmp_path):
    """Nothing is written before every rank answered the gather: a hung rank times out the
    apply, the engine keeps serving v0 untouched."""
    root, views = published
    fault: dict = {"fn": _on(1, rpc_.Gather, "hang")}
    engines, _, coord, gate = await _start(root, views, fault, timeout=0.5)
    m1, paths = await _v1(root, tmp_path)
    with pytest.raises(EngineStateError, match="no answer"):
        await coord.apply_patch(m1, paths)
    assert coord.version == 0 and gate.version == 0
    assert all(_same(a, b) for a, b in zip(engines, _engines(2, views[0]), strict=True))


def _steps(events: list[str]):
    async def pause():
        events.append("pause")

    async def resume():
        events.append("resume")
    return {"pause": pause, "resume": resume}


async def test_steps_stay_held_while_no_version_is_proven(published, tmp_path):
    """Requests admitted at v0 and frozen by the apply's pause must not go on generating from
    weights nothing proved (they would answer 200): when v0 cannot be proven after the failed
    apply, engine steps stay held until a snapshot load is proven, which resumes them. An apply
    undone and proven resumes at once."""
    root, views = published
    state = {"gone": False}

    def gone_after_write(i, req):  # rank 1 fails its write, then answers nothing
        if i == 1 and isinstance(req, rpc_.Write):
            state["gone"] = True
        return "raise" if i == 1 and state["gone"] else None

    fault: dict = {"fn": gone_after_write}
    events: list[str] = []
    _, _, coord, gate = await _start(root, views, fault, **_steps(events))
    m1, paths = await _v1(root, tmp_path)
    with pytest.raises(EngineStateError):
        await coord.apply_patch(m1, paths)
    assert events == ["pause"] and coord.steps_held and coord.status()["steps_held"]
    assert gate.state == "not_ready"
    fault["fn"] = None  # the rank is back: a proven snapshot load resumes the steps
    d = root / "pulled-faults-3"
    await pull(LocalBoard(root / "board"), RUN, 3, d, root / "cache", quiet=True)
    board = LocalBoard(root / "board")
    await coord.load_snapshot(await read_manifest(board, RUN, 3), d)
    assert events == ["pause", "pause", "resume"] and not coord.steps_held
    fault["fn"] = _on(1, rpc_.Write, "raise")  # undone and proven: resumed at once
    m4 = await read_manifest(board, RUN, 4)
    with pytest.raises(RuntimeError):
        await coord.apply_patch(m4, await fetch_patch(board, m4, tmp_path / "cache"))
    assert coord.version == 3 and events[-2:] == ["pause", "resume"] and not coord.steps_held


def test_failpoints_are_refused_unless_enabled(published, monkeypatch):
    root, views = published
    monkeypatch.delenv("STITCH_FAILPOINTS", raising=False)
    rep = RankReplica(_engines(1, views[0])[0], rank_info={"tp_rank": 0})
    with pytest.raises(FailpointError, match="STITCH_FAILPOINTS=1"):
        rep.handle(rpc_.Arm(0))
    monkeypatch.setenv("STITCH_FAILPOINTS", "1")
    with pytest.raises(FailpointError, match="points are"):
        rep.handle(rpc_.Arm(0, point="read"))
    assert rep.handle(rpc_.Arm(1)).armed == []  # another rank's
    armed = rep.handle(rpc_.Arm(0, action="hang", seconds=2.0)).armed
    assert armed == [{"point": "write", "action": "hang", "seconds": 2.0, "after": 0, "times": 1}]
    assert rep.handle(rpc_.Arm(None, action="off")).armed == []


@pytest.mark.parametrize("point", ["write", "written"])
async def test_a_rank_failpoint_raising_in_its_write_is_undone_everywhere(published, tmp_path,
                                                                        monkeypatch, point):
    """The rank's own failpoint: mid-write (rank 1 wrote part of its shard and restores it
    itself; rank 0 wrote all of its shard: the coordinator undoes it) or after the whole write
    (rank 1 holds all of v1 and its undo record: the coordinator's Undo restores it). Either
    way v0 is proven and served; the failpoint fired once, so the next try applies v1."""
    monkeypatch.setenv("STITCH_FAILPOINTS", "1")
    root, views = published
    engines, replicas, coord, gate = await _start(root, views, {})
    replicas[1].rank_info["tp_rank"] = 1
    await coord.rpc(rpc_.Arm(1, point=point, action="raise"))
    m1, paths = await _v1(root, tmp_path)
    with pytest.raises(RuntimeError, match="failpoint"):
        await coord.apply_patch(m1, paths)
    assert coord.version == 0 and gate.version == 0
    assert all(_same(a, b) for a, b in zip(engines, _engines(2, views[0]), strict=True))
    assert (await coord.verify())["ok"] is True
    await coord.apply_patch(m1, paths)
    assert coord.version == 1
    assert all(_same(a, b) for a, b in zip(engines, _engines(2, views[1]), strict=True))
