"""An SGLang engine serving a BF16 checkpoint with SGLang's *online* FP8 (``--quantization fp8``:
SGLang loads bf16 and quantizes every linear layer at load) follows bf16 patches in place: the
layers a patch touches are re-quantized by SGLang's own post-load step from the patched bf16
masters, and greedy tokens and top logprobs equal, bit for bit, those of a plain engine started
on the new bf16 version with the same flag.

On the CPU SGLang's online FP8 runs on its AMX backend only: per-tensor quantization
(``input_to_float8``: one scale per fused weight, from its amax, so any change to a layer
re-quantizes all of it), the codes transposed and VNNI-packed for
``fp8_per_tensor_scaled_mm_cpu``. Both engines run that backend on the dev stand-in of
``stitch_dev.sgl_cpu_kernel`` (``STITCH_DEV_FP8_KERNEL=standin``); SGLang's quantizer itself is
its own torch code. The run: a tiny Qwen2 trained by AdamW (every tensor changes each step).
The follower serves v0 first (its outputs must differ from v2's, or the comparison proves
nothing), then follows v1 and v2 as they are published.
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
from stitch_dev.tinymodel import build_tiny_model  # noqa: E402
from stitch_dev.trainer import AdamWTrainer  # noqa: E402

from .engines import Server, fresh_outputs  # noqa: E402

RUN = "sg-fp8-online"
ONLINE = ["--quantization", "fp8"]
KERNEL = "standin"


def _pull(root, version: int, out):
    asyncio.run(pull(LocalBoard(root / "board"), RUN, version, out, root / "cache", quiet=True))
    return out


def test_online_fp8_engine_follows_bf16_patches_bit_exact(tmp_path):
    trainer = AdamWTrainer(build_tiny_model(tmp_path / "model", arch="qwen2"),
                           tmp_path / "board", None, RUN)
    assert trainer.publish() == 0
    v0 = _pull(tmp_path, 0, tmp_path / "v0")
    server = None
    try:
        server = Server(v0, tmp_path / "server.log", extra=ONLINE, board=str(tmp_path / "board"),
                        run=RUN, cache_dir=str(tmp_path / "engine-cache"),
                        reconcile_interval="1", verify_cooldown="0", dev_fp8_kernel=KERNEL)
        st = server.wait_version(0, timeout=600)
        assert st["fp8_kernel"] == "stitch_dev:sgl-standin", st
        # every linear layer quantized by SGLang at load (qkv, o, gate_up, down per layer), and
        # the bf16 lm_head packed
        copies = st["derived_copies"]
        assert copies == {"sglang-amx:Fp8LinearMethod": 8, "sglang-amx:PackWeightMethod": 1}, st
        assert st["fallback_tensors"] == [] and st["derived_params"] == [], st
        before = server.outputs(0)
        assert trainer.publish() == 1 and trainer.publish() == 2
        st = server.wait_applied(2, timeout=300)
        last = st["last_apply"]
        assert last["version"] == 2 and last["changed"] > 0, last
        # AdamW moved every tensor: every layer re-quantized, the lm_head re-packed
        assert last["derived_rebuilt"] == sum(copies.values()), last
        print(f"v2: {last['changed']} bf16 elements changed, {last['derived_rebuilt']} layers "
              f"re-quantized / re-packed in {last['rebuild_rank_s'] * 1e3:.1f} ms; engine paused "
              f"{last['pause_s'] * 1e3:.1f} ms")
        got = server.outputs(2)
        verify_clean(server)
    finally:
        if server is not None:
            server.stop()
    d2 = _pull(tmp_path, 2, tmp_path / "v2")
    want = fresh_outputs([d2], tmp_path, extra=ONLINE, dev_fp8_kernel=KERNEL)[str(d2)]
    assert got == want  # bit for bit: tokens and top logprobs
    assert before != want
