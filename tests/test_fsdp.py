"""FSDPPublisher on the CPU: two gloo processes train a tiny Llama sharded with FSDP2 (uneven
shards, one empty local shard) and publish every step. The versions must be bit-identical to the
single-process Publisher's, `pull` and a following MemoryReplica must rebuild them exactly, a
failed upload on one rank must fail the version on both (no hang) and later versions skip it, and
the collectives during a publish must carry metadata only (no weight gather).

The workers run this file as a script (`python tests/test_fsdp.py WORKDIR RANK`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from pathlib import Path

import pytest
import torch

RUN = "fsdp-run"
WORLD = 2
STEPS = 6  # a publish after each step; the last one by a restarted publisher
FAIL_STEPS = (3, 5)  # rank 1's upload fails: v3 is skipped in-process, v5 after the restart
TIMEOUT = 240.0


def build_model() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=255,  # odd: embed/lm_head rows split 128 / 127
        hidden_size=64,
        intermediate_size=97,  # odd: gate/up rows split 49 / 48
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    # one row: rank 1's local shard is empty
    model.register_parameter("tiny", torch.nn.Parameter(torch.randn(1, 3)))
    return model


# ---------------------------------------------------------------- worker (one per rank)


COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "_all_gather_base",
    "broadcast",
    "gather",
    "scatter",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "send",
    "recv",
    "isend",
    "irecv",
)
OBJECT_COLLECTIVES = ("all_gather_object", "gather_object", "broadcast_object_list")


def _tensor_bytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_tensor_bytes(y) for y in x)
    return 0


@contextlib.contextmanager
def count_collectives():
    """Record every c10d collective (name, bytes of its tensor arguments, inputs and outputs),
    every DTensor gather or redistribution, and CommDebugMode's per-op counts."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.debug import CommDebugMode

    calls: list[tuple[str, int]] = []
    saved = []

    def wrap(name, fn):
        def counted(*a, **k):
            n = 0 if name in OBJECT_COLLECTIVES else _tensor_bytes(list(a) + list(k.values()))
            calls.append((name, n))
            return fn(*a, **k)

        return counted

    for mod in (dist, c10d):  # dist.X for direct calls, c10d.X for calls inside c10d
        for name in COLLECTIVES + OBJECT_COLLECTIVES:
            fn = getattr(mod, name, None)
            if fn is not None:
                saved.append((mod, name, fn))
                setattr(mod, name, wrap(name, fn))
    for name in ("full_tensor", "redistribute"):
        fn = getattr(DTensor, name)
        saved.append((DTensor, name, fn))
        setattr(DTensor, name, wrap(f"DTensor.{name}", fn))
    comm = CommDebugMode()
    out = {"calls": calls, "ops": {}}
    try:
        with comm:
            yield out
    finally:
        for mod, name, fn in saved:
            setattr(mod, name, fn)
        out["ops"] = {str(k): v for k, v in comm.get_comm_counts().items()}


