"""Per-chunk coding of one tensor's changes: positions and values (see docs/format.md).

A chunk covers the flat positions [start, stop) of one tensor. Its payload is a positions stream
followed by a values stream. Positions: `all` (every position, no bytes), `gaps` (gap - 1 between
sorted positions, entropy-coded) or `bitmap` (one bit per position, LSB first). Values, chosen per
chunk as the smallest:
  ulp  zigzag(key(new) - key(old)), the signed distance in ULPs (needs the base; widths <= 4 bytes)
  xor  bits(new) ^ bits(old)                                             (needs the base)
  raw  bits(new)
ulp values may be coded under contexts taken from the old value (exponent bucket and sign), which
the decoder recomputes from the base at the decoded positions: cost O(changed), not O(tensor).
All value transforms are integer work on sign-extended int64 bit patterns (torch, any device).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from stitch_core._jit import numba
from stitch_core.errors import StitchError
from stitch_core.format import dtypes, entropy
from stitch_core.format.dtypes import DTypeInfo

POS_ENCODINGS = ("all", "gaps", "bitmap")
VAL_ENCODINGS = ("ulp", "xor", "raw")
MAX_CTX_EXPONENTS = 12
ESTIMATE_SAMPLE = 1 << 15


class CodecError(StitchError, ValueError):
    """Chunk data that cannot be decoded."""


@dataclass(frozen=True)
class Context:
    """Value contexts: clamp(exponent(old) - base, 0, n - 1), plus n if sign(old) and `sign`."""

    base: int
    n: int
    sign: bool

    @property
    def count(self) -> int:
        return self.n * (2 if self.sign else 1)

    def of(self, old_sbits: np.ndarray, dt: DTypeInfo) -> np.ndarray:
        out = np.empty(old_sbits.shape[0], dtype=np.uint8)
        _contexts(np.ascontiguousarray(old_sbits, np.int64), dt.bits, dt.mantissa_bits,
                  self.base, self.n, self.sign, out)
        return out

    def to_list(self) -> list[int]:
        return [self.base, self.n, int(self.sign)]

    @classmethod
    def from_list(cls, v: list[int]) -> Context:
        if len(v) != 3 or not 1 <= v[1] <= 32 or v[2] not in (0, 1) or not 0 <= v[0] < 2048:
            raise CodecError(f"bad value context {v}")
        return cls(v[0], v[1], bool(v[2]))


@dataclass
class EncodedChunk:
    """One coded chunk: span [start, stop), `count` changed positions, the position and value
    encodings (and value context), and both payloads."""

    start: int
    stop: int
    count: int
    pos: str
    val: str
    ctx: Context | None
    pos_bytes: bytes
    val_bytes: bytes


# ---------------------------------------------------------------- value transforms
# CPU tensors go through fused numba loops; other devices use the same arithmetic in torch.


@numba.njit(cache=True, nogil=True)
def _contexts(old, bits, mant, base, n, sign, out):  # pragma: no cover - compiled
    umask = (np.int64(1) << bits) - 1
    emask = (np.int64(1) << (bits - 1 - mant)) - 1
    for i in range(old.shape[0]):
        ub = old[i] & umask
        c = ((ub >> mant) & emask) - base
        c = 0 if c < 0 else (n - 1 if c > n - 1 else c)
        if sign and (ub >> (bits - 1)) & 1:
            c += n
        out[i] = c


@numba.njit(cache=True, nogil=True)
def _ulp_encode(old, new, bits, is_float, out):  # pragma: no cover - compiled
    mask = (np.int64(1) << (bits - 1)) - 1
    for i in range(old.shape[0]):
        ko, kn = old[i], new[i]
        if is_float:
            ko ^= (ko >> 63) & mask
            kn ^= (kn >> 63) & mask
        d = kn - ko
        out[i] = np.uint64((d << 1) ^ (d >> 63))


@numba.njit(cache=True, nogil=True)
def _ulp_decode(old, u, bits, is_float, out):  # pragma: no cover - compiled
    """New bits from old bits and zigzag ULP deltas; False if one leaves the dtype's range."""
    mask = (np.int64(1) << (bits - 1)) - 1
    half = np.int64(1) << (bits - 1)
    for i in range(old.shape[0]):
        v = u[i]
        d = np.int64(v >> np.uint64(1)) ^ -np.int64(v & np.uint64(1))
        k = old[i]
        if is_float:
            k ^= (k >> 63) & mask
        k += d
        if k < -half or k >= half:
            return False
        if is_float:
            k ^= (k >> 63) & mask
        out[i] = k
    return True


