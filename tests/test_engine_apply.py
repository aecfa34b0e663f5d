"""Coordinator + RankReplica on an engine-style TP model (stitch_dev/toy_engine.py), no engine
needed.

The same code runs inside vLLM workers (tests/vllm); here the ranks are in-process and the RPC
round-trips through pickle like the engine's. A trainer publishes real AdamW versions to a board; a
Follower drives the Coordinator; after every version the TP engine must be bit-identical to a fresh
engine loaded from that version's weights.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from stitch_core.engine import rpc as rpc_
from stitch_core.engine.coordinator import Coordinator
from stitch_core.engine.proof import EngineStateError
from stitch_core.engine.replica import RankReplica, ReplicaError
from stitch_core.format import fingerprint as fpr
from stitch_core.format.stp import PatchError
from stitch_core.versions.board import LocalBoard
from stitch_core.versions.follower import Follower
from stitch_core.versions.materialize import pull
from stitch_core.versions.store import read_manifest
from stitch_dev.toy_engine import HFToy, ToyEngine, publish_toy_run, train
from stitch_trainer.publisher import Publisher

RUN = "toy"
N = 12


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine")
    return root, publish_toy_run(root / "board", RUN, N)


def _engines(world: int, weights: dict[str, torch.Tensor]) -> list[ToyEngine]:
    engines = [ToyEngine(r, world) for r in range(world)]
    for e in engines:
        e.load_weights(iter(weights.items()))
    return engines


def _same(a: ToyEngine, b: ToyEngine) -> bool:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    return pa.keys() == pb.keys() and all(
        torch.equal(pa[k].data.view(torch.uint8), pb[k].data.view(torch.uint8)) for k in pa)


_rpc = rpc_.in_process  # encoded both ways, as through an engine's RPC


async def _start(root: Path, views, world: int, version: int = 0, name: str = "pulled"):
    d = root / f"{name}-{world}-{version}"
    if not d.exists():
        await pull(LocalBoard(root / "board"), RUN, version, d, root / "cache", quiet=True)
    engines = _engines(world, views[version])
    replicas = [RankReplica(e, rank_info={"rank": i}) for i, e in enumerate(engines)]
    coord = Coordinator(_rpc(replicas), run=RUN, loader_fallback=True)
    assert await coord.start(d) == version
    return engines, replicas, coord


@pytest.mark.parametrize("world", [1, 2])
async def test_follows_every_version_bit_exact(published, tmp_path, world):
    root, views = published
    engines, _, coord = await _start(root, views, world)
    assert coord.ranks == world
    # the transforming loader cannot be mapped: it goes through the engine's own loader
    assert sorted(coord.fallback) == ["model.layers.1.scale"]
    assert coord.mult["model.layers.0.input_layernorm.weight"] == world  # replicated: all copies
    assert coord.mult["model.layers.0.self_attn.q_proj.weight"] == 1
    board = LocalBoard(root / "board")
    for v in range(1, N):
        m = await read_manifest(board, RUN, v)
        f = Follower(board, RUN, coord, served=coord.served, cache_dir=tmp_path / "cache")
        await f.catch_up(v)
        assert coord.version == v and f.version == v
        fresh = _engines(world, views[v])
        assert all(_same(a, b) for a, b in zip(engines, fresh, strict=True)), f"v{v}"
        assert coord.fps == m.fingerprints
    stats = coord.history[-1]
    assert stats["changed"] > 0 and stats["write_rank_s"] >= 0
    assert (await coord.verify())["ok"]


async def _corrupt_copy(src: Path, dst: Path, at: int) -> Path:
    b = bytearray(src.read_bytes())
    b[at] ^= 0x40
    dst.write_bytes(bytes(b))
    return dst


async def test_bad_patches_are_refused_and_the_engine_is_untouched(published, tmp_path):
    root, views = published
    engines, _, coord = await _start(root, views, 2, name="bad")
    board = LocalBoard(root / "board")
    cache = tmp_path / "c"
    f = Follower(board, RUN, coord, served=coord.served, cache_dir=cache)
    await f.catch_up(2)
    before = _engines(2, views[2])
    m3 = await read_manifest(board, RUN, 3)
    m4 = await read_manifest(board, RUN, 4)
    f3 = (await _fetch(board, m3, cache))[0]
    f4 = (await _fetch(board, m4, cache))[0]
    size = f3.stat().st_size
    cases = {
        "corrupt": [await _corrupt_copy(f3, tmp_path / "c1.stp", size // 3)],
        "truncated": [_trunc(f3, tmp_path / "t.stp")],
        "out of order": [f4],
    }
    for what, paths in cases.items():
        with pytest.raises((PatchError, ValueError)):
            await coord.apply_patch(m3 if what != "out of order" else m4, paths)
        assert coord.version == 2, what
        assert all(_same(a, b) for a, b in zip(engines, before, strict=True)), what
    # foreign: a patch from another run with the same shapes
    with pytest.raises((PatchError, ValueError)):
        await coord.apply_patch(m3.model_copy(update={"run": "other"}), [f3])
    # a manifest that does not match the patch (forged target fingerprints)
    forged = m3.model_copy(update={"tensors": [t.model_copy(update={"fingerprint": "0" * 16})
                                               for t in m3.tensors]})
    with pytest.raises(PatchError):
        await coord.apply_patch(forged, [f3])
    assert coord.version == 2
    assert all(_same(a, b) for a, b in zip(engines, before, strict=True))
    # the good patch still applies afterwards
    await coord.apply_patch(m3, [f3])
    assert coord.version == 3
    assert all(_same(a, b) for a, b in zip(engines, _engines(2, views[3]), strict=True))


def _trunc(src: Path, dst: Path) -> Path:
    dst.write_bytes(src.read_bytes()[: src.stat().st_size // 2])
    return dst


async def _fetch(board, m, cache):
    from stitch_core.versions.store import fetch_patch

    return await fetch_patch(board, m, cache)


async def test_a_rank_that_writes_wrong_is_undone_everywhere(published, tmp_path):
    root, views = published
    engines, replicas, coord = await _start(root, views, 2, name="liar")
    board = LocalBoard(root / "board")
    m1 = await read_manifest(board, RUN, 1)
    paths = await _fetch(board, m1, tmp_path)
    real_write = replicas[1].write

    def lying_write(apply_id, values, last=True, staged=False, batch=0):  # a wrong delta
        out = real_write(apply_id, values, last, staged, batch)  # (a layout bug)
        name = next(iter(out.delta))
        out.delta[name] = (out.delta[name] + 1) & fpr.MASK64
        return out

    replicas[1].write = lying_write
    with pytest.raises(EngineStateError):
        await coord.apply_patch(m1, paths)
    assert coord.version == 0
    assert all(_same(a, b) for a, b in zip(engines, _engines(2, views[0]), strict=True))
    replicas[1].write = real_write
    await coord.apply_patch(m1, paths)
    assert all(_same(a, b) for a, b in zip(engines, _engines(2, views[1]), strict=True))


async def test_extra_rank_requests_go_through_registered_handlers_only(published, tmp_path):
    """Production ranks answer rpc's requests only; the benchmark's baseline is a handler that
    stitch_dev.rank_baseline registers (and unpickling its request in a rank imports it)."""
    from stitch_dev.rank_baseline import Baseline, BaselineReply

    root, views = published
    _, replicas, coord = await _start(root, views, 2, name="extra")
    board = LocalBoard(root / "board")
    await Follower(board, RUN, coord, served=coord.served, cache_dir=tmp_path / "cache").catch_up(1)
    replies = await coord.rpc(Baseline(repeat=2))
    assert all(isinstance(r, BaselineReply) for r in replies)
    assert sum(r.elements for r in replies) == sum(
        int(e.numel()) for rep in replicas for _, e in rep.last_write) > 0

    class Unknown:
        pass

    with pytest.raises(ReplicaError, match="not a rank request"):
        replicas[0].handle(Unknown())


async def test_silent_corruption_is_caught_by_a_full_check(published):
    root, views = published
    engines, _, coord = await _start(root, views, 2, name="rot")
    assert (await coord.verify())["ok"]
    w = engines[1].model.layers[0].input_layernorm.weight  # one replicated copy on rank 1
    w.data.view(torch.int32)[3] ^= 1
    check = await coord.verify()
    assert not check["ok"] and "model.layers.0.input_layernorm.weight" in check["mismatched"]
    assert coord.version is None  # not serving until recovered


async def test_snapshot_load_through_the_engine_loader(published, tmp_path):
    root, views = published
    engines, _, coord = await _start(root, views, 2, name="snap")
    d = root / "pulled-snap-7"
    await pull(LocalBoard(root / "board"), RUN, 7, d, root / "cache", quiet=True)
    m7 = await read_manifest(LocalBoard(root / "board"), RUN, 7)
    await coord.load_snapshot(m7, d)
    assert coord.version == 7
    assert all(_same(a, b) for a, b in zip(engines, _engines(2, views[7]), strict=True))
    assert (await coord.verify())["ok"]


async def test_engine_started_from_plain_files_waits_for_a_snapshot(published, tmp_path):
    """No stitch-manifest.json: the files are proven against their own fingerprints, but the
    engine holds no version of the run until it loads a snapshot through its loader."""
    root, views = published
    plain = tmp_path / "plain"
    await pull(LocalBoard(root / "board"), RUN, 0, plain, root / "cache", quiet=True)
    (plain / "stitch-manifest.json").unlink()
    engines = _engines(2, views[0])
    replicas = [RankReplica(e) for e in engines]
    coord = Coordinator(_rpc(replicas), run=RUN, loader_fallback=True)
    assert await coord.start(plain) is None
    assert coord.check["ok"] is True and sorted(coord.fallback) == ["model.layers.1.scale"]
    board = LocalBoard(root / "board")
    f = Follower(board, RUN, coord, served=coord.served, cache_dir=tmp_path / "cache")
    assert await f.sync() == N - 1
    assert f.applied == [0, *range(1, N)]  # the snapshot, then every patch
    assert all(_same(a, b) for a, b in zip(engines, _engines(2, views[N - 1]), strict=True))


async def test_unplaceable_tensors_are_refused_unless_the_loader_fallback_is_allowed(published):
    """By default a tensor the layout map cannot place (here: a loader that scales its values)
    stops the start: the engine's copy could not be verified."""
    root, views = published
    d = root / "pulled-refuse"
    await pull(LocalBoard(root / "board"), RUN, 0, d, root / "cache", quiet=True)
    coord = Coordinator(_rpc([RankReplica(e) for e in _engines(1, views[0])]), run=RUN)
    with pytest.raises(EngineStateError, match=r"model\.layers\.1\.scale.*STITCH_LOADER_FALLBACK"):
        await coord.start(d)
    assert coord.version is None