def worker(work: Path, rank: int) -> None:
    import torch.distributed as dist
    from safetensors.torch import load_file, save_file
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from stitch_core.versions.board.base import BoardError
    from stitch_trainer.fsdp import FSDPPublisher, PublishError, local_slice, local_slices
    from stitch_trainer.publisher import named_tensors

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{work / 'store'}", rank=rank, world_size=WORLD
    )
    mesh = init_device_mesh("cpu", (WORLD,))
    model = build_model()
    if rank == 0:  # the checkpoint the run starts from (HF layout, fp32)
        (work / "ckpt").mkdir()
        sd = {k: v.contiguous() for k, v in named_tensors(model).items()}
        save_file(sd, work / "ckpt" / "model.safetensors")
        model.config.save_pretrained(work / "ckpt")
    dist.barrier()
    model.load_state_dict(load_file(work / "ckpt" / "model.safetensors"))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(100 + rank)  # data parallel: each rank its own batch
    batches = [torch.randint(0, 255, (2, 16), generator=g) for _ in range(STEPS)]
    board = str(work / "board")
    report: dict = {"slices": {}, "publishes": []}
    for n, s in local_slices(model, rank).items():
        report["slices"][n] = [s.start, s.stop, s.offset, list(s.shape)]
    for what, t in [  # other placements (test code: distribute_tensor communicates)
        ("replicate", distribute_tensor(torch.ones(3, 2), mesh, [Replicate()])),
        ("plain", torch.ones(3, 2)),
        ("scalar", torch.ones(())),
        ("shard1", distribute_tensor(torch.ones(2, 4), mesh, [Shard(1)])),
    ]:
        try:
            s = local_slice(t, rank)
            report[what] = [s.start, s.stop, list(s.tensor.shape)]
        except NotImplementedError as e:
            report[what] = str(e)

    def train(step: int) -> None:
        loss = model(input_ids=batches[step - 1], labels=batches[step - 1]).loss
        loss.backward()
        opt.step()
        opt.zero_grad()

    def publish(pub: FSDPPublisher, step: int) -> None:
        with count_collectives() as c:
            t0 = time.perf_counter()
            m = pub.publish(step, model).result()
            secs = time.perf_counter() - t0
        report["publishes"].append(
            {
                "step": step,
                "version": m.version,
                "patch_bytes": m.patch_bytes,
                "seconds": secs,
                "calls": c["calls"],
                "ops": c["ops"],
            }
        )
        # test only, outside the counted region: the full weights, to compare in the parent
        full = {n: t.full_tensor() for n, t in model.state_dict().items()}
        if rank == 0:
            torch.save(full, work / f"full-{m.version}.pt")

    pub = FSDPPublisher(board, RUN, "bf16", signing_key=work / "key")  # rank 0 signs
    m0 = pub.start_from(work / "ckpt", step=0)
    report["start"] = m0.version
    report["failed"] = []
    for step in range(1, STEPS):
        train(step)
        if step not in FAIL_STEPS:
            publish(pub, step)
            continue
        if rank == 1:  # this rank's upload fails: both ranks must raise, none may hang
            put = pub.board.put

            async def failing(key, src, **kw):
                raise BoardError(f"injected failure for {key}")

            pub.board.put = failing
        try:
            pub.publish(step, model)
        except PublishError as e:
            report["failed"].append(str(e))
        if rank == 1:
            pub.board.put = put
    pub.close()
    # a restarted publisher continues from `latest` (materialised by every rank), skipping v5
    # where rank 0's part of the failed publish lies
    with FSDPPublisher(board, RUN, "bf16", signing_key=work / "key") as pub2:
        report["resumed_from"] = pub2.start_from().version
        train(STEPS)
        publish(pub2, STEPS)
    (work / f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


# ---------------------------------------------------------------- parent


def _launch(work: Path, script: str = __file__, world: int = WORLD) -> None:
    """Run `script WORK RANK` as `world` processes; fail with their logs if any fails."""
    # the parent only (ranks run this file as a script, without the checkout on sys.path)
    from stitch_dev.ranks import rank_env, run_ranks

    env = rank_env(PYTHONHASHSEED="0")
    run_ranks(work, world, lambda r: [sys.executable, script, str(work), str(r)],
              lambda r: env, TIMEOUT, pytest.fail)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    from stitch_core.format import dtypes

    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(dtypes.int_view(a), dtypes.int_view(b))
    )


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from stitch_core.versions.trust import new_key

    work = tmp_path_factory.mktemp("fsdp")
    new_key(work / "key")
    _launch(work)
    reports = [json.loads((work / f"rank{r}.json").read_text()) for r in range(WORLD)]
    return work, reports


def _versions(work: Path) -> list[int]:
    return sorted(int(p.stem.split("-")[1]) for p in work.glob("full-*.pt"))