def _u64(t: torch.Tensor) -> np.ndarray:
    return t.cpu().numpy().astype(np.int64, copy=False).view(np.uint64)


def values_for(enc: str, old: torch.Tensor | None, new: torch.Tensor, dt: DTypeInfo) -> np.ndarray:
    """Unsigned values to code for sign-extended int64 bits old -> new."""
    if enc == "raw":
        return _u64(dtypes.unsigned(new, dt.itemsize))
    assert old is not None
    if enc == "xor":
        return _u64(dtypes.unsigned(old ^ new, dt.itemsize))
    if old.device.type == "cpu":
        out = np.empty(old.shape[0], dtype=np.uint64)
        _ulp_encode(old.numpy(), new.numpy(), dt.bits, dt.is_float, out)
        return out
    return ulp_values_torch(old, new, dt)


def ulp_values_torch(old: torch.Tensor, new: torch.Tensor, dt: DTypeInfo) -> np.ndarray:
    """The device-agnostic (torch) form of the ulp transform; equal to the numba loop."""
    d = dtypes.to_key(new, dt) - dtypes.to_key(old, dt)
    return _u64((d << 1) ^ (d >> 63))


def apply_values(
    enc: str,
    u: np.ndarray,
    old: torch.Tensor | None,
    dt: DTypeInfo,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Inverse of values_for: new sign-extended int64 bits. Raises CodecError on out-of-range."""
    v = torch.from_numpy(np.ascontiguousarray(u).view(np.int64)).to(device)
    if enc == "raw":
        if dt.itemsize < 8 and bool((v >> dt.bits).any()):
            raise CodecError("raw value wider than its dtype")
        return dtypes.signed(v, dt.itemsize)
    if old is None:
        raise CodecError(f"{enc} values need the base tensor")
    if enc == "xor":
        if dt.itemsize < 8 and bool((v >> dt.bits).any()):
            raise CodecError("xor value wider than its dtype")
        return dtypes.signed(dtypes.unsigned(old, dt.itemsize) ^ v, dt.itemsize)
    if enc != "ulp" or dt.itemsize > 4:
        raise CodecError(f"bad value encoding {enc!r} for {dt.name}")
    if old.device.type == "cpu":
        out = np.empty(old.shape[0], dtype=np.int64)
        if not _ulp_decode(old.numpy(), np.ascontiguousarray(u, np.uint64), dt.bits,
                           dt.is_float, out):
            raise CodecError("ulp delta leaves the dtype's range")
        return torch.from_numpy(out)
    return ulp_apply_torch(v, old, dt)


def ulp_apply_torch(v: torch.Tensor, old: torch.Tensor, dt: DTypeInfo) -> torch.Tensor:
    """The device-agnostic (torch) inverse; v holds the zigzag deltas as int64."""
    d = ((v >> 1) & ((1 << 63) - 1)) ^ -(v & 1)  # logical shift: u is unsigned
    key = dtypes.to_key(old, dt) + d
    half = 1 << (dt.bits - 1)
    if bool(((key < -half) | (key >= half)).any()):
        raise CodecError("ulp delta leaves the dtype's range")
    return dtypes.from_key(key, dt)


# ---------------------------------------------------------------- positions


def encode_positions(pos: np.ndarray, start: int, stop: int) -> tuple[str, bytes]:
    """Code sorted absolute positions in [start, stop): `all` when every position is there, else
    `gaps` or `bitmap`, whichever is smaller. Returns (encoding, bytes)."""
    k, n = pos.shape[0], stop - start
    if k == n:
        return "all", b""
    gaps = np.diff(pos, prepend=start - 1) - 1
    coded = entropy.encode(gaps.astype(np.uint64))
    if (n + 7) // 8 < len(coded):
        mask = np.zeros(n, dtype=np.uint8)
        mask[pos - start] = 1
        return "bitmap", np.packbits(mask, bitorder="little").tobytes()
    return "gaps", coded


def decode_positions(
    enc: str, data: bytes | memoryview, start: int, stop: int, k: int
) -> np.ndarray:
    """The `k` sorted absolute positions (int64) in [start, stop) coded as `enc` in `data`.
    Raises CodecError."""
    n = stop - start
    if enc == "all":
        if k != n or len(data):
            raise CodecError("'all' positions with a wrong count")
        return np.arange(start, stop, dtype=np.int64)
    if enc == "bitmap":
        if len(data) != (n + 7) // 8:
            raise CodecError("bitmap of the wrong size")
        bits = np.unpackbits(np.frombuffer(data, np.uint8), count=n, bitorder="little")
        pos = np.flatnonzero(bits).astype(np.int64) + start
        if pos.shape[0] != k or (n % 8 and np.frombuffer(data, np.uint8)[-1] >> (n % 8)):
            raise CodecError("bitmap count mismatch")
        return pos
    if enc != "gaps":
        raise CodecError(f"unknown position encoding {enc!r}")
    try:
        gaps = entropy.decode(data, k)
    except entropy.StreamError as e:
        raise CodecError(f"positions: {e}") from None
    if k and int(gaps.max()) >= n:
        raise CodecError("position gap out of range")
    pos = np.cumsum(gaps.astype(np.int64) + 1) + (start - 1)
    if k and pos[-1] >= stop:
        raise CodecError("position out of chunk range")
    return pos


# ---------------------------------------------------------------- values


def _choose_context(
    old: np.ndarray, tokens: np.ndarray, dt: DTypeInfo
) -> tuple[Context | None, float]:
    """Pick the value context with the smallest estimated size (None: no context)."""
    best: tuple[Context | None, float] = (None, entropy.cost_bits(tokens, np.zeros_like(tokens), 1))
    if not dt.is_float or tokens.size < 256:
        return best
    ub = old & ((1 << dt.bits) - 1)
    exp = (ub >> dt.mantissa_bits) & ((1 << (dt.bits - 1 - dt.mantissa_bits)) - 1)
    cdf = np.cumsum(np.bincount(exp)) / exp.size
    lo, hi = int(np.searchsorted(cdf, 0.01)), int(np.searchsorted(cdf, 0.99))
    n = int(min(hi - lo + 1, MAX_CTX_EXPONENTS))
    base = int(hi) - n + 1
    for sign in (False, True):
        c = Context(base, n, sign)
        cost = entropy.cost_bits(tokens, c.of(old, dt), c.count)
        if cost < best[1]:
            best = (c, cost)
    return best


def encode_values(
    old: torch.Tensor | None, new: torch.Tensor, dt: DTypeInfo
) -> tuple[str, Context | None, bytes]:
    """Code new bits (sign-extended int64, at the changed positions) against old bits."""
    candidates = (
        ["raw"] if old is None else (["ulp", "xor", "raw"] if dt.itemsize <= 4 else ["xor", "raw"])
    )
    old_np = None if old is None else old.cpu().numpy()
    k = new.shape[0]
    # choose on an evenly strided sample: the choice needs statistics, not every element
    idx = slice(None) if k <= ESTIMATE_SAMPLE else slice(None, None, k // ESTIMATE_SAMPLE)
    best = None
    for enc in candidates:
        if len(candidates) == 1:
            best = (0.0, enc, None)
            break
        u = values_for(enc, None if old is None else old[idx], new[idx], dt)
        tokens = entropy.tokenize(u)[0]
        if enc == "ulp":
            ctx, cost = _choose_context(old_np[idx], tokens, dt)
        else:
            ctx, cost = None, entropy.cost_bits(tokens, np.zeros_like(tokens), 1)
        if best is None or cost < best[0]:
            best = (cost, enc, ctx)
    _, enc, ctx = best
    u = values_for(enc, old, new, dt)
    if ctx is None:
        return enc, None, entropy.encode(u)
    return enc, ctx, entropy.encode(u, ctx.of(old_np, dt), ctx.count)


def decode_values(
    enc: str,
    ctx: Context | None,
    data: bytes | memoryview,
    k: int,
    old: torch.Tensor | None,
    dt: DTypeInfo,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Inverse of encode_values: `k` new sign-extended int64 bits from `data` and the `old` bits,
    on `device`. Raises CodecError."""
    if enc not in VAL_ENCODINGS:
        raise CodecError(f"unknown value encoding {enc!r}")
    cvec = None
    if ctx is not None:
        if enc != "ulp" or old is None or not dt.is_float:
            raise CodecError("value context without a float base")
        cvec = ctx.of(old.cpu().numpy(), dt)
    try:
        u = entropy.decode(data, k, cvec)
    except entropy.StreamError as e:
        raise CodecError(f"values: {e}") from None
    return apply_values(enc, u, old, dt, device)


# ---------------------------------------------------------------- whole chunks


def encode_chunk(
    pos: np.ndarray,
    old: torch.Tensor | None,
    new: torch.Tensor,
    dt: DTypeInfo,
    start: int,
    stop: int,
) -> EncodedChunk:
    """pos: sorted absolute positions in [start, stop); old/new: int64 bits at those positions."""
    penc, pbytes = encode_positions(pos, start, stop)
    venc, ctx, vbytes = encode_values(old, new, dt)
    return EncodedChunk(start, stop, int(pos.shape[0]), penc, venc, ctx, pbytes, vbytes)