async def test_params_computed_after_loading_are_refused_unless_allowed(published):
    """An engine param that no loader writes (vLLM's MLA layers compute W_UK_T/W_UV from
    kv_b_proj after loading) cannot be kept in step by patches: the start is refused, naming it,
    unless the loader fallback is allowed (then it is reported in the status)."""
    root, views = published
    d = root / "pulled-derived"
    await pull(LocalBoard(root / "board"), RUN, 0, d, root / "cache", quiet=True)

    class Absorbing(ToyEngine):
        def __init__(self, rank=0, world=1):
            super().__init__(rank, world)
            self.absorbed = torch.nn.Parameter(torch.zeros(4, 4), requires_grad=False)

    def engines():
        es = [Absorbing(r, 2) for r in range(2)]
        for e in es:
            e.load_weights(iter(views[0].items()))
            e.absorbed.data.fill_(1.0)  # the post-load step
        return es

    strict = Coordinator(_rpc([RankReplica(e) for e in engines()]), run=RUN)
    with pytest.raises(EngineStateError, match=r"written by no loader.*absorbed"):
        await strict.start(d)
    assert strict.version is None
    coord = Coordinator(_rpc([RankReplica(e) for e in engines()]), run=RUN, loader_fallback=True)
    assert await coord.start(d) == 0
    assert coord.status()["derived_params"] == ["absorbed"]


