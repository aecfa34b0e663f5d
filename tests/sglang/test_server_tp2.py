"""The plugin on a tensor-parallel SGLang engine: TP=2 on the CPU (two scheduler processes, gloo).

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

from stitch_core.board import LocalBoard  # noqa: E402
from stitch_core.cli_versions import pull  # noqa: E402
from stitch_dev.tinymodel import build_tiny_model  # noqa: E402

from ..engine_common import Trainer  # noqa: E402
from .engines import Server, fresh_outputs  # noqa: E402

RUN = "sg-tp2"


def test_tp2_engine_follows_and_matches_a_fresh_tp2_engine(tmp_path, nats_server):
    model_dir = build_tiny_model(tmp_path / "model", arch="qwen2")
    trainer = Trainer(model_dir, tmp_path / "board", nats_server.url, RUN)
    server = None
    try:
        assert trainer.publish() == 0
        asyncio.run(pull(LocalBoard(tmp_path / "board"), RUN, 0, tmp_path / "v0",
                         tmp_path / "cache", quiet=True))
        server = Server(tmp_path / "v0", tmp_path / "server.log", tp=2,
                        board=str(tmp_path / "board"), nats_url=nats_server.url, run=RUN,
                        cache_dir=str(tmp_path / "engine-cache"), reconcile_interval="1")
        st = server.wait_version(0, timeout=500)
        assert st["ranks"] == 2 and st["fingerprint_check"]["ok"] is True
        assert st["fallback_tensors"] == []
        server.wait_healthy(120)
        for _ in range(4):
            v = trainer.publish()
            r = server.generate("Hello", {"X-Stitch-Version": str(v), "X-Stitch-Wait": "120"})
            assert r.status_code == 200, r.text
            assert r.json()["meta_info"]["weight_version"] == str(v)
        seen = server.outputs(4)
        assert server.http.post("/stitch/verify").json()["ok"] is True
        assert server.status()["last_apply"]["changed"] > 0
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
