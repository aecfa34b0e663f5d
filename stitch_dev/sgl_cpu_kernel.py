"""A dev-only stand-in for SGLang's CPU AMX weight kernels (tests only).

SGLang's CPU engine serves FP8 linear layers only through its AMX backend: ``Fp8LinearMethod``
asserts ``cpu_has_amx_support()`` (AMX tiles *and* the CPU build of ``sgl-kernel``, whose
``torch.ops.sgl_kernel.convert_weight_packed`` VNNI-packs each weight) and its ``apply`` calls
``torch.ops.sgl_kernel.fp8_scaled_mm_cpu``. The package registry ships no CPU build of
``sgl-kernel``, so no FP8 SGLang engine starts here, and on an AMD host none starts at all. On a
real Intel host the same backend also packs every bf16 linear layer and the lm_head
(``weight_packed_linear``): the layout a follower there must keep in step.

``install(mode)`` (run by the Stitch SGLang plugin in every SGLang process when
``STITCH_DEV_FP8_KERNEL`` is set, before any model loads) registers torch ops with SGLang's own
schemas in the ``sgl_kernel`` namespace (``sgl-kernel/csrc/cpu/torch_extension_cpu.cpp``):

* ``convert_weight_packed(weight)``: a VNNI-style re-layout of ``[..., N, K]`` (blocks of 16 rows,
  2 or 4 consecutive K elements per row interleaved for 16- or 8-bit types): same shape and
  dtype, different element order, so a write into the loaded tensor is *not* what the matmul
  reads (as with the real packing);
* ``weight_packed_linear``, ``fp8_scaled_mm_cpu`` (128x128 block scales) and
  ``fp8_per_tensor_scaled_mm_cpu``: un-pack, de-quantize (``code * scale`` in float32), then
  ``F.linear`` in the activations' dtype, the bias added in float32. Deterministic on a host;
  not sgl-kernel's numerics: bit-exact comparisons are against a fresh engine on the same ops;

and switches the AMX backend on for exactly the modules whose weights it packs (the module
flags SGLang computes at import: ``quantization.unquant``, ``quantization.fp8``,
``vocab_parallel_embedding``; ``amx_utils``' check) while every other module keeps its own
answer (norms, rotary, activations, MoE routing and attention stay on torch: their sgl-kernel
ops are not stood in). ``standin`` (and ``standin-packed``, the same here) always installs it;
``auto`` only where SGLang has no CPU FP8 kernel (no AMX tiles, or no ``convert_weight_packed``
op). Where the real ops are loaded, ``standin`` replaces their CPU kernels (torch warns).
Never in the wheel.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from stitch_dev.fp8_kernel import dequantize_blocks

__all__ = ["NAME", "install", "installed", "pack", "unpack", "SCHEMAS"]

NAME = "stitch_dev:sgl-standin"
log = logging.getLogger("stitch.dev.sglang")
TILE_N = 16
SCHEMAS = {
    "convert_weight_packed": "convert_weight_packed(Tensor weight) -> Tensor",
    "weight_packed_linear":
        "weight_packed_linear(Tensor mat1, Tensor mat2, Tensor? bias, bool is_vnni) -> Tensor",
    "fp8_scaled_mm_cpu":
        "fp8_scaled_mm_cpu(Tensor mat1, Tensor mat2, Tensor scales2, int[] block_size, "
        "Tensor? bias, ScalarType out_dtype, bool is_vnni) -> Tensor",
    "fp8_per_tensor_scaled_mm_cpu":
        "fp8_per_tensor_scaled_mm_cpu(Tensor mat1, Tensor mat2, Tensor scales2, Tensor? bias, "
        "ScalarType out_dtype, bool is_vnni) -> Tensor",
}
# modules whose import-time `_is_cpu_amx_available` decides whether their weights are packed
FLAGGED = ("sglang.srt.layers.quantization.unquant", "sglang.srt.layers.quantization.fp8",
           "sglang.srt.layers.vocab_parallel_embedding")
_INSTALLED: str | None = None
_LIBS: list[torch.library.Library] = []


def installed() -> str | None:
    """The stand-in's name while it serves in this process, else None."""
    return NAME if _INSTALLED else None


def _geometry(w: torch.Tensor) -> tuple[int, int, int]:
    n, k = w.shape[-2:]
    vnni = 4 if w.element_size() == 1 else 2
    bn = TILE_N if n % TILE_N == 0 else n
    if k % vnni:
        raise ValueError(f"K={k} is not a multiple of {vnni}")
    return bn, vnni, k // vnni