async def test_unregistered_packed_copies_are_refused_and_stale_ones_fail_verify(published):
    """A kernel's private copy of a weight that no adapter registered (a closure over a tensor,
    the shape of vLLM's packed CPU weights) is refused at start-up by name. A registered copy that
    is left stale (its weight changed without a rebuild) fails the full check."""
    from stitch_core.engine import derived

    root, views = published
    d = root / "pulled-packed"
    await pull(LocalBoard(root / "board"), RUN, 0, d, root / "cache", quiet=True)

    def engines(register: bool):
        es = _engines(2, views[0])
        for e in es:
            mod = e.model.layers[0].down_proj
            packed = mod.weight.detach().clone()
            mod.cpu_linear = (lambda p: (lambda x: x @ p.t()))(packed)
            if register:
                derived.register(mod, "toy", {"weight": mod.weight}, lambda: None,
                                 holders=("cpu_linear",))
        return es

    strict = Coordinator(_rpc([RankReplica(e) for e in engines(False)]), run=RUN)
    with pytest.raises(EngineStateError, match=r"written by no loader.*down_proj\.cpu_linear"):
        await strict.start(d)
    es = engines(True)
    # (the fallback covers the toy's transformed `scale`, not the copies: none is unregistered)
    coord = Coordinator(_rpc([RankReplica(e) for e in es]), run=RUN, loader_fallback=True)
    assert await coord.start(d) == 0
    assert coord.status()["derived_params"] == []
    assert coord.status()["derived_copies"] == {"toy": 2}
    assert (await coord.verify())["ok"] is True
    with torch.no_grad():  # the weight changes behind the copy's back (no rebuild)
        w = es[1].model.layers[0].down_proj.weight
        w.view(-1)[0] = w.view(-1)[0] * 2 + 1
    check = await coord.verify()
    assert check["ok"] is False
    assert any("down_proj (toy)" in s for s in check["stale_derived"]), check
    assert coord.version is None  # not serving what it cannot prove


