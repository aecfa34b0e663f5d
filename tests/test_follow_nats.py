"""Followers against real services: a nats-server, a local board and an HTTP board.

A trainer publishes versions of a small AdamW-trained model; followers driven by announcements,
joining late, missing every message, or restarting all reach each version bit for bit."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading

import pytest
import torch

from stitch_core.format import fingerprint as fpr
from stitch_core.versions.announce import fleet
from stitch_core.versions.board.serve import serve
from stitch_core.versions.follower import Follower
from stitch_core.versions.memory_replica import MemoryReplica
from stitch_trainer.publisher import Publisher

from .test_versions import TinyLM, bf16_view


class Trainer:
    """A real model and optimizer; `step()` trains once and publishes a version."""

    def __init__(self, board: str, run: str, nats: str | None):
        torch.manual_seed(0)
        self.model = TinyLM()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.pub = Publisher(board, run, "bf16", nats=nats, snapshot_every=6)
        self.views: dict[int, dict[str, torch.Tensor]] = {}

    def step(self) -> int:
        x = torch.randint(0, 512, (4, 12))
        loss = torch.nn.functional.cross_entropy(self.model(x)[:, :-1].reshape(-1, 512),
                                                 x[:, 1:].reshape(-1))
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        info = self.pub.publish(len(self.views), self.model)
        self.views[info.version] = bf16_view(self.model)
        info.result(60)
        return info.version


def same(replica: MemoryReplica, view: dict[str, torch.Tensor]) -> bool:
    return replica.fingerprints == fpr.state_fingerprints(view) and all(
        torch.equal(replica.tensors[k].view(torch.int16), view[k].view(torch.int16))
        for k in view)


@pytest.fixture
def stack(nats_server, tmp_path, request):
    run = f"r{abs(hash(request.node.name)) % 10**8}"
    t = Trainer(str(tmp_path / "board"), run, nats_server.url)
    yield t, run, str(tmp_path / "board"), nats_server.url, tmp_path
    t.pub.close()


async def test_announcements_drive_a_live_follower(stack):
    t, run, board, nats, tmp = stack
    await asyncio.to_thread(t.step)  # v0 snapshot
    rep = MemoryReplica()
    # the reconcile timer is an hour: only announcements can make it move
    f = Follower(board, run, rep, nats=nats, cache_dir=tmp / "c", reconcile_interval=3600,
                 heartbeat_interval=0.2, engine_id="eng-a", url="http://eng-a:8000")
    await f.start()
    assert await f.wait_for(0, 20)
    for _ in range(7):
        v = await asyncio.to_thread(t.step)
        # within 20 s, with an hour's reconcile timer: the announcement moved it (a timing
        # bound tighter than that only measures the machine's load)
        assert await f.wait_for(v, 20), f"follower stuck at {f.version}, wanted {v}"
        assert same(rep, t.views[v])
    assert f.applied == list(range(8))  # every version in order, never skipping a patch
    assert f.state == "serving" and f.lag == 0
    # heartbeats: the fleet view, via the API and the CLI
    await asyncio.sleep(0.5)
    hbs = await fleet(f._js, run)
    assert [(h.id, h.version, h.state) for h in hbs] == [("eng-a", 7, "serving")]
    out = await asyncio.to_thread(subprocess.run, [
        sys.executable, "-m", "stitch_core.cli", "status", "--nats", nats, "--run", run,
        "--json"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    engines = json.loads(out.stdout)["engines"]
    assert engines[0]["id"] == "eng-a" and engines[0]["version"] == 7
    await f.stop()


async def test_late_joiner_and_restart_catch_up(stack):
    t, run, board, nats, tmp = stack
    for _ in range(4):
        await asyncio.to_thread(t.step)
    rep = MemoryReplica()
    f = Follower(board, run, rep, nats=nats, cache_dir=tmp / "c", reconcile_interval=3600)
    await f.start()  # joins after v0..v3 were announced: replays the last announcement
    assert await f.wait_for(3, 20) and same(rep, t.views[3])
    await f.stop()
    for _ in range(4):  # v4..v7 while the follower is down (v6 is a snapshot)
        await asyncio.to_thread(t.step)
    f2 = Follower(board, run, rep, version=3, nats=nats, cache_dir=tmp / "c",
                  reconcile_interval=3600)
    await f2.start()  # restarts holding v3: a chain of patches, not the v6 snapshot
    assert await f2.wait_for(7, 20) and same(rep, t.views[7])
    assert f2.applied == [4, 5, 6, 7]
    await f2.stop()


async def test_missed_messages_are_covered_by_the_reconcile_timer(stack, nats_server):
    t, run, board, nats, tmp = stack
    await asyncio.to_thread(t.step)
    rep = MemoryReplica()
    f = Follower(board, run, rep, nats=nats, cache_dir=tmp / "c", reconcile_interval=0.5)
    await f.start()
    assert await f.wait_for(0, 20)
    silent = Publisher(board, run, "bf16")  # same board, never announces
    silent.resume_from(0, t.views[0], fpr.state_fingerprints(t.views[0]))
    model = TinyLM()
    info = silent.publish(99, model)
    await asyncio.to_thread(info.result, 60)
    silent.close()
    assert await f.wait_for(1, 10), "the timer should have found the unannounced version"
    assert same(rep, bf16_view(model))
    await f.stop()


async def test_follower_over_http_board(stack):
    t, run, board, nats, tmp = stack
    for _ in range(3):
        await asyncio.to_thread(t.step)
    server = serve(tmp / "board", "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        rep = MemoryReplica()
        f = Follower(url, run, rep, nats=nats, cache_dir=tmp / "h", reconcile_interval=3600)
        # bounded: a hang here (seen once in a full run, not reproduced alone) fails, with the
        # step it hung in, instead of stopping the suite
        await asyncio.wait_for(f.start(), 60)
        assert await f.wait_for(2, 20) and same(rep, t.views[2])
        v = await asyncio.to_thread(t.step)
        assert await f.wait_for(v, 20) and same(rep, t.views[v])
        await asyncio.wait_for(f.stop(), 60)
    finally:
        server.shutdown()


async def test_a_forged_huge_announcement_moves_nothing(stack):
    """Any NATS client can announce version 10**15. It is a hint: the follower reads the
    board's own `latest` before believing anything, so its latest does not jump, it is not
    stalled, and it goes on applying the real next versions; a restarted follower that reads the
    forged message again from JetStream is not fooled either."""
    from stitch_core.versions.announce import announce
    from stitch_core.versions.manifest import Announcement
    from stitch_core.versions.nats_conn import connect

    t, run, board, nats, tmp = stack
    await asyncio.to_thread(t.step)
    rep = MemoryReplica()
    f = Follower(board, run, rep, nats=nats, cache_dir=tmp / "c", reconcile_interval=3600)
    await f.start()
    assert await f.wait_for(0, 20)
    nc = await connect(nats)
    try:
        forged = Announcement(run=run, version=10**15, parent=10**15 - 1, kind="patch",
                              board=board, manifest=f"{run}/versions/x/manifest.json")
        await announce(nc.jetstream(), forged)
        await asyncio.sleep(0.5)
        assert f.latest == 0 and f.version == 0 and f.state == "serving"
        for _ in range(2):
            v = await asyncio.to_thread(t.step)
            assert await f.wait_for(v, 20), f"follower stuck at {f.version}, wanted {v}"
            assert same(rep, t.views[v])
        assert f.latest == v and f.lag == 0
        await f.stop()
        await asyncio.to_thread(t.step)
        rep2 = MemoryReplica()
        f2 = Follower(board, run, rep2, nats=nats, cache_dir=tmp / "c2", reconcile_interval=3600)
        await f2.start()
        await announce(nc.jetstream(), forged)  # the newest message on the stream is forged
        assert await f2.wait_for(v + 1, 20)
        assert f2.latest == v + 1
        await f2.stop()
    finally:
        await nc.close()


async def test_the_snapshot_search_is_bounded_on_a_board_that_cannot_list(tmp_path):
    """Planning toward a version whose chain is broken searches back for a snapshot; on a board
    that cannot list its versions (a static HTTP board) that search reads at most
    MAX_SNAPSHOT_SCAN manifests, whatever the target claims, then fails with a clear error."""
    from stitch_core.versions import store
    from stitch_core.versions.board import LocalBoard

    class Unlisted(LocalBoard):
        reads = 0

        async def list_versions(self, run):
            return None

        async def get(self, key, max_bytes=None):
            Unlisted.reads += 1
            return await super().get(key, max_bytes)

    b = Unlisted(tmp_path / "board")
    with pytest.raises(store.VersionError, match="no usable snapshot"):
        await asyncio.wait_for(store.plan(b, "empty", None, 10**15), 60)  # unbounded: times out
    assert Unlisted.reads <= store.MAX_SNAPSHOT_SCAN + 2


async def test_a_wake_during_an_apply_is_not_lost(tmp_path):
    """A hint that comes while the loop is applying (here `wait_for` of the next version, as an
    announcement would) makes the loop read the board again at once: it is not cleared when the
    apply ends, which would leave the follower a whole reconcile interval (an hour here) behind."""
    run = "wake"
    t = Trainer(str(tmp_path / "board"), run, None)
    await asyncio.to_thread(t.step)  # v0
    rep = MemoryReplica()
    applying, release = asyncio.Event(), asyncio.Event()

    async def slow(step, path):  # v1's apply waits until the test has published v2
        if step.manifest.version == 1:
            applying.set()
            await release.wait()
        await rep(step, path)

    f = Follower(str(tmp_path / "board"), run, slow, cache_dir=tmp_path / "c",
                 reconcile_interval=3600)
    await f.start()
    try:
        assert await f.wait_for(0, 20)
        await asyncio.to_thread(t.step)  # v1
        waiting = asyncio.create_task(f.wait_for(1, 20))  # wakes the loop: it applies v1
        await asyncio.wait_for(applying.wait(), 20)
        v2 = await asyncio.to_thread(t.step)
        later = asyncio.create_task(f.wait_for(v2, 20))  # the hint, during v1's apply
        await asyncio.sleep(0.2)
        release.set()
        assert await waiting and await later, f"stuck at {f.version}"
        assert same(rep, t.views[v2])
    finally:
        await f.stop()
        t.pub.close()