def _bits(w: torch.Tensor) -> torch.Tensor:
    return w.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[w.element_size()])


def pack(w: torch.Tensor) -> torch.Tensor:
    """``[..., N, K]`` -> the same shape, each block of `TILE_N` rows stored as ``[K/v][TILE_N][v]``
    (v = 2 for 16-bit, 4 for 8-bit types): a new contiguous tensor."""
    bn, v, kv = _geometry(w)
    *lead, n, k = w.shape
    b = _bits(w.contiguous()).reshape(*lead, n // bn, bn, kv, v).transpose(-3, -2)
    return b.contiguous().reshape(*lead, n, k).view(w.dtype)


def unpack(p: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack`."""
    bn, v, kv = _geometry(p)
    *lead, n, k = p.shape
    b = _bits(p.contiguous()).reshape(*lead, n // bn, kv, bn, v).transpose(-3, -2)
    return b.contiguous().reshape(*lead, n, k).view(p.dtype)


def _linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
            out_dtype: torch.dtype) -> torch.Tensor:
    out = F.linear(x, w.to(x.dtype))
    if bias is not None:
        out = (out.float() + bias.float()).to(out.dtype)
    return out.to(out_dtype)


def _weight_packed_linear(mat1, mat2, bias, is_vnni):
    return _linear(mat1, unpack(mat2) if is_vnni else mat2, bias, mat1.dtype)


def _fp8_scaled_mm_cpu(mat1, mat2, scales2, block_size, bias, out_dtype, is_vnni):
    w = unpack(mat2) if is_vnni else mat2
    deq = dequantize_blocks(w, scales2, (int(block_size[0]), int(block_size[1])), mat1.dtype)
    return _linear(mat1, deq, bias, out_dtype)


def _fp8_per_tensor_scaled_mm_cpu(mat1, mat2, scales2, bias, out_dtype, is_vnni):
    w = unpack(mat2) if is_vnni else mat2
    deq = (w.to(torch.float32) * scales2.to(torch.float32)).to(mat1.dtype)
    return _linear(mat1, deq, bias, out_dtype)


_IMPLS = {"convert_weight_packed": pack, "weight_packed_linear": _weight_packed_linear,
          "fp8_scaled_mm_cpu": _fp8_scaled_mm_cpu,
          "fp8_per_tensor_scaled_mm_cpu": _fp8_per_tensor_scaled_mm_cpu}


def _has_op(name: str) -> bool:
    try:
        getattr(torch.ops.sgl_kernel, name)
        return True
    except (AttributeError, RuntimeError):
        return False


def _amx_tiles() -> bool:
    try:
        return bool(torch.cpu._is_amx_tile_supported())
    except Exception:
        return False


def _register() -> None:
    fragment = torch.library.Library("sgl_kernel", "FRAGMENT")
    _LIBS.append(fragment)
    for name, schema in SCHEMAS.items():
        if _has_op(name):  # the real CPU sgl-kernel is loaded: replace its CPU kernel
            lib = torch.library.Library("sgl_kernel", "IMPL")
            _LIBS.append(lib)
            lib.impl(name, _IMPLS[name], "CPU")
        else:
            fragment.define(schema)
            fragment.impl(name, _IMPLS[name], "CPU")


def _flag(mod) -> None:
    if _INSTALLED:
        mod._is_cpu_amx_available = True


def _amx_utils(mod) -> None:
    if _INSTALLED:
        mod.cpu_has_amx_support = lambda: True


def install(mode: str | None) -> str | None:
    """Install the stand-in for `mode` (``standin``, ``standin-packed`` or ``auto``; see the
    module doc) in this process, before SGLang loads a model; idempotent. Its name, or None
    where ``auto`` leaves SGLang's own kernels."""
    global _INSTALLED
    if _INSTALLED or not mode:
        return installed()
    from sglang.srt.utils import common

    if mode == "auto" and _amx_tiles() and _has_op("convert_weight_packed"):
        return None
    # SGLang's own answer, cached before the ops exist: modules not switched on below keep it
    common._is_intel_amx_backend_available()
    _register()
    _INSTALLED = mode
    from stitch_core.engine.import_hooks import after_import

    after_import({**{m: _flag for m in FLAGGED}, "sglang.srt.layers.amx_utils": _amx_utils})
    log.warning("stitch: dev stand-in for SGLang's CPU AMX weight kernels installed (%s: %s); "
                "FP8 and packed bf16 linear layers run on it (tests only)", mode,
                ", ".join(SCHEMAS))
    return NAME
