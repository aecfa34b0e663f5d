"""The dev FP8 stand-ins' arithmetic (``stitch_dev.fp8_kernel``), without vLLM: the static
per-tensor quantization that stands in for the op vLLM's CPU build lacks, checked against an
independent nearest-value search over the e4m3 grid, and the per-tensor / per-channel
dequantisation of the stand-in kernel."""

from __future__ import annotations

import pytest
import torch

from stitch_dev.fp8_kernel import dequantize_scaled, static_fp8_quant

FP8 = torch.float8_e4m3fn


def _grid() -> tuple[torch.Tensor, torch.Tensor]:
    """Every finite e4m3 value (float64) and its code, ascending by value."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    vals = codes.view(FP8).to(torch.float64)
    keep = ~torch.isnan(vals)
    vals, codes = vals[keep], codes[keep].to(torch.int64)
    order = torch.argsort(vals, stable=True)
    return vals[order], codes[order]


def _nearest_even(v: torch.Tensor) -> torch.Tensor:
    """The e4m3 value nearest to each float64 in `v` (clamped to +-448), ties to the even
    code: the reference the stand-in must equal."""
    vals, codes = _grid()
    v = v.clamp(-448.0, 448.0)
    hi = torch.searchsorted(vals, v).clamp(max=vals.numel() - 1)
    lo = (hi - 1).clamp(min=0)
    dlo, dhi = (v - vals[lo]).abs(), (vals[hi] - v).abs()
    pick = torch.where(dlo < dhi, lo, hi)
    tie = dlo == dhi
    pick = torch.where(tie & (codes[lo] % 2 == 0), lo, torch.where(tie, hi, pick))
    return vals[pick]


@pytest.mark.parametrize("scale", [0.0123, 1.0, 3.7e-4, 2.0 ** -7])
def test_static_quant_is_the_scaled_nearest_even_e4m3(scale):
    torch.manual_seed(0)
    x = (torch.randn(4096) * 2.0).to(torch.bfloat16)
    s = torch.tensor([scale], dtype=torch.float32)
    got = static_fp8_quant(x.view(64, 64), s).view(-1)
    inv = (1.0 / s).reshape(())
    scaled = (x.to(torch.float32) * inv).to(torch.float64)  # the product in float32, as the kernel
    want = _nearest_even(scaled)
    assert got.dtype == FP8
    assert torch.equal(got.to(torch.float64), want)


def test_static_quant_ties_clamp_and_output_buffer():
    # exact midpoints between e4m3 neighbours round to the even code; beyond 448 clamps
    x = torch.tensor([1.0625, 1.1875, -1.0625, 500.0, -1e6, 0.0], dtype=torch.float32)
    out = torch.empty(1, 6, dtype=FP8)
    got = static_fp8_quant(x.view(1, 6), torch.tensor(1.0), out)
    assert got is out
    assert got.view(-1).to(torch.float32).tolist() == [1.0, 1.25, -1.0, 448.0, -448.0, 0.0]


def test_dequantize_per_tensor_and_per_channel():
    codes = torch.randn(6, 4).to(FP8)  # [K, N], as the online methods store it
    one = torch.tensor([0.5])
    assert torch.equal(dequantize_scaled(codes, one, torch.float32), codes.float() * 0.5)
    per_col = torch.tensor([[1.0], [2.0], [0.25], [8.0]])  # one scale per output channel, [N, 1]
    want = codes.float() * per_col.view(1, -1)
    assert torch.equal(dequantize_scaled(codes, per_col, torch.float32), want)
    assert dequantize_scaled(codes, per_col, torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="output channels"):
        dequantize_scaled(codes, torch.ones(3), torch.float32)
