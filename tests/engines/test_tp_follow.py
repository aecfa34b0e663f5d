"""Followers at TP=2 against fresh engines of the same TP loaded from `stitch pull` of the same
version. The case runs on the session's TP=2 engine after the fault drills (an adapter's
`tp_cases` marked shared: vLLM's Qwen3-MoE. SGLang has none: its TP=2 engine is proven on every
rank by the fault drills, but its outputs are not compared with a fresh TP=2 engine's). A
realistic-shape follower at TP=2 with its own engines took 80-180 s of the test command per
engine and was dropped; the realistic shape runs on vLLM at TP=1 (tests/vllm/test_layout.py).

The realistic model (stitch_dev.tinymodel.REALISTIC: a tied Llama, 24 layers, GQA 8/2, hidden 512,
vocab 32800) is trained by AdamW at an RL learning rate (3e-6), so each version flips a realistic
~1% of the served bf16 weights; greedy tokens and top logprobs must equal a fresh engine's exactly.
Where vLLM's CPU backend packs weights (AMX / oneDNN; a tied lm_head keeps its own packed copy of
the embedding), the status names the packed copies kept in step and the test prints them;
SGLang's CPU engine here packs nothing (its AMX path needs the real sgl-kernel, which has no CPU
build on the registry): the test prints the path it exercised.

TP=2 on the CPU: two worker (vLLM) or scheduler (SGLang) processes, gloo. Each rank learns its
own layout (qkv/gate-up column slices, o/down row slices, vocab-parallel embedding and lm_head,
replicated norms; for Qwen3-MoE also each expert's slice of the fused expert weights) through the
engine's own loaders, writes only what it holds, and the coordinator checks that the two ranks'
fingerprint sums add up (replicated tensors count once per rank). On SGLang the RPC reaches both
ranks through one control request (rank 0 gathers).

The case runs on the session's TP=2 engine right after the fault scenarios
(test_tp2_faults.py: an engine that lived through them must still match a fresh one).
"""

from __future__ import annotations

import asyncio

import pytest

from stitch_core.versions.board import LocalBoard
from stitch_core.versions.materialize import pull
from stitch_dev.engines import adapter
from stitch_dev.server import verify_clean

from ..engine_common import follow_versions
from .conftest import ENGINE

VERSIONS = 2  # two patches in a row (fewer versions: the test command's time)
SHARED = [c for c in adapter(ENGINE).tp_cases if c[2]] if ENGINE else []


def follow_and_compare(engine, server, trainer, root, tp: int, start: int, arch: str,
                       record_cpu_path, stop) -> None:
    """From `start` (the version the engine serves), follow VERSIONS versions, then compare with
    a fresh engine of the same TP loaded from a pull of the last one (`stop()` first, unless
    None: the cores go to the fresh engine)."""
    st = server.wait_version(start, timeout=600)
    assert st["ranks"] == tp and st["fingerprint_check"]["ok"] is True
    assert st["fallback_tensors"] == []
    record_cpu_path(st["derived_copies"])
    changed = follow_versions(trainer, server, VERSIONS,
                              lambda v: engine.pinned(server, v, 300))
    target = start + VERSIONS
    la = server.wait_version(target, timeout=60)["last_apply"]
    if {"onednn", "amx", "moe-packed"} & set(st["derived_copies"]):
        # every packed copy the apply changed (linear layers and, for MoE, the experts' grouped
        # copies) was built ahead of the pause on each rank and only installed in it
        assert la["derived_ahead"] == la["derived_rebuilt"] > 0, la
    seen = server.outputs(target)
    verify_clean(server)
    if stop is not None:
        stop()
    d = root / f"pulled-{target}"
    asyncio.run(pull(LocalBoard(root / "board"), trainer.pub.run, target, d, root / "cache",
                     quiet=True))
    assert engine.fresh_outputs([d], root, tp=tp)[str(d)] == seen
    print(f"{arch} tp={tp}: elements changed per version {changed}")


if SHARED:
    @pytest.mark.parametrize(("arch", "tp", "shared"), SHARED,
                             ids=[f"{a}-tp{t}-shared" for a, t, _ in SHARED])
    def test_tp2_engine_after_the_faults_matches_a_fresh_engine(engine, tp2, arch, tp, shared,
                                                                record_cpu_path):
        assert tp2["arch"] == arch and tp == 2
        trainer = tp2["trainer"]
        follow_and_compare(engine, tp2["server"], trainer, tp2["root"], tp,
                           trainer.step - 1, arch, record_cpu_path, None)
