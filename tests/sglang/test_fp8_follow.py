"""An SGLang engine serving an FP8 block-quantized checkpoint follows fp8-e4m3-block patches in
place, with its CPU AMX weight layout (packed copies) kept in step.

`stitch pull` of a run published in the ``fp8-e4m3-block`` view writes ``quantization_config``
``quant_method: fp8``, ``weight_block_size: [128, 128]``: SGLang loads it through its own FP8 path
(``Fp8LinearMethod``: fp8 ``weight`` codes, float32 ``weight_scale_inv`` per 128x128 block, the
block-aware loaders). On the CPU that path runs only on SGLang's AMX backend, whose post-load step
re-lays every FP8 weight (and every bf16 linear layer and the lm_head) out for its kernels
(``convert_weight_packed``): the tensors the kernels read are not the ones the loaders wrote. No
CPU build of sgl-kernel is on the package registry, so both engines here run SGLang's AMX backend
on the dev stand-in of ``stitch_dev.sgl_cpu_kernel`` (``STITCH_DEV_FP8_KERNEL=standin``: SGLang's
op schemas, a real VNNI-style re-layout, de-quantise then a bf16 matmul): bit-exact means against
a fresh engine on the same ops.

The model (Qwen2, hidden 256, intermediate 384, two layers: SGLang's CPU FP8 path needs every
merged partition to be a multiple of 128): v1 changes codes with the scales pinned, v2 also scales
two full blocks x4. A plain engine on `stitch pull` of v2 first; then the follower, started from
`stitch pull` of v0 with v1 and v2 on the board: it applies both patches in place (the packed
copies rebuilt from the patched codes and scales of exactly the layers a patch touched);
`/stitch/status` names the kernel and counts the copies; greedy tokens and top logprobs equal the
plain engine's, bit for bit; `/stitch/verify` passes. SGLang's own online weight updates are
refused on the follower with Stitch's reason before any rank writes (its weight-update session,
which the tensor / process-group / IPC updates need, and ``/update_weights_from_disk`` of a copy
of v2 with one scale changed): the outputs and the proof stay those of v2.
"""

from __future__ import annotations

import os

import pytest

if os.environ.get("STITCH_REQUIRE_SGLANG") != "1":
    pytest.importorskip("sglang", reason="run in the SGLang venv (scripts/dev.py test)")

from stitch_dev.fp8_run import TAMPERED, publish_fp8_run  # noqa: E402
from stitch_dev.server import verify_clean  # noqa: E402

from .engines import Server, fresh_outputs  # noqa: E402

RUN = "sg-fp8"
KERNEL = "standin"
SCALED = [("model.layers.0.self_attn.q_proj.weight", 0, 0),  # full 128x128 blocks
          ("model.layers.1.self_attn.o_proj.weight", 1, 1)]


def _tampered_copy(src, dst, name: str, pos: int):
    """`src` (a pulled directory) copied to `dst` with element `pos` of tensor `name` doubled."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        tensors = load_file(f)
        if name in tensors:
            tensors[name].view(-1)[pos] *= 2
            save_file(tensors, f, metadata={"format": "pt"})
            return dst
    raise AssertionError(f"{name} not in {src}")


def test_fp8_engine_follows_in_place_bit_exact_with_packed_copies(tmp_path):
    pub = publish_fp8_run(tmp_path / "run", RUN, arch="qwen2", vocab=512, hidden=256,
                          scaled=SCALED)
    root, (v0, _, d2) = pub["root"], pub["dirs"]
    want = fresh_outputs([d2], tmp_path, dev_fp8_kernel=KERNEL)[str(d2)]  # the cores are free
    server = None
    try:
        server = Server(v0, tmp_path / "server.log", board=str(root / "board"), run=RUN,
                        cache_dir=str(tmp_path / "engine-cache"), reconcile_interval="1",
                        verify_cooldown="0", dev_fp8_kernel=KERNEL)
        st = server.wait_applied(2, timeout=600)
        assert st["fingerprint_check"]["ok"] is True, st
        assert st["fallback_tensors"] == [] and st["derived_params"] == [], st
        assert st["fp8_kernel"] == "stitch_dev:sgl-standin", st
        # 4 FP8 linear layers per layer (qkv, o, gate_up, down) packed; the bf16 lm_head packed
        assert st["derived_copies"] == {"sglang-amx:Fp8LinearMethod": 8,
                                        "sglang-amx:PackWeightMethod": 1}, st
        last = st["last_apply"]
        assert last["version"] == 2 and last["changed"] > 0, last
        print(f"derived copies {st['derived_copies']}; v2: {last['changed']} elements changed, "
              f"engine paused {last['pause_s'] * 1e3:.1f} ms (apply {last['total_s']:.2f} s)")
        assert server.outputs(2) == want  # bit for bit: tokens and top logprobs
        verify_clean(server)

        # SGLang's own weight updates on a follower: refused on every rank before any write
        r = server.http.post("/begin_weight_update", json={})  # the session of the tensor,
        assert r.status_code == 400 and "follows a Stitch run" in r.text, r.text  # IPC, NCCL ones
        r = server.http.post("/update_weights_from_tensor", json={
            "serialized_named_tensors": [""] * server.tp})
        assert r.status_code == 400 and "begin_weight_update" in r.text, r.text
        bad = _tampered_copy(d2, tmp_path / "tampered", TAMPERED, 4)
        r = server.http.post("/update_weights_from_disk", json={"model_path": str(bad)},
                             timeout=300)
        assert r.status_code == 400 and "follows a Stitch run" in r.text, r.text
        assert server.outputs(2) == want
        verify_clean(server)
        assert server.status()["version"] == 2
    finally:
        if server is not None:
            server.stop()


def test_fp8_engine_at_tp2_follows_on_every_rank(tmp_path):
    """TP=2 (two scheduler processes, gloo): each rank holds its shard of the codes and of the
    block scales (q/k/v and gate/up split by output rows, o and down by input columns; every
    shard a whole number of 128-blocks: 4 query and 4 KV heads of 64, intermediate 512), packs
    its own shard, and keeps it in step; v2 changes one scale block on each rank. The follower
    equals a plain TP=2 engine on v2, bit for bit."""
    pub = publish_fp8_run(tmp_path / "run", RUN + "-tp2", arch="qwen2", vocab=512, hidden=256,
                          scaled=SCALED, kv_heads=4, inter=512)
    root, (v0, _, d2) = pub["root"], pub["dirs"]
    want = fresh_outputs([d2], tmp_path, tp=2, dev_fp8_kernel=KERNEL)[str(d2)]
    server = None
    try:
        server = Server(v0, tmp_path / "server.log", tp=2, board=str(root / "board"),
                        run=RUN + "-tp2", cache_dir=str(tmp_path / "engine-cache"),
                        reconcile_interval="1", verify_cooldown="0", dev_fp8_kernel=KERNEL)
        st = server.wait_applied(2, timeout=900)
        assert st["ranks"] == 2 and st["fingerprint_check"]["ok"] is True, st
        assert st["fallback_tensors"] == [] and st["derived_params"] == [], st
        assert st["last_apply"]["derived_rebuilt"] > 0, st["last_apply"]
        assert server.outputs(2) == want
        verify_clean(server)
    finally:
        if server is not None:
            server.stop()
