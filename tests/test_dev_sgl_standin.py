"""The dev stand-in for SGLang's CPU AMX weight ops (``stitch_dev.sgl_cpu_kernel``), without
SGLang: the VNNI-style packing is a true re-layout (a write at a loaded position is not what the
matmul reads, as with the real packing), it inverts exactly, and the stood-in matmuls equal
de-quantise-then-``F.linear`` computed independently here."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from stitch_dev import sgl_cpu_kernel as sk

FP8 = torch.float8_e4m3fn


def _codes(n: int, k: int) -> torch.Tensor:
    return (torch.randn(n, k) * 40).clamp(-448, 448).to(FP8)


@pytest.mark.parametrize("dtype,shape", [(torch.bfloat16, (64, 96)), (FP8, (48, 256)),
                                         (torch.bfloat16, (3, 32, 16)), (FP8, (24, 8))])
def test_pack_is_an_exact_re_layout(dtype, shape):
    torch.manual_seed(0)
    w = torch.randn(shape).to(dtype) if dtype != FP8 else _codes(shape[-2] * (
        shape[0] if len(shape) == 3 else 1), shape[-1]).reshape(shape)
    p = sk.pack(w)
    assert p.shape == w.shape and p.dtype == w.dtype and p.is_contiguous()
    assert torch.equal(sk.unpack(p).view(torch.uint8), w.view(torch.uint8))
    # same multiset of bytes, different order (rows of 16 interleave their K elements)
    assert torch.equal(p.view(torch.uint8).reshape(-1).sort().values,
                       w.view(torch.uint8).reshape(-1).sort().values)
    assert not torch.equal(p.view(torch.uint8), w.view(torch.uint8))


def test_pack_rejects_a_k_not_a_multiple_of_the_vnni_width():
    with pytest.raises(ValueError, match="not a multiple of 4"):
        sk.pack(_codes(16, 6))


def test_a_write_into_the_packed_copy_lands_elsewhere_in_the_logical_matrix():
    w = torch.zeros(16, 8, dtype=torch.bfloat16)
    p = sk.pack(w)
    p[0, 2] = 1.0  # position (0, 2) of the stored tensor ...
    (row, col), = (sk.unpack(p) != 0).nonzero().tolist()
    assert (row, col) == (1, 0)  # ... is another element of the weight the kernel reads


def test_block_fp8_matmul_equals_dequantise_then_linear():
    torch.manual_seed(1)
    n, k = 256, 320  # a partial block column (320 = 2 x 128 + 64)
    codes = _codes(n, k)
    scales = torch.rand(2, 3, dtype=torch.float32) * 1e-2 + 1e-3
    x = torch.randn(5, k).to(torch.bfloat16)
    bias = torch.randn(n)
    s = scales.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    deq = (codes.to(torch.float32) * s).to(torch.bfloat16)
    want = (F.linear(x, deq).float() + bias).to(torch.bfloat16)
    got = sk._IMPLS["fp8_scaled_mm_cpu"](x, sk.pack(codes), scales, [128, 128], bias,
                                          torch.bfloat16, True)
    assert torch.equal(got, want)
    unpacked = sk._IMPLS["fp8_scaled_mm_cpu"](x, codes, scales, [128, 128], bias,
                                               torch.bfloat16, False)
    assert torch.equal(unpacked, want)
    scales[1, 2] *= 4  # the kernel reads every block's scale
    assert not torch.equal(sk._IMPLS["fp8_scaled_mm_cpu"](
        x, sk.pack(codes), scales, [128, 128], bias, torch.bfloat16, True), want)


def test_per_tensor_fp8_and_packed_bf16_matmuls():
    torch.manual_seed(2)
    codes, x = _codes(32, 64), torch.randn(3, 64).to(torch.bfloat16)
    scale = torch.tensor(0.0125)
    want = F.linear(x, (codes.to(torch.float32) * scale).to(torch.bfloat16))
    got = sk._IMPLS["fp8_per_tensor_scaled_mm_cpu"](x, sk.pack(codes), scale, None,
                                                     torch.bfloat16, True)
    assert torch.equal(got, want)
    w = torch.randn(48, 64).to(torch.bfloat16)
    assert torch.equal(sk._IMPLS["weight_packed_linear"](x, sk.pack(w), None, True),
                       F.linear(x, w))
