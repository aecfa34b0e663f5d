"""The follower keeps following through NATS outages and says how it is (`health`): it polls
the board whether or not NATS is up, connects NATS in the background, and a follow loop that
ends turns the engine not_ready. Real nats-server, real local board, a real trainer."""

from __future__ import annotations

import asyncio
import time

import pytest

from stitch_core.versions.follower import Follower
from stitch_core.versions.memory_replica import MemoryReplica
from stitch_core.versions.natsserver import NatsServer
from stitch_dev.ports import free_port

from .test_follow_nats import Trainer, same


async def _until(cond, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        await asyncio.sleep(0.05)


async def test_nats_down_at_start_the_board_is_polled_and_nats_joins_later(tmp_path):
    """NATS is unreachable when the follower starts: start() returns, the follower polls the
    board (health degraded, nats_connected False) and reaches every version; once a
    nats-server comes up on that address, the follower connects on its own (health ok) and
    announcements drive it again."""
    port = free_port()
    url = f"nats://127.0.0.1:{port}"
    board = str(tmp_path / "board")
    t = Trainer(board, "nh", nats=None)  # the trainer publishes to the board only, for now
    rep = MemoryReplica()
    f = Follower(board, "nh", rep, nats=url, cache_dir=tmp_path / "cache",
                 reconcile_interval=0.2)
    server = None
    try:
        await f.start()  # does not raise although nothing listens on `url`
        for _ in range(3):
            v = t.step()
        await _until(lambda: f.version == v)
        assert same(rep, t.views[v])
        assert f.nats_connected is False and f.health == "degraded"
        assert f.status()["health"] == "degraded"
        server = NatsServer(tmp_path / "nats", port=port).start()
        await _until(lambda: f.nats_connected is True, timeout=60)
        assert f.health == "ok"
        t.pub.close()
        t.pub = type(t.pub)(board, "nh", "bf16", nats=url, snapshot_every=6)
        f.reconcile_interval = 3600  # from now on only announcements wake it
        v = t.step()
        await _until(lambda: f.version == v)
        assert same(rep, t.views[v])
    finally:
        await f.stop()
        t.pub.close()
        if server is not None:
            server.stop()


async def test_a_board_outage_is_degraded_with_its_error_and_heals(tmp_path):
    """A reconcile that fails (the board unreadable) makes the follower degraded with the error
    and since when; the next good reconcile makes it ok again."""
    board = tmp_path / "board"
    t = Trainer(str(board), "bo", nats=None)
    rep = MemoryReplica()
    f = Follower(str(board), "bo", rep, cache_dir=tmp_path / "cache", reconcile_interval=0.1)
    await f.start()
    try:
        v = t.step()
        await _until(lambda: f.version == v)
        assert f.health == "ok"
        hidden = tmp_path / "board-away"
        board.rename(hidden)  # the board disappears
        (board).write_text("not a directory")
        await _until(lambda: f.health == "degraded")
        st = f.status()
        assert st["last_error"] and st["error_since"] is not None
        board.unlink()
        hidden.rename(board)
        await _until(lambda: f.health == "ok")
        assert f.status()["error_since"] is None
    finally:
        await f.stop()
        t.pub.close()


async def test_a_follow_loop_that_ends_is_dead_and_says_so(tmp_path):
    """The follow loop must never end; if it does (a bug), the follower is `dead`, says why,
    and tells its owner (an engine then stops serving)."""
    t = Trainer(str(tmp_path / "board"), "dd", nats=None)
    t.step()
    told: list[BaseException] = []
    f = Follower(str(tmp_path / "board"), "dd", MemoryReplica(), cache_dir=tmp_path / "cache",
                 reconcile_interval=0.1, on_dead=told.append)

    async def broken():  # stands for a loop that crashed with something it does not catch
        raise SystemError("boom")

    f._loop = broken  # noqa: SLF001 - the failure injected
    await f.start()
    try:
        await _until(lambda: f.health == "dead")
        assert "boom" in f.status()["last_error"]
        assert len(told) == 1 and isinstance(told[0], SystemError)
    finally:
        await f.stop()
        t.pub.close()


@pytest.mark.parametrize("n", [1])
async def test_engine_stops_serving_when_its_follower_dies(tmp_path, n):
    """EngineFollower: a dead follower turns the engine not_ready (the gate holds no version)."""
    from stitch_core.engine.replica import RankReplica
    from stitch_core.node import Settings
    from stitch_core.versions.board import LocalBoard
    from stitch_core.versions.materialize import pull
    from stitch_dev.toy_engine import ToyEngine, publish_toy_run

    from .test_engine_follower import ToyFollower

    views = publish_toy_run(tmp_path / "board", "ed", 2)
    d = tmp_path / "v0"
    await pull(LocalBoard(tmp_path / "board"), "ed", 0, d, tmp_path / "cache", quiet=True)
    engines = [ToyEngine(0, 1)]
    engines[0].load_weights(iter(views[0].items()))
    s = Settings(board=str(tmp_path / "board"), run="ed", cache_dir=str(tmp_path / "ec"),
                 reconcile_interval=0.1, loader_fallback=True)
    ef = ToyFollower(s, d, [RankReplica(e) for e in engines])
    await ef.start()
    try:
        await _until(lambda: ef.follower is not None and ef.gate.version == 1)
        ef._follower_died(SystemError("boom"))  # noqa: SLF001 - what the loop's end calls
        assert ef.gate.version is None and ef.gate.state == "not_ready"
        assert "follower died" in ef.status_extra()["error"]
    finally:
        await ef.stop()
