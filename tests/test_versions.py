"""Versions end to end on a local board: a real model trained with AdamW publishes 22 versions;
followers starting at various points reconstruct every version bit for bit."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch

from stitch_core.format import fingerprint as fpr
from stitch_core.versions.board import LatestConflictError, LocalBoard, NotFoundError
from stitch_core.versions.follower import Follower
from stitch_core.versions.manifest import Latest, manifest_key
from stitch_core.versions.materialize import pull
from stitch_core.versions.memory_replica import MemoryReplica
from stitch_core.versions.store import VersionError, list_manifests, now, plan, read_manifest
from stitch_trainer.publisher import Publisher

RUN = "tiny"
N_VERSIONS = 22


class TinyLM(torch.nn.Module):
    def __init__(self, vocab: int = 512, d: int = 64):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(vocab, d)
        self.up = torch.nn.Linear(d, 4 * d)
        self.down = torch.nn.Linear(4 * d, d)
        self.norm = torch.nn.LayerNorm(d)
        self.lm_head = torch.nn.Linear(d, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(x)
        h = h + self.down(torch.nn.functional.gelu(self.up(h)))
        return self.lm_head(self.norm(h))


def bf16_view(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().to(torch.bfloat16).clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def published(tmp_path_factory) -> tuple[Path, list[dict[str, torch.Tensor]]]:
    root = tmp_path_factory.mktemp("versions")
    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    views = []
    with Publisher(str(root / "board"), RUN, "bf16", snapshot_every=8) as pub:
        for step in range(N_VERSIONS):
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
    return root / "board", views


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k].view(torch.int16), b[k].view(torch.int16)) for k in a)


async def test_board_holds_every_version_with_true_fingerprints(published):
    board_dir, views = published
    board = LocalBoard(board_dir)
    ms = await list_manifests(board, RUN)
    assert [m.version for m in ms] == list(range(N_VERSIONS))
    assert (await board.read_latest(RUN)).version == N_VERSIONS - 1
    for m, view in zip(ms, views, strict=True):
        assert m.fingerprints == fpr.state_fingerprints(view)
        assert m.kind == ("snapshot" if m.version % 8 == 0 else "patch")
        assert m.parent == (None if m.version == 0 else m.version - 1)
        if m.version:
            assert m.patch is not None and 0 < m.changed_elements < m.total_elements
    # snapshots after the first also carry the patch from their parent
    assert ms[8].patch is not None and ms[8].weights


@pytest.mark.parametrize("start", [None, 3, 15])
async def test_follower_reconstructs_latest_from_any_start(published, tmp_path, start):
    board_dir, views = published
    replica = MemoryReplica()
    if start is not None:  # a replica that already holds version `start`
        replica.tensors = {k: v.clone() for k, v in views[start].items()}
        replica.fingerprints = fpr.state_fingerprints(views[start])
    f = Follower(str(board_dir), RUN, replica, version=start, cache_dir=tmp_path)
    assert f.state == ("not_ready" if start is None else "serving")
    assert await f.sync() == N_VERSIONS - 1
    assert f.state == "serving" and f.lag == 0
    assert _equal(replica.tensors, views[-1])
    if start is None:
        assert f.applied == [16, 17, 18, 19, 20, 21]  # nearest snapshot, then patches
    else:
        assert f.applied == list(range(start + 1, N_VERSIONS))  # a chain, never a snapshot
    await f.stop()


async def test_long_chain_falls_back_to_snapshot(published, tmp_path):
    board = LocalBoard(published[0])
    steps = await plan(board, RUN, 2, N_VERSIONS - 1, max_chain=4)
    assert [(s.kind, s.version) for s in steps] == [("snapshot", 16), ("patch", 17),
                                                    ("patch", 18), ("patch", 19),
                                                    ("patch", 20), ("patch", 21)]


async def test_follower_visits_every_version_in_order(published, tmp_path):
    board_dir, views = published
    replica = MemoryReplica()
    f = Follower(str(board_dir), RUN, replica, cache_dir=tmp_path)
    for v in range(0, N_VERSIONS):  # step through: each version verified bit for bit
        await f.catch_up(v)
        assert f.version == v and _equal(replica.tensors, views[v])
    await f.stop()


async def test_pull_materialises_any_version(published, tmp_path):
    board_dir, views = published
    from safetensors.torch import load_file

    for v in (0, 5, 8, 21):
        out = tmp_path / f"v{v}"
        m = await pull(LocalBoard(board_dir), RUN, v, out, tmp_path / "cache", quiet=True)
        assert m.version == v
        got = load_file(out / "model.safetensors")
        assert _equal(got, views[v])
        assert json.loads((out / "stitch-manifest.json").read_text())["version"] == v


# ---------------------------------------------------------------- bad input

def _copy_board(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def _edit_manifest(board: Path, version: int, fn) -> None:
    p = board / manifest_key(RUN, version)
    m = json.loads(p.read_text())
    fn(m)
    p.write_text(json.dumps(m))


async def test_traversal_path_in_manifest_is_rejected(published, tmp_path):
    board = _copy_board(published[0], tmp_path / "b")
    _edit_manifest(board, 21, lambda m: m["objects"][0].update(path="../../../etc/passwd"))
    with pytest.raises(VersionError, match="unsafe object path"):
        await read_manifest(LocalBoard(board), RUN, 21)
    replica = MemoryReplica()
    f = Follower(str(board), RUN, replica, version=None, cache_dir=tmp_path / "c")
    with pytest.raises(VersionError, match="unsafe object path"):
        await f.sync()  # the wanted version is unusable: nothing is applied
    assert f.version is None and f.state == "not_ready" and replica.tensors == {}
    assert not (tmp_path / "c").exists() or not list((tmp_path / "c").rglob("*.safetensors"))
    await f.stop()


async def test_foreign_run_manifest_is_rejected(published, tmp_path):
    board = _copy_board(published[0], tmp_path / "b")
    _edit_manifest(board, 21, lambda m: m.update(run="other"))
    with pytest.raises(VersionError, match="foreign"):
        await read_manifest(LocalBoard(board), RUN, 21)


async def test_missing_and_corrupt_objects_apply_nothing(published, tmp_path):
    board_dir, views = published
    board = _copy_board(board_dir, tmp_path / "b")
    patch21 = board / RUN / "versions" / "000021" / "patch.stp"
    data = bytearray(patch21.read_bytes())
    data[len(data) // 2] ^= 0xFF
    patch21.write_bytes(bytes(data))  # checksum mismatch vs the manifest's sha256
    replica = MemoryReplica()
    replica.tensors = {k: v.clone() for k, v in views[20].items()}
    replica.fingerprints = fpr.state_fingerprints(views[20])
    f = Follower(str(board), RUN, replica, version=20, cache_dir=tmp_path / "c")
    with pytest.raises(VersionError, match="checksum mismatch"):
        await f.catch_up(21)
    assert f.version == 20 and f.state == "catching_up" and _equal(replica.tensors, views[20])
    assert not list((tmp_path / "c").rglob("patch.stp"))  # nothing bad left in the cache
    patch21.unlink()
    with pytest.raises(NotFoundError):
        await f.catch_up(21)
    assert f.version == 20 and _equal(replica.tensors, views[20])
    await f.stop()


async def test_patch_that_fails_verification_is_undone(published, tmp_path):
    """A well-formed patch for another base: apply raises, the replica keeps its version."""
    board_dir, views = published
    replica = MemoryReplica()
    replica.tensors = {k: v.clone() for k, v in views[19].items()}  # holds 19 but claims 20
    replica.fingerprints = fpr.state_fingerprints(views[19])
    f = Follower(str(board_dir), RUN, replica, version=20, cache_dir=tmp_path)
    with pytest.raises(Exception, match="fingerprint"):
        await f.catch_up(21)
    assert f.version == 20 and _equal(replica.tensors, views[19])
    assert "rejected" in f.last_error
    await f.stop()


async def test_latest_never_rewinds(published, tmp_path):
    board = LocalBoard(_copy_board(published[0], tmp_path / "b"))
    with pytest.raises(LatestConflictError):
        await board.move_latest(RUN, N_VERSIONS - 1,
                                Latest(run=RUN, version=3, kind="patch", updated=now()))
    with pytest.raises(LatestConflictError):  # stale expectation: a racing writer
        await board.move_latest(RUN, 5, Latest(run=RUN, version=99, kind="patch", updated=now()))
    results = await asyncio.gather(*[
        board.move_latest(RUN, N_VERSIONS - 1, Latest(run=RUN, version=N_VERSIONS + i,
                                                      kind="patch", updated=now()))
        for i in range(2)], return_exceptions=True)
    assert sum(r is None for r in results) == 1
    assert sum(isinstance(r, LatestConflictError) for r in results) == 1


def test_publisher_resumes_a_run_with_a_snapshot(published, tmp_path):
    board = _copy_board(published[0], tmp_path / "b")
    torch.manual_seed(1)
    with Publisher(str(board), RUN, "bf16") as pub:
        info = pub.publish(100, TinyLM())
        m = info.result()
    assert m.version == N_VERSIONS and m.kind == "snapshot" and m.parent == N_VERSIONS - 1


def test_publisher_skips_numbers_left_by_a_crashed_publish(published, tmp_path):
    board = _copy_board(published[0], tmp_path / "b")
    orphan = board / RUN / "versions" / f"{N_VERSIONS:06d}"
    orphan.mkdir()
    (orphan / "patch.stp").write_bytes(b"left by a publisher that died before moving latest")
    with Publisher(str(board), RUN, "bf16") as pub:
        m = pub.publish(7, TinyLM()).result()
    assert m.version == N_VERSIONS + 1 and m.parent == N_VERSIONS - 1