async def test_a_tensor_the_engine_does_not_load_is_neither_proven_nor_written(tmp_path):
    """A checkpoint tensor the engine's loaders skip (as vLLM skips a tied lm_head) maps to no
    element on any rank: it is reported as unheld, not refused, and patches to it are skipped
    while everything else is applied and proven."""
    torch.manual_seed(0)
    model = HFToy()
    extra = torch.randn(4, 4)

    def state(m) -> dict[str, torch.Tensor]:
        return {**{k: v.detach().clone() for k, v in m.state_dict().items()},
                "extra.weight": extra.clone()}

    views = []
    with Publisher(str(tmp_path / "board"), RUN, "bf16") as pub:
        for step, m in enumerate([model, *train(model, 2)]):
            extra.add_(0.5)  # the skipped tensor changes every version too
            pub.publish(step, state(m)).result()
            views.append({k: v.to(torch.bfloat16) for k, v in state(m).items()})

    class Skipping(ToyEngine):
        def load_weights(self, weights):
            return super().load_weights((n, t) for n, t in weights if n != "extra.weight")

    await pull(LocalBoard(tmp_path / "board"), RUN, 0, tmp_path / "v0", tmp_path / "c",
               quiet=True)
    def skipping_engines():
        engines = [Skipping(r, 2) for r in range(2)]
        for e in engines:
            e.load_weights(iter(views[0].items()))
        return engines

    strict = Coordinator(_rpc([RankReplica(e) for e in skipping_engines()]), run=RUN)
    with pytest.raises(EngineStateError) as refused:  # only for the scaled tensor
        await strict.start(tmp_path / "v0")
    assert "layers.1.scale" in str(refused.value) and "extra" not in str(refused.value)
    engines = skipping_engines()
    coord = Coordinator(_rpc([RankReplica(e) for e in engines]), run=RUN, loader_fallback=True)
    assert await coord.start(tmp_path / "v0") == 0
    assert coord.unheld == ["extra.weight"] and coord.status()["unheld_tensors"] == ["extra.weight"]
    assert sorted(coord.fallback) == ["model.layers.1.scale"]
    board = LocalBoard(tmp_path / "board")
    f = Follower(board, RUN, coord, served=coord.served, cache_dir=tmp_path / "cache")
    assert await f.sync() == 2
    want = _engines(2, {k: v for k, v in views[2].items() if k != "extra.weight"})
    assert all(_same(a, b) for a, b in zip(engines, want, strict=True))
    assert (await coord.verify())["ok"] is True


