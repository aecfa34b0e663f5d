"""vLLM's CPU packing as `stitch_core.engine.prebuild` uses it, with vLLM's own functions (no
engine: the same `dispatch_cpu_unquantized_gemm` the engine calls on each linear layer).

* A copy built ahead by `stitch_vllm.cpu._build_linear` (vLLM's packing on a stand-in module)
  serves, once installed, exactly what the layer serves after an in-place re-pack of the same
  weights, and the layer is untouched until it is installed.
* The packed copy does not read the tensor it was built from afterwards: the rank builds every
  copy from one reused scratch buffer (`prebuild.Scratch`), which relies on it.

Runs every packing kind this host's vLLM takes for a bf16 and an fp32 layer (printed); the
engine-level path (builds ahead installed in a real server's pause, outputs equal to fresh
engines) is tests/engines/test_server.py.
"""

from __future__ import annotations

import os

import pytest

try:
    import vllm  # noqa: F401
    import vllm.model_executor.layers.utils as lu
except Exception as e:  # ImportError, or a broken install
    if os.environ.get("STITCH_REQUIRE_VLLM") == "1":
        raise
    pytest.skip(f"vllm is not importable ({type(e).__name__}: {e})", allow_module_level=True)

import torch

from stitch_core.engine import derived
from stitch_vllm import cpu

SHAPES = [(1152, 896), (64, 896)]  # a mid-size projection, a small one (AMX's size class)


def _layer(w: torch.Tensor) -> torch.nn.Module:
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(w.clone(), requires_grad=False)
    layer.bias = None
    return layer


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES)
def test_a_copy_built_ahead_serves_what_the_in_place_repack_serves(dtype, shape):
    assert cpu.install_cpu_weight_keeper()
    g = torch.Generator().manual_seed(0)
    w0 = torch.randn(shape, generator=g).to(dtype)
    layer = _layer(w0)
    lu.dispatch_cpu_unquantized_gemm(layer, True)
    dc = getattr(layer, derived.ATTR, None)
    kind = cpu.pack_kind(layer)
    print(f"CPU GEMM path for {dtype} {shape}: {kind}")
    if dc is None:
        assert kind == "torch"  # nothing packed on this host: nothing to build
        return
    if kind not in cpu.AHEAD_KINDS:
        assert dc.build is None
        return
    x = torch.randn(5, shape[1], generator=g).to(dtype)
    old_out = layer.cpu_linear(x, None, None)
    w1 = w0.clone()
    idx = torch.arange(0, w1.numel(), 97)  # ~1% of the elements change
    w1.view(-1)[idx] = torch.randn(len(idx), generator=g).to(dtype)
    scratch = w1.clone()
    install = dc.build({"weight": scratch})
    assert torch.equal(layer.cpu_linear(x, None, None), old_out)  # built off to the side
    scratch.zero_()  # the scratch buffer is reused for the next copy
    install()
    ahead_out = layer.cpu_linear(x, None, None)
    # the reference: the master written in place and re-packed by the in-place path
    dc.sources["weight"].copy_(w1)
    dc.rebuild()
    assert torch.equal(layer.cpu_linear(x, None, None), ahead_out)
    assert not torch.equal(ahead_out, old_out)


# ---------------------------------------------------------------- MoE experts (moe-packed)


def _experts(cls_name: str, intermediate: int):
    """vLLM's CPU MoE experts object as its post-load step reads it (the config fields that step
    reads; the rest of a FusedMoEConfig plays no part in packing)."""
    from types import SimpleNamespace

    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe

    cpu.install_cpu_weight_keeper()  # wraps the experts' post-load step (cpu._wrap_moe)
    experts = object.__new__(getattr(cpu_moe, cls_name))
    experts.moe_config = SimpleNamespace(intermediate_size_per_partition=intermediate,
                                         activation=MoEActivation.SILU)
    experts._use_zentorch = False
    return experts


def _moe_layer(experts, hidden: int, intermediate: int, g, bias: bool = False):
    layer = torch.nn.Module()
    for name, shape in (("w13_weight", (4, 2 * intermediate, hidden)),
                        ("w2_weight", (4, hidden, intermediate))):
        p = torch.nn.Parameter(torch.randn(shape, generator=g).bfloat16(), requires_grad=False)
        p.weight_loader = print  # any loader: the packed parameter must carry it on
        layer.register_parameter(name, p)
    if bias:
        layer.w13_bias = torch.nn.Parameter(torch.zeros(4, 2 * intermediate))
    experts.process_weights_after_loading(layer)
    return layer


@pytest.mark.parametrize("intermediate", [64, 48])  # 48: padded to the kernel's alignment
def test_moe_experts_built_ahead_equal_the_in_place_repack(intermediate):
    experts = _experts("CPUUnquantizedExperts", intermediate)
    g = torch.Generator().manual_seed(0)
    layer = _moe_layer(experts, 64, intermediate, g)
    dc = getattr(layer, derived.ATTR, None)
    assert dc is not None and dc.kind == "moe-packed" and dc.build is not None
    before = {n: layer._parameters[n].clone() for n in cpu.MOE_WEIGHTS}
    new = {}
    for n, master in dc.sources.items():
        w = master.clone()
        idx = torch.arange(0, w.numel(), 97)
        w.view(-1)[idx] = torch.randn(len(idx), generator=g).bfloat16()
        new[n] = w
    scratch = {n: w.clone() for n, w in new.items()}
    install = dc.build(scratch)
    for n in cpu.MOE_WEIGHTS:  # built off to the side: the layer serves what it did
        assert torch.equal(layer._parameters[n], before[n])
    for t in scratch.values():
        t.zero_()  # the scratch buffers are reused for the next copy
    old = install()
    assert set(old) == set(cpu.MOE_WEIGHTS)
    ahead = {n: layer._parameters[n] for n in cpu.MOE_WEIGHTS}
    assert all(hasattr(p, "weight_loader") for p in ahead.values())
    for n, w in new.items():  # the reference: masters written in place, re-packed in place
        dc.sources[n].copy_(w)
    dc.rebuild()
    for n in cpu.MOE_WEIGHTS:
        ref = layer._parameters[n]
        assert ref.shape == ahead[n].shape and torch.equal(ref.view(torch.int16),
                                                           ahead[n].view(torch.int16)), n
        assert not torch.equal(ref, before[n])


def test_a_padded_moe_layer_with_a_bias_is_rebuilt_in_the_pause():
    """vLLM pads a padded layer's expert bias through ``.data``, which a stand-in shares with the
    live layer: that layer is not built ahead (its in-place re-pack stays)."""
    experts = _experts("CPUUnquantizedExperts", 48)
    layer = _moe_layer(experts, 64, 48, torch.Generator().manual_seed(1), bias=True)
    dc = getattr(layer, derived.ATTR)
    with pytest.raises(RuntimeError, match="not built ahead"):
        dc.build({n: t.clone() for n, t in dc.sources.items()})
