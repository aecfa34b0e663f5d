"""MegatronPublisher on the CPU: two gloo processes act as the TP=2 (PP=1) ranks of a tiny Qwen2
(QKV bias, GQA, vocabulary padded 203 -> 256), start from HF files and publish after each of a
few AdamW-like steps on their fp32 local shards. The manifests must equal the fingerprints of the
assembled HF weights, `pull` must rebuild the last version exactly, a failed upload on one rank
must fail the version on both (no hang) and the next version skip it, and the collectives during
a publish must carry metadata only (no weight gather).

The workers run this file as a script (`python tests/test_megatron_publish.py WORKDIR RANK`).
"""

from __future__ import annotations

import asyncio
import json
import sys
import zlib
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.test_fsdp import COLLECTIVES, _launch, _same, count_collectives  # noqa: E402
from tests.test_megatron import hf_model, layout_of  # noqa: E402

RUN = "megatron-run"
TP = 2
STEPS = 3  # published as v1..v3
FAIL_STEP = 4  # rank 1's upload fails: both ranks raise, v4 is skipped
LAST = 5  # published as v5, a patch against v3
EXTRA = "decoder.layers.0.self_attention.linear_qkv._extra_state"  # TE state: not published


def layout():
    return layout_of("qwen2", TP, 1)


def initial_shards() -> dict:
    from stitch_trainer.megatron.convert import split_hf

    _, hf = hf_model("qwen2")
    return split_hf(hf, layout(), pad_value=0.5)  # padding rows are never published


def step_shard(sd: dict, step: int, tp_rank: int) -> dict:
    """One AdamW-like update of a rank's fp32 local shard: ~30% of the elements move by lr in a
    random direction (padding included). Replicated tensors (norms) change alike on every TP rank
    (their gradients are all-reduced), so their seed does not depend on the rank."""
    lay = layout()
    out = {}
    for name, t in sd.items():
        rank = 0 if lay.rule_of(name, 0)[0].kind == "replicated" else tp_rank
        g = torch.Generator().manual_seed(zlib.crc32(f"{step}/{rank}/{name}".encode()))
        mask = torch.rand(t.shape, generator=g) < 0.3
        sign = torch.where(torch.rand(t.shape, generator=g) < 0.5, -1.0, 1.0)
        out[name] = t - 1e-2 * sign * mask * t.abs().clamp(min=1e-3)
    return out


def shards_at(step: int) -> dict:
    shards = initial_shards()
    for s in range(1, step + 1):
        shards = {(t, p): step_shard(sd, s, t) for (t, p), sd in shards.items()}
    return shards


# ---------------------------------------------------------------- worker (one per rank)


