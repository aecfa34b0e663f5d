"""The element types a view can hold, and their bit-level views.

Every tensor is handled as the integer view of its bits (same width, signed), so all patch work is
exact integer work. For floating types, `to_key` maps bits to an order-preserving integer (the
"ULP key"): consecutive representable values have consecutive keys, so `key(new) - key(old)` is the
distance in ULPs, usually +/-1 for a weight that crossed one rounding boundary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DTypeInfo:
    """A supported element type: its safetensors name, torch dtype, integer view and bit widths."""

    name: str  # safetensors dtype string
    torch_dtype: torch.dtype
    int_dtype: torch.dtype  # same-width signed integer view
    itemsize: int
    is_float: bool
    mantissa_bits: int = 0  # stored fraction bits (floats only)

    @property
    def bits(self) -> int:
        return self.itemsize * 8


INFOS = [
    DTypeInfo("F64", torch.float64, torch.int64, 8, True, 52),
    DTypeInfo("F32", torch.float32, torch.int32, 4, True, 23),
    DTypeInfo("F16", torch.float16, torch.int16, 2, True, 10),
    DTypeInfo("BF16", torch.bfloat16, torch.int16, 2, True, 7),
    DTypeInfo("F8_E4M3", torch.float8_e4m3fn, torch.int8, 1, True, 3),
    DTypeInfo("F8_E5M2", torch.float8_e5m2, torch.int8, 1, True, 2),
    DTypeInfo("I64", torch.int64, torch.int64, 8, False),
    DTypeInfo("I32", torch.int32, torch.int32, 4, False),
    DTypeInfo("I16", torch.int16, torch.int16, 2, False),
    DTypeInfo("I8", torch.int8, torch.int8, 1, False),
    DTypeInfo("U8", torch.uint8, torch.int8, 1, False),
    DTypeInfo("BOOL", torch.bool, torch.int8, 1, False),
]
_BY_TORCH = {i.torch_dtype: i for i in INFOS}
_BY_NAME = {i.name: i for i in INFOS}


def info(dtype: torch.dtype | str) -> DTypeInfo:
    """Look up a dtype by torch dtype or safetensors name (e.g. "BF16")."""
    table = _BY_NAME if isinstance(dtype, str) else _BY_TORCH
    try:
        return table[dtype]
    except KeyError:
        raise ValueError(f"unsupported dtype {dtype}") from None


def int_view(t: torch.Tensor) -> torch.Tensor:
    """Flat signed-integer view of a tensor's bits (no copy for contiguous tensors)."""
    i = info(t.dtype)
    flat = t.contiguous().reshape(-1)
    if t.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    return flat.view(i.int_dtype)


def bits_from_bytes(buf: bytes | bytearray | memoryview, int_dtype: torch.dtype) -> torch.Tensor:
    """A writable 1-D integer tensor over a copy of `buf` (empty bytes give an empty tensor;
    ``torch.frombuffer`` refuses them)."""
    if not len(buf):
        return torch.empty(0, dtype=int_dtype)
    return torch.frombuffer(bytearray(buf), dtype=int_dtype)


def from_int(bits: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Inverse of int_view: reinterpret integer bits (any integer dtype, exact values) as dtype."""
    i = info(dtype)
    t = bits.to(i.int_dtype)
    if dtype == torch.bool:
        t = t.view(torch.uint8).view(torch.bool)
    elif dtype == torch.uint8:
        t = t.view(torch.uint8)
    else:
        t = t.view(dtype)
    return t.reshape(shape)


def unsigned(bits: torch.Tensor, itemsize: int) -> torch.Tensor:
    """Signed bits (any integer tensor) -> int64 holding the unsigned value (widths <= 4 bytes)."""
    b = bits.to(torch.int64)
    if itemsize >= 8:
        return b
    return b & ((1 << (8 * itemsize)) - 1)


def signed(ubits: torch.Tensor, itemsize: int) -> torch.Tensor:
    """Unsigned value (int64) -> sign-extended int64 of the given width."""
    if itemsize >= 8:
        return ubits
    half = 1 << (8 * itemsize - 1)
    return ((ubits + half) & ((half << 1) - 1)) - half


def to_key(sbits: torch.Tensor, dt: DTypeInfo) -> torch.Tensor:
    """Order-preserving integer key of sign-extended int64 bits (floats); identity for integers.

    Negative floats have their magnitude bits flipped: key = s ^ ((s >> (w-1)) & (2^(w-1) - 1)).
    It is an involution, so `from_key` is the same map. -0.0 -> -1, +0.0 -> 0.
    """
    if not dt.is_float:
        return sbits
    return sbits ^ ((sbits >> 63) & ((1 << (dt.bits - 1)) - 1))


from_key = to_key


def true_div(t: torch.Tensor, divisor: float) -> torch.Tensor:
    """``t / divisor``, correctly rounded on every device. CUDA computes ``tensor / python_float``
    as ``tensor * (1 / divisor)``, which can differ in the last bit (a scale off by one ULP on the
    GPU, seen by the GPU check); a divisor tensor on ``t``'s device is a true division there too."""
    return torch.div(t, t.new_tensor(divisor))
