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