def worker(work: Path, rank: int) -> None:
    import torch.distributed as dist

    from stitch_core.versions.board.base import BoardError
    from stitch_trainer.fsdp import PublishError
    from stitch_trainer.megatron_publisher import MegatronPublisher

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{work / 'store'}", rank=rank,
                            world_size=TP)
    # this rank's fp32 master shard (test code: split on every rank; the publisher does not
    # use it and cuts its own base shard out of the HF files)
    master = initial_shards()[(rank, 0)]
    report: dict = {"publishes": []}
    with MegatronPublisher(str(work / "board"), RUN, layout(), rank, 0, "bf16") as pub:
        report["start"] = pub.start_from(work / "ckpt", step=0).version
        for step in range(1, LAST + 1):
            master = step_shard(master, step, rank)
            state = {**master, EXTRA: torch.zeros(8, dtype=torch.uint8)}
            if step == FAIL_STEP:
                put = pub.board.put
                if rank == 1:

                    async def failing(key, src, **kw):
                        raise BoardError(f"injected failure for {key}")

                    pub.board.put = failing
                try:
                    pub.publish(step, state)
                except PublishError as e:
                    report["failed"] = str(e)
                pub.board.put = put
                continue
            with count_collectives() as c:
                m = pub.publish(step, state).result()
            report["publishes"].append({"version": m.version, "calls": c["calls"],
                                        "ops": c["ops"]})
    (work / f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


# ---------------------------------------------------------------- parent


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    from safetensors.torch import save_file

    work = tmp_path_factory.mktemp("megatron")
    cfg, hf = hf_model("qwen2")
    (work / "ckpt").mkdir()
    save_file({k: v.contiguous() for k, v in hf.items()}, work / "ckpt" / "model.safetensors")
    cfg.save_pretrained(work / "ckpt")
    _launch(work, script=__file__, world=TP)
    reports = [json.loads((work / f"rank{r}.json").read_text()) for r in range(TP)]
    return work, reports


def expected(step: int) -> dict:
    from stitch_core.format.views import project
    from stitch_trainer.megatron.convert import assemble_hf

    if step == 0:
        return project(hf_model("qwen2")[1], "bf16")
    return project(assemble_hf(shards_at(step), layout()), "bf16")


async def _manifests(work: Path) -> dict:
    from stitch_core.versions.board import LocalBoard
    from stitch_core.versions.store import read_manifest

    board = LocalBoard(work / "board")
    return {v: await read_manifest(board, RUN, v) for v in await board.list_versions(RUN)}


def test_manifests_match_assembled_weights(published):
    from stitch_core.format import dtypes
    from stitch_core.format import fingerprint as fpr

    work, reports = published
    ms = asyncio.run(_manifests(work))
    assert sorted(ms) == [*range(STEPS + 1), LAST]  # v4 failed: skipped
    assert [r["start"] for r in reports] == [0, 0]
    for r in reports:  # both ranks raised the same error, naming rank 1's upload
        assert r["failed"].startswith("v4:") and "rank 1: BoardError: injected" in r["failed"]
    assert ms[0].kind == "snapshot" and all(ms[v].kind == "patch" for v in sorted(ms)[1:])
    assert [ms[v].parent for v in sorted(ms)] == [None, *range(STEPS + 1)]
    prev = None
    for v in sorted(ms):
        want = expected(v)
        assert ms[v].fingerprints == fpr.state_fingerprints(want), v
        assert {t.name: tuple(t.shape) for t in ms[v].tensors} == layout().hf_shapes()
        if v:
            assert [o.path for o in ms[v].patches] == ["part-00000.stp", "part-00001.stp"]
            changed = sum(int((dtypes.int_view(want[k]) != dtypes.int_view(prev[k])).sum())
                          for k in want)
            assert ms[v].changed_elements == changed > 0, v
            assert ms[v].producer.startswith("stitch-rl megatron publisher")
        prev = want


def test_pull_reconstructs_last_version(published, tmp_path):
    from safetensors.torch import load_file

    from stitch_core.versions.board import LocalBoard
    from stitch_core.versions.materialize import pull

    work, _ = published
    out = tmp_path / "pulled"
    m = asyncio.run(pull(LocalBoard(work / "board"), RUN, None, out, tmp_path / "c", quiet=True))
    assert m.version == LAST
    got = {}
    for f in sorted(out.glob("*.safetensors")):
        got.update(load_file(f))
    want = expected(LAST)
    assert got.keys() == want.keys() and all(_same(got[k], want[k]) for k in want)


def test_publish_exchanges_metadata_only(published):
    _, reports = published
    n_tensors = len(layout().hf_shapes())
    for r in reports:
        assert len(r["publishes"]) == STEPS + 1
        for p in r["publishes"]:
            names = [c for c, _ in p["calls"]]
            total = sum(b for _, b in p["calls"])
            assert names.count("all_reduce") == 1, names
            assert total <= 16 * n_tensors + 2048, p["calls"]
            assert not [c for c in names if c.startswith("DTensor.")], names
            assert "all_gather_into_tensor" not in names and "_all_gather_base" not in names
            assert sum(p["ops"].values()) == len([c for c in names if c in COLLECTIVES])


def test_group_must_cover_the_layout(tmp_path):
    """A one-process world cannot hold the two TP ranks."""
    import torch.distributed as dist

    from stitch_trainer.megatron_publisher import MegatronPublisher

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        with pytest.raises(ValueError, match="each of the 2 ranks"):
            MegatronPublisher(str(tmp_path / "board"), RUN, layout(), 0, 0)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    worker(Path(sys.argv[1]), int(sys.argv[2]))
