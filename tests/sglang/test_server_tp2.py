"""SGLang followers of a model of realistic shape at TP=1 and TP=2, against fresh SGLang engines of
the same TP loaded from `stitch pull` of the same version.

The realistic model (stitch_dev.tinymodel.REALISTIC: a tied Llama, 24 layers, GQA 8/2, hidden 512,
vocab 32800) is trained by AdamW at an RL learning rate (3e-6), so each version flips a realistic
~1% of the served bf16 weights; greedy tokens and top logprobs must equal a fresh engine's exactly.
SGLang's CPU engine here packs nothing (its AMX path needs the real sgl-kernel, which has no CPU
build on the registry): the test prints the path it exercised.

TP=2 on the CPU: two scheduler processes, gloo.

Each rank learns its own layout (qkv/gate-up column slices, o/down row slices, vocab-parallel
embedding and lm_head, replicated norms) through SGLang's own loaders, writes only what it holds,
and the coordinator checks that the two ranks' fingerprint sums add up (replicated tensors count
once per rank). The RPC reaches both ranks through one control request (rank 0 gathers).
"""

from __future__ import annotations

import asyncio
import os

import pytest

if os.environ.get("STITCH_REQUIRE_SGLANG") != "1":
    pytest.importorskip("sglang", reason="run in the SGLang venv (scripts/dev.py test)")

from stitch_core.versions.board import LocalBoard  # noqa: E402
from stitch_core.versions.materialize import pull  # noqa: E402
from stitch_dev.server import verify_clean  # noqa: E402
from stitch_dev.tinymodel import REALISTIC, build_tiny_model  # noqa: E402
from stitch_dev.trainer import AdamWTrainer  # noqa: E402

from ..engine_common import follow_versions  # noqa: E402
from .engines import Server, fresh_outputs  # noqa: E402

RUN = "sg-tp2"


VERSIONS = 4


@pytest.mark.parametrize("tp", [1, 2], ids=["realistic-tp1", "realistic-tp2"])
def test_engine_follows_and_matches_a_fresh_engine(tmp_path, nats_server, tp, record_cpu_path):
    model_dir = build_tiny_model(tmp_path / "model", **REALISTIC)
    trainer = AdamWTrainer(model_dir, tmp_path / "board", nats_server.url, RUN, lr=3e-6)
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
        server.wait_healthy(120)
        def pinned(v):
            r = server.generate("Hello", {"X-Stitch-Version": str(v), "X-Stitch-Wait": "300"})
            assert r.status_code != 200 or r.json()["meta_info"]["weight_version"] == str(v)
            return r

        changed = follow_versions(trainer, server, VERSIONS, pinned)
        seen = server.outputs(VERSIONS)
        verify_clean(server)
        server.stop()
        server = None
        d = tmp_path / f"pulled-{VERSIONS}"
        asyncio.run(pull(LocalBoard(tmp_path / "board"), RUN, VERSIONS, d, tmp_path / "cache",
                         quiet=True))
        assert fresh_outputs([d], tmp_path, tp=tp)[str(d)] == seen
        print(f"realistic tp={tp}: elements changed per version {changed}")
    finally:
        if server is not None:
            server.stop()
        trainer.pub.close()