async def test_start_with_trust_set_proves_the_pulled_dir_against_a_signed_manifest(published,
                                                                                   tmp_path):
    """STITCH_TRUST on an engine: its directory must carry a manifest signed by a trusted key;
    an unsigned one, one by another key, an edited one or none at all is refused at start-up
    (the engine never serves); a signed one is proven rank by rank as without trust."""
    from stitch_core.versions.manifest import PULLED_MANIFEST, Manifest
    from stitch_core.versions.trust import SigningKey, TrustSet, new_key

    root, views = published
    for n in ("good", "other"):
        new_key(tmp_path / n)
    good, other = SigningKey.load(tmp_path / "good"), SigningKey.load(tmp_path / "other")
    trust = TrustSet.parse([f"{tmp_path / 'good'}.pub"])
    d = root / "pulled-trust"
    if not d.exists():
        await pull(LocalBoard(root / "board"), RUN, 3, d, root / "cache", quiet=True)
    unsigned = Manifest.model_validate_json((d / PULLED_MANIFEST).read_text())

    def start_with(m: Manifest | None):
        if m is None:
            (d / PULLED_MANIFEST).unlink(missing_ok=True)
        else:
            (d / PULLED_MANIFEST).write_text(m.model_dump_json())
        engines = _engines(2, views[3])
        coord = Coordinator(_rpc([RankReplica(e) for e in engines]), run=RUN,
                            loader_fallback=True)
        return coord, coord.start(d, trust=trust)

    signed = good.sign(unsigned, "manifest")
    edited = signed.model_copy(update={"created": "2020-01-01T00:00:00.000+00:00"})
    for m, why in [(unsigned, "is unsigned"), (other.sign(unsigned, "manifest"), "not trusted"),
                   (edited, "does not match"), (None, "has no stitch-manifest.json")]:
        coord, started = start_with(m)
        with pytest.raises(EngineStateError, match=why):
            await started
        assert coord.version is None  # holds nothing: serves nothing
    coord, started = start_with(signed)
    assert await started == 3 and coord.check["ok"] is True
    # a signed manifest whose fingerprints are not what the ranks hold is not proven either
    fake = good.sign(unsigned.model_copy(update={"tensors": [
        unsigned.tensors[0].model_copy(update={"fingerprint": "0" * 16}),
        *unsigned.tensors[1:]]}), "manifest")
    coord, started = start_with(fake)
    with pytest.raises(EngineStateError):
        await started
    (d / PULLED_MANIFEST).write_text(unsigned.model_dump_json())


@pytest.mark.parametrize("staged", [True, False], ids=["staged", "in-pause"])
@pytest.mark.parametrize("world", [1, 2])
async def test_patches_over_the_memory_budget_apply_in_batches_bit_exact(published, tmp_path,
                                                                         world, staged):
    """A tiny apply budget: every patch is decoded in many bounded batches (tensors split across
    batches), with the same result as one batch: all staged on the ranks before the pause and
    written in one call per rank (`STITCH_STAGE_MEMORY`), or, with no stage budget, the later
    ones gathered, decoded and written inside the pause."""
    from stitch_core.engine.coordinator import APPLY_BYTES_PER_ELEMENT

    root, views = published
    engines, replicas, coord = await _start(root, views, world, name="batched")
    coord.apply_memory = 900 * APPLY_BYTES_PER_ELEMENT  # 900 elements at a time
    if not staged:
        coord.stage_memory = 0
    calls: list[tuple[bool, bool]] = []  # (last, staged) of rank 0's writes
    real_write = replicas[0].write

    def counted(apply_id, values, last=True, staged=False, batch=0):
        calls.append((last, staged))
        return real_write(apply_id, values, last, staged, batch)

    replicas[0].write = counted
    board = LocalBoard(root / "board")
    f = Follower(board, RUN, coord, served=coord.served, cache_dir=tmp_path / "cache")
    for v in range(1, 5):
        calls.clear()
        await f.catch_up(v)
        assert coord.version == v
        assert all(_same(a, b) for a, b in zip(engines, _engines(world, views[v]), strict=True))
        st = coord.last_apply
        assert st["batches"] >= st["changed"] // 900 >= 2, st
        if staged:
            assert st["staged_batches"] == st["batches"] and calls == [(True, True)], (st, calls)
        else:
            assert st["staged_batches"] == 0 and len(calls) == st["batches"], (st, calls)
        assert not replicas[0]._plans and replicas[0]._ahead.values(replicas[0]._plan_id) is None
    assert (await coord.verify())["ok"]