def _expected(work: Path, version: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    from stitch_core.format.views import project

    if version == 0:
        return project(load_file(work / "ckpt" / "model.safetensors"), "bf16")
    return project(torch.load(work / f"full-{version}.pt"), "bf16")


async def _manifests(work: Path) -> dict:
    from stitch_core.versions.board import LocalBoard
    from stitch_core.versions.store import read_manifest

    board = LocalBoard(work / "board")
    return {v: await read_manifest(board, RUN, v) for v in await board.list_versions(RUN)}


def test_versions_match_single_process_publisher(trained, tmp_path):
    from stitch_core.format import fingerprint as fpr
    from stitch_trainer.publisher import Publisher

    work, reports = trained
    ms = asyncio.run(_manifests(work))
    assert sorted(ms) == [0, 1, 2, 4, 6] == [0, *_versions(work)]  # v3, v5 failed: skipped
    assert [ms[v].parent for v in sorted(ms)] == [None, 0, 1, 2, 4]
    assert ms[0].kind == "snapshot" and {o.path for o in ms[0].objects} == {
        "model.safetensors",
        "config.json",
    }
    assert all(ms[v].kind == "patch" for v in sorted(ms)[1:])
    assert all(
        [o.path for o in ms[v].patches] == ["part-00000.stp", "part-00001.stp"]
        for v in sorted(ms)[1:]
    )
    assert [r["resumed_from"] for r in reports] == [4, 4]
    for r in reports:  # both ranks raised the same error, naming rank 1's upload
        assert [e.split(":")[0] for e in r["failed"]] == ["v3", "v5"]
        assert all("rank 1: BoardError: injected failure" in e for e in r["failed"])
    # the same weights through the single-process Publisher: same fingerprints, digest, changes
    with Publisher(str(tmp_path / "single"), RUN, "bf16") as pub:
        infos = [pub.publish(v, _expected(work, v)) for v in sorted(ms)]
        single = [i.result() for i in infos]
    for v, s in zip(sorted(ms), single, strict=True):
        want = fpr.state_fingerprints(_expected(work, v))
        assert ms[v].fingerprints == want == s.fingerprints, v
        assert ms[v].digest == s.digest, v
        assert [t.model_dump() for t in ms[v].tensors] == [t.model_dump() for t in s.tensors]
        assert ms[v].changed_elements == s.changed_elements, v
        assert ms[v].total_elements == s.total_elements
    assert all(ms[v].changed_elements > 0 for v in sorted(ms)[1:])


def test_local_rows_follow_dtensor_split(trained):
    _, (r0, r1) = trained
    assert r0["slices"]["model.embed_tokens.weight"][:3] == [0, 128, 0]
    assert r1["slices"]["model.embed_tokens.weight"][:3] == [128, 255, 128 * 64]
    assert r0["slices"]["model.layers.0.mlp.up_proj.weight"][:2] == [0, 49]
    assert r1["slices"]["model.layers.0.mlp.up_proj.weight"][:2] == [49, 97]
    assert r0["slices"]["tiny"][:2] == [0, 1] and r1["slices"]["tiny"][:2] == [1, 1]  # empty
    assert r0["slices"].keys() == r1["slices"].keys()
    # replicated rows are published once, by index 0 of the replicated mesh dimension
    assert r0["replicate"] == [0, 3, [3, 2]] and r1["replicate"] == [0, 0, [0, 2]]
    assert r0["plain"] == [0, 3, [3, 2]] and r1["plain"] == [0, 0, [0, 2]]
    assert r0["scalar"] == [0, 1, []] and r1["scalar"] == [0, 0, [0]]
    assert "only Shard(0) and Replicate" in r0["shard1"] and r0["shard1"] == r1["shard1"]


def test_pull_reconstructs_last_version(trained, tmp_path):
    from safetensors.torch import load_file

    from stitch_core.versions.board import LocalBoard
    from stitch_core.versions.materialize import pull

    work, _ = trained
    last = _versions(work)[-1]
    out = tmp_path / "pulled"
    m = asyncio.run(pull(LocalBoard(work / "board"), RUN, None, out, tmp_path / "c", quiet=True))
    assert m.version == last
    got = {}
    for f in sorted(out.glob("*.safetensors")):
        got.update(load_file(f))
    want = _expected(work, last)
    assert got.keys() == want.keys() and all(_same(got[k], want[k]) for k in want)


def test_follower_follows_every_version(trained, tmp_path):
    from stitch_core.versions.board import LocalBoard
    from stitch_core.versions.follower import Follower
    from stitch_core.versions.memory_replica import MemoryReplica

    work, _ = trained

    async def go() -> list[int]:
        replica = MemoryReplica()
        f = Follower(LocalBoard(work / "board"), RUN, replica, cache_dir=tmp_path / "cache")
        try:
            for v in [0, *_versions(work)]:
                await f.catch_up(v)
                want = _expected(work, v)
                assert f.version == v and replica.tensors.keys() == want.keys()
                assert all(_same(replica.tensors[k], want[k]) for k in want), v
            return f.applied
        finally:
            await f.stop()

    assert asyncio.run(go()) == [0, 1, 2, 4, 6]


def test_publish_exchanges_metadata_only(trained):
    _, reports = trained
    n_tensors = len(reports[0]["slices"])
    for r in reports:
        assert len(r["publishes"]) == 4
        for p in r["publishes"]:
            names = [c for c, _ in p["calls"]]
            total = sum(b for _, b in p["calls"])
            assert not [c for c in names if c.startswith("DTensor.")], names
            # one all-reduce of 1 + 2 * tensors int64, the object collectives' size/payload
            # tensors (all-gather of part metadata, broadcast of rank 0's status): a few KB
            assert names.count("all_reduce") == 1
            assert total <= 16 * n_tensors + 2048, p["calls"]  # measured: 1347 B for 22 tensors
            assert "all_gather_into_tensor" not in names and "_all_gather_base" not in names
            # the dispatcher's view (CommDebugMode): the same c10d ops, no functional collectives
            # (DTensor gathers and redistributions go through those)
            assert sum(p["ops"].values()) == len([c for c in names if c in COLLECTIVES])
            assert not [k for k in p["ops"] if "functional" in k or "scatter" in k], p["ops"]


@pytest.mark.parametrize("view", ["fp8-e4m3", "fp8-e4m3-tensor", "mxfp4", "nvfp4"])
def test_quantized_views_are_refused(view):
    """Scales are computed over whole tensors: a rank's shard cannot project them."""
    from stitch_trainer.fsdp import FSDPPublisher

    with pytest.raises(NotImplementedError, match="scales of a quantized view"):
        FSDPPublisher("/nonexistent", RUN, view)


if __name__ == "__main__":
    worker(Path(sys.argv[1]), int(sys.argv[2]))


def test_every_sharded_version_and_latest_are_signed_once(trained):
    """One signature per version, made on rank 0 where the manifest is assembled (snapshot and
    multi-part patches alike), and on `latest`; a trust set accepts them all."""
    from stitch_core.versions.board import LocalBoard
    from stitch_core.versions.store import read_latest, read_manifest
    from stitch_core.versions.trust import SigningKey, TrustSet

    work, _ = trained
    trust = TrustSet.parse([f"{work / 'key'}.pub"])
    kid = SigningKey.load(work / "key").id

    async def check():
        board = LocalBoard(work / "board")
        versions = await board.list_versions(RUN)
        ms = [await read_manifest(board, RUN, v, trust) for v in versions]
        latest = await read_latest(board, RUN, trust)
        return ms, latest

    ms, latest = asyncio.run(check())
    assert {m.signed_by for m in ms} == {kid} and latest.signed_by == kid
    assert any(len(m.patches) == WORLD for m in ms)  # multi-part patches among them
