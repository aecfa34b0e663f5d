"""A persistently bad object on the board (a corrupt or missing patch) does not keep a follower at
the version before it when a later snapshot exists: after BAD_AFTER failures the planner goes
through that snapshot. Without one, the follower stays at its last good version and says why."""

from __future__ import annotations

import torch

from stitch_core.versions import follower as follower_mod
from stitch_core.versions.follower import Follower
from stitch_core.versions.memory_replica import MemoryReplica
from stitch_trainer.publisher import Publisher

RUN = "bad-object"


def _publish(board, n: int, snapshot_every: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    masters = {f"w{i}": torch.randn(64, 64, generator=g) * 0.02 for i in range(3)}
    views = []
    with Publisher(str(board), RUN, "bf16", snapshot_every=snapshot_every) as pub:
        for step in range(n):
            pub.publish(step, masters).result()
            views.append({k: v.to(torch.bfloat16) for k, v in masters.items()})
            masters = {k: v + torch.randn(v.shape, generator=g) * 2e-6 for k, v in
                       masters.items()}
    return views


def _equal(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k].view(torch.int16),
                                                    b[k].view(torch.int16)) for k in a)


async def _sync_until(f: Follower, tries: int) -> list[str]:
    errors = []
    for _ in range(tries):
        try:
            await f.sync()
        except Exception as e:  # noqa: BLE001 - the follow loop catches and retries the same way
            errors.append(str(e))
        else:
            break
    return errors


async def test_a_corrupt_patch_is_routed_around_through_a_later_snapshot(tmp_path):
    board = tmp_path / "board"
    views = _publish(board, 9, snapshot_every=6)  # snapshots v0, v6; patches everywhere else
    patch3 = board / RUN / "versions" / "000003" / "patch.stp"
    data = bytearray(patch3.read_bytes())
    data[len(data) // 2] ^= 0xFF
    patch3.write_bytes(bytes(data))  # corrupt on the board, for good
    rep = MemoryReplica()
    f = Follower(str(board), RUN, rep, cache_dir=tmp_path / "c")
    # first a replica at v2 (a snapshot load + two patches)
    await f.catch_up(2)
    assert f.version == 2
    errors = await _sync_until(f, follower_mod.BAD_AFTER + 1)
    assert len(errors) == follower_mod.BAD_AFTER and all("checksum" in e for e in errors)
    assert f.version == 8 and _equal(rep.tensors, views[8])
    assert f.status()["avoiding"] == [3]
    assert [h["kind"] for h in f.history][-3:] == ["snapshot", "patch", "patch"]
    await f.stop()


async def test_a_missing_patch_without_a_later_snapshot_leaves_the_follower_at_its_version(
        tmp_path):
    """No way around it: the follower stays at its last good version, keeps retrying the patch
    (so a repair is picked up at the next reconcile), and follows once it is back."""
    board = tmp_path / "board"
    views = _publish(board, 5, snapshot_every=0)  # only v0 is a snapshot
    patch3 = board / RUN / "versions" / "000003" / "patch.stp"
    saved = patch3.read_bytes()
    patch3.unlink()
    rep = MemoryReplica()
    f = Follower(str(board), RUN, rep, cache_dir=tmp_path / "c")
    await f.catch_up(2)
    errors = await _sync_until(f, follower_mod.BAD_AFTER + 2)
    assert len(errors) == follower_mod.BAD_AFTER + 2 and all("not on board" in e for e in errors)
    assert f.version == 2 and _equal(rep.tensors, views[2])  # its last good version, whole
    assert f.status()["avoiding"] == [3]
    patch3.write_bytes(saved)  # an operator puts the object back
    assert await f.sync() == 4 and _equal(rep.tensors, views[4])
    await f.stop()


def test_nats_going_down_never_fails_a_publish(tmp_path, caplog):
    """The version is on the board before it is announced: an announcement that fails (NATS
    stopped mid-run) is logged, the publish succeeds, `latest` moves, and the next version is
    still a patch (a reported failure used to make it a full snapshot)."""
    import time

    from stitch_core.versions.natsserver import NatsServer

    server = NatsServer(tmp_path / "nats", port=0).start()
    g = torch.Generator().manual_seed(1)
    masters = {"w": torch.randn(64, 64, generator=g) * 0.02}
    try:
        with Publisher(str(tmp_path / "board"), RUN, "bf16", nats=server.url) as pub:
            assert pub.publish(0, masters).result().version == 0
            server.stop()
            kinds = []
            t0 = time.monotonic()
            for step in (1, 2):
                masters = {"w": masters["w"] + torch.randn(64, 64, generator=g) * 2e-4}
                kinds.append(pub.publish(step, masters).result().kind)
            assert kinds == ["patch", "patch"]
            assert time.monotonic() - t0 < 20  # bounded by the announcement timeout
    finally:
        server.stop()
    assert "it is on the board, followers will see it when they poll" in caplog.text
    latest = (tmp_path / "board" / RUN / "latest").read_text()
    assert '"version":2' in latest.replace(" ", "")