async def test_a_late_batch_that_decodes_wrong_is_refused_before_anything_is_written(
        published, tmp_path, monkeypatch):
    """Staged, every batch is decoded and checked before the pause: a chunk of a late batch that
    decodes to other values fails the apply with no rank having written anything."""
    from stitch_core.engine import decode
    from stitch_core.engine.coordinator import APPLY_BYTES_PER_ELEMENT

    root, views = published
    engines, replicas, coord = await _start(root, views, 2, name="latewrong")
    coord.apply_memory = 1000 * APPLY_BYTES_PER_ELEMENT
    board = LocalBoard(root / "board")
    m1 = await read_manifest(board, RUN, 1)
    paths = await _fetch(board, m1, tmp_path)
    writes, gathers = [], []
    for r in replicas:
        real_write, real_gather = r.write, r.gather
        r.write = lambda *a, _w=real_write, **k: writes.append(a) or _w(*a, **k)
        r.gather = lambda aid, pos, batch=0, _g=real_gather: gathers.append(batch) or _g(
            aid, pos, batch)
    real_decode, wrong = decode.decode_chunk, []

    def late_wrong(*a, **k):  # the first chunk of the third batch decodes one bit off
        v = real_decode(*a, **k)
        if max(gathers) >= 2 and not wrong:
            wrong.append(a[0])
            v = v.clone()
            v.view(-1)[0] ^= 1  # integer bits
        return v

    monkeypatch.setattr(decode, "decode_chunk", late_wrong)
    with pytest.raises(PatchError, match="fingerprint"):
        await coord.apply_patch(m1, paths)
    assert wrong and writes == []  # refused in a later batch, before any write
    # and the ranks let go of the batches they had staged
    assert all(r._plan_id is None and r._plans == {} and r._ahead.bits == {} for r in replicas)
    assert coord.version == 0 and (await coord.verify())["ok"]
    assert all(_same(a, b) for a, b in zip(engines, _engines(2, views[0]), strict=True))
    monkeypatch.setattr(decode, "decode_chunk", real_decode)
    await coord.apply_patch(m1, paths)
    assert coord.last_apply["staged_batches"] == coord.last_apply["batches"] >= 3
    assert all(_same(a, b) for a, b in zip(engines, _engines(2, views[1]), strict=True))


async def test_a_rank_that_cannot_stage_a_batch_falls_back_to_the_batches_in_the_pause(
        published, tmp_path):
    from stitch_core.engine.coordinator import APPLY_BYTES_PER_ELEMENT

    root, views = published
    engines, replicas, coord = await _start(root, views, 2, name="nostage")
    coord.apply_memory = 1000 * APPLY_BYTES_PER_ELEMENT
    board = LocalBoard(root / "board")
    m1 = await read_manifest(board, RUN, 1)
    real_prebuild = replicas[1].prebuild

    def full(apply_id, values, batch=0, build=True):
        if values is not None and batch == 1:
            raise MemoryError("rank 1 cannot hold another batch")
        return real_prebuild(apply_id, values, batch, build)

    replicas[1].prebuild = full
    await coord.apply_patch(m1, await _fetch(board, m1, tmp_path))
    st = coord.last_apply
    assert coord.version == 1 and st["staged_batches"] == 0 and st["batches"] >= 3, st
    assert all(_same(a, b) for a, b in zip(engines, _engines(2, views[1]), strict=True))
    assert (await coord.verify())["ok"]


async def test_a_bad_chunk_in_a_late_batch_undoes_the_earlier_batches(published, tmp_path):
    """Batches written before a failing one are undone on every rank: the transaction covers
    the whole patch, not one batch."""
    from stitch_core.engine.coordinator import APPLY_BYTES_PER_ELEMENT

    root, views = published
    engines, replicas, coord = await _start(root, views, 2, name="latebad")
    coord.apply_memory = 1000 * APPLY_BYTES_PER_ELEMENT
    coord.stage_memory = 0  # the later batches written one by one in the pause
    board = LocalBoard(root / "board")
    m1 = await read_manifest(board, RUN, 1)
    paths = await _fetch(board, m1, tmp_path)
    writes = []
    real_write = replicas[1].write

    def counting_write(apply_id, values, last=True, staged=False, batch=0):
        writes.append((apply_id, last))
        if len(writes) == 4:
            raise RuntimeError("rank 1 fails in the fourth batch")
        return real_write(apply_id, values, last, staged, batch)

    replicas[1].write = counting_write
    with pytest.raises(RuntimeError, match="fourth batch"):
        await coord.apply_patch(m1, paths)
    assert len(writes) == 4 and len({a for a, _ in writes}) == 1  # one apply id for all batches
    assert not any(last for _, last in writes)  # more batches were to come
    assert coord.version == 0 and (await coord.verify())["ok"]
    assert all(_same(a, b) for a, b in zip(engines, _engines(2, views[0]), strict=True))
    replicas[1].write = real_write
    await coord.apply_patch(m1, paths)
    assert all(_same(a, b) for a, b in zip(engines, _engines(2, views[1]), strict=True))


async def test_a_chunk_over_the_budget_is_refused_before_anything_is_written(published, tmp_path):
    root, views = published
    engines, _, coord = await _start(root, views, 1, name="tiny")
    coord.apply_memory = 1  # one element: every real chunk is over it
    board = LocalBoard(root / "board")
    m1 = await read_manifest(board, RUN, 1)
    with pytest.raises(PatchError, match="apply budget"):
        await coord.apply_patch(m1, await _fetch(board, m1, tmp_path))
    assert coord.version == 0
    assert all(_same(a, b) for a, b in zip(engines, _engines(1, views[0]), strict=True))


def test_sums_in_parallel_equal_sums_in_one_thread(published):
    """Start-up sums tensors on the engine's threads; the result may not depend on it."""
    _root, views = published
    for world in (1, 2):
        for e in _engines(world, views[1]):
            rep = RankReplica(e)
            shapes = {n: (tuple(t.shape), "BF16" if t.dtype == torch.bfloat16 else "F32")
                      for n, t in views[1].items()}
            rep.setup(shapes)
            one = rep.sums()
            assert rep.sums(threads=4) == one
            assert rep.sums(list(one)[:3], threads=3) == {n: one[n] for n in list(one)[:3]}


def test_gather_refuses_positions_out_of_range_and_returns_old_bits_by_copy(published):
    """A hostile or broken coordinator's positions (negative, past the tensor) are refused by
    name; old bits come back as a copy, not a view of what undo keeps."""
    _root, views = published
    for world in (1, 2):
        e = _engines(world, views[1])[0]
        rep = RankReplica(e)
        rep.setup({n: (tuple(t.shape), "BF16" if t.dtype == torch.bfloat16 else "F32")
                   for n, t in views[1].items()})
        name = next(n for n, t in views[1].items() if t.dtype == torch.bfloat16 and t.dim() == 2)
        n = views[1][name].numel()
        for bad in ([0, -1], [n], [3, n + 7]):
            with pytest.raises(ReplicaError, match=f"{name}: position out of range"):
                rep.gather("x", {name: np.array(bad, dtype=np.int64)})
        pos = np.arange(0, n, 7, dtype=np.int64)
        held = rep.gather("y", {name: pos}).old[name]
        kept = held.bits.copy()
        held.bits[:] = 0  # the caller's copy is the caller's: the write's undo is untouched
        rep.write("y", {name: np.zeros(len(pos), dtype=np.int16)})
        rep.undo("y")
        flat = views[1][name].reshape(-1).view(torch.int16)
        idx = pos if held.index is None else pos[held.index]
        assert np.array_equal(kept, flat[torch.from_numpy(idx)].numpy())
        assert _same(e, _engines(world, views[1])[0])
