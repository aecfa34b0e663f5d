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

Size: about 595 lines, one job: a chunk's bytes from and to tensor elements. Besides the
per-stream functions (any device) it holds the fused CPU passes, `compare` (compare, gather and
fingerprint delta in one pass over the tensor) and `apply_cpu` (both streams decoded and written
in place in one kernel), which must stay next to the stream definitions they inline.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from stitch_core._jit import numba, prefetch
from stitch_core.errors import StitchError
from stitch_core.format import dtypes, entropy, rans
from stitch_core.format.dtypes import DTypeInfo
from stitch_core.format.fingerprint import element_hash_nb as _h

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


@numba.njit(cache=True, nogil=True)
def _gaps(pos, start, out):  # pragma: no cover - compiled
    last = start - 1
    for i in range(pos.shape[0]):
        out[i] = pos[i] - last - 1
        last = pos[i]


def encode_positions(pos: np.ndarray, start: int, stop: int) -> tuple[str, bytes]:
    """Code sorted absolute positions in [start, stop): `all` when every position is there, else
    `gaps` or `bitmap`, whichever is smaller. Returns (encoding, bytes)."""
    k, n = pos.shape[0], stop - start
    if k == n:
        return "all", b""
    gaps = np.empty(k, dtype=np.uint64)
    _gaps(np.ascontiguousarray(pos, np.int64), start, gaps)
    coded = entropy.encode(gaps)
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


@numba.njit(cache=True, nogil=True)
def _value_counts(old, new, step, bits, mant, is_float, base, n, ulp, xor, raw):  # pragma: no cover
    """Token histograms of every value candidate on old[::step], new[::step]: ulp under the
    contexts (base, n, sign) (n = 0: context 0 only), xor, raw (raw and xor masked to `bits`)."""
    umask = (np.int64(1) << bits) - 1 if bits < 64 else np.int64(-1)
    emask = (np.int64(1) << (bits - 1 - mant)) - 1
    fmask = (np.int64(1) << (bits - 1)) - 1
    for i in range(0, old.shape[0], step):
        o, v = old[i], new[i]
        t, _ = entropy.token_of(np.uint64((v ^ o) & umask))
        xor[t] += 1
        t, _ = entropy.token_of(np.uint64(v & umask))
        raw[t] += 1
        if ulp.shape[0] == 0:
            continue
        ko, kn = o, v
        if is_float:
            ko ^= (ko >> 63) & fmask
            kn ^= (kn >> 63) & fmask
        d = kn - ko
        t, _ = entropy.token_of(np.uint64((d << 1) ^ (d >> 63)))
        c = 0
        if n:
            ub = o & umask
            c = ((ub >> mant) & emask) - base
            c = 0 if c < 0 else (n - 1 if c > n - 1 else c)
            if (ub >> (bits - 1)) & 1:
                c += n
        ulp[c, t] += 1


_EXTRA = entropy.token_extra_bits(np.arange(256, dtype=np.uint8)).astype(np.float64)


@numba.njit(cache=True, nogil=True)
def _cost(joint):  # pragma: no cover - compiled
    """entropy.cost_bits of tokens given by their histogram per context (n_ctx, 256)."""
    ent, ex, nz, total = 0.0, 0.0, 0, 0
    for c in range(joint.shape[0]):
        t = joint[c].sum()
        total += t
        for s in range(256):
            v = joint[c, s]
            if v > 0:
                nz += 1
                ent -= v * np.log2(v / t)
                ex += v * _EXTRA[s]
    return 0.0 if total == 0 else ent + 8 * (2 * joint.shape[0] + 3 * nz) + ex + 80


def _choose(old: np.ndarray, new: np.ndarray, dt: DTypeInfo) -> tuple[str, Context | None]:
    """The value encoding (and context) with the smallest estimated size, from token histograms
    of an evenly strided sample: the choice needs statistics, not every element."""
    k = new.shape[0]
    step = 1 if k <= ESTIMATE_SAMPLE else k // ESTIMATE_SAMPLE
    ctx_n, base = 0, 0
    with_ulp = dt.itemsize <= 4
    if with_ulp and dt.is_float and len(range(0, k, step)) >= 256:
        ub = old[::step] & ((1 << dt.bits) - 1)
        exp = (ub >> dt.mantissa_bits) & ((1 << (dt.bits - 1 - dt.mantissa_bits)) - 1)
        cdf = np.cumsum(np.bincount(exp)) / exp.size
        lo, hi = int(np.searchsorted(cdf, 0.01)), int(np.searchsorted(cdf, 0.99))
        ctx_n = int(min(hi - lo + 1, MAX_CTX_EXPONENTS))
        base = hi - ctx_n + 1
    ulp = np.zeros((max(2 * ctx_n, 1) if with_ulp else 0, 256), dtype=np.int64)
    xor, raw = np.zeros(256, dtype=np.int64), np.zeros(256, dtype=np.int64)
    _value_counts(old, new, step, dt.bits, dt.mantissa_bits, dt.is_float, base, ctx_n, ulp, xor,
                  raw)
    cands: list[tuple[float, str, Context | None]] = []
    if with_ulp:
        cands.append((_cost(ulp.sum(0).reshape(1, 256)), "ulp", None))
        if ctx_n:
            cands.append((_cost(ulp[:ctx_n] + ulp[ctx_n:]), "ulp", Context(base, ctx_n, False)))
            cands.append((_cost(ulp), "ulp", Context(base, ctx_n, True)))
    cands += [(_cost(xor.reshape(1, 256)), "xor", None), (_cost(raw.reshape(1, 256)), "raw", None)]
    best = cands[0]
    for c in cands[1:]:
        if c[0] < best[0]:
            best = c
    return best[1], best[2]


def encode_values(
    old: torch.Tensor | None, new: torch.Tensor, dt: DTypeInfo
) -> tuple[str, Context | None, bytes]:
    """Code new bits (sign-extended int64, at the changed positions) against old bits."""
    if old is None:
        return "raw", None, entropy.encode(values_for("raw", None, new, dt))
    old_np = old.cpu().numpy()
    enc, ctx = _choose(old_np, new.cpu().numpy(), dt)
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


# ---------------------------------------------------------------- fused CPU passes
# The hot paths on CPU, one pass each: `diff_cpu` compares two int views and gathers what the
# encoder and the fingerprint need; `apply_cpu` decodes one chunk's streams and writes it in place.

VAL_CODES = {"ulp": 0, "xor": 1, "raw": 2}
_BAD_POS, _BAD_VALUE, _ULP_RANGE = -5, -3, -4
LAG = 16


@numba.njit(cache=True, nogil=True)
def _diff_positions(a, b, pos):  # pragma: no cover - compiled
    """Positions where a != b into pos (branch-free: a write per element, a branch per none);
    returns their count."""
    k = 0
    for i in range(a.shape[0]):
        pos[k] = i
        k += a[i] != b[i]
    return k


@numba.njit(cache=True, nogil=True)
def _gather(a, b, pos, offset, seed, itemsize, old, new):  # pragma: no cover - compiled
    """Old and new bits (sign-extended) at pos, pos += offset, and the fingerprint delta."""
    acc = np.uint64(0)
    for j in range(old.shape[0]):
        i = pos[j]
        o, n = np.int64(a[i]), np.int64(b[i])
        p = i + offset
        old[j], new[j], pos[j] = o, n, p
        acc += _h(p, n, seed, itemsize) - _h(p, o, seed, itemsize)
    return acc


def compare(
    a: torch.Tensor, b: torch.Tensor, offset: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int | None]:
    """(positions + offset, old bits, new bits) where the int views a and b differ, and the
    fingerprint delta of tensor `seed` (CPU: one numba pass; elsewhere torch, and None)."""
    if a.device.type != "cpu" or b.device.type != "cpu":
        pos = torch.nonzero(a != b).reshape(-1)
        return pos + offset, a[pos].to(torch.int64), b[pos].to(torch.int64), None
    an, bn = a.numpy(), b.numpy()
    pos = np.empty(a.numel() + 1, dtype=np.int64)  # pages are touched only up to the count
    k = _diff_positions(an, bn, pos)
    pos = pos[:k].copy()
    old, new = np.empty(k, dtype=np.int64), np.empty(k, dtype=np.int64)
    delta = _gather(an, bn, pos, offset, seed, a.element_size(), old, new)
    return torch.from_numpy(pos), torch.from_numpy(old), torch.from_numpy(new), int(delta)


@numba.njit(cache=True, nogil=True)
def _apply(  # pragma: no cover - compiled
    flat, pos, gaps, start, stop, pst, val, venc, ctx, dti, seed, old_out
):
    """Decode one chunk and write it into `flat`; (status, fingerprint delta). pst/val: a
    stream's `kernel_args()` for the gap stream (when `gaps`, else `pos` is given) and the value
    stream; ctx: (base, n, sign), n = 0 without; dti: (bits, mantissa bits, is_float,
    itemsize). On failure every write is undone (old_out holds the old bits of each written
    element; positions are strictly increasing, so a write never changes an old bit read later)."""
    prans, pn, pwords, pne, pfreq, pcum, plook, psb, planes = pst
    vrans, vn, vwords, vne, vfreq, vcum, vlook, vsb, vlanes = val
    cbase, cn, csign = ctx
    bits, mant, is_float, itemsize = dti
    k = old_out.shape[0]
    acc = np.uint64(0)
    one = np.uint64(rans.RANS_L)
    px0, px1, px2, px3, pp = one, one, one, one, 0
    pbp = np.uint64(0)
    if gaps:
        px0, px1, px2, px3, pp = rans.rans_states(prans, pn, planes)
        if px0 == 0:
            return -1, acc
    vx0, vx1, vx2, vx3, vp = rans.rans_states(vrans, vn, vlanes)
    if vx0 == 0:
        return -1, acc
    vbp = np.uint64(0)
    plim, vlim = np.uint64(8 * pne), np.uint64(8 * vne)
    pmask = np.uint64((1 << psb) - 1)
    vmask = np.uint64((1 << vsb) - 1)
    umask = (np.int64(1) << bits) - 1
    emask = (np.int64(1) << (bits - 1 - mant)) - 1
    fmask = (np.int64(1) << (bits - 1)) - 1
    half = np.int64(1) << (bits - 1)
    last = np.int64(start - 1)
    # the position and value decoders are independent chains (each of up to 4 rANS lanes),
    # interleaved for the CPU to overlap; values run LAG positions behind, and each position's
    # old element is prefetched when the position is decoded, so its load hits the cache
    status, w = 0, 0  # w: elements written (undone on failure)
    for i in range(k + LAG):
        if gaps and i < k:
            s, xn, pp = rans.rans_step(prans, pp, px0, 0, pfreq, pcum, plook, pmask, psb)
            px0, px1, px2, px3 = rans.rotate(px1, px2, px3, xn, planes)
            g, pbp = entropy.extra_step(pwords, pbp, s)
            status = -1 if pp > pn else (-2 if pbp > plim else 0)
            if status == 0 and g >= np.uint64(stop - last - 1):
                status = _BAD_POS
            if status:
                break
            last += np.int64(g) + 1
            pos[i] = last
        if i < k:
            prefetch(flat, pos[i])
        j = i - LAG
        if j < 0:
            continue
        p = pos[j]
        o = np.int64(flat[p])
        old_out[j] = o
        c = 0
        if cn:
            ub = o & umask
            c = ((ub >> mant) & emask) - cbase
            c = 0 if c < 0 else (cn - 1 if c > cn - 1 else c)
            if csign and (ub >> (bits - 1)) & 1:
                c += cn
        s, xn, vp = rans.rans_step(vrans, vp, vx0, c, vfreq, vcum, vlook, vmask, vsb)
        vx0, vx1, vx2, vx3 = rans.rotate(vx1, vx2, vx3, xn, vlanes)
        u, vbp = entropy.extra_step(vwords, vbp, s)
        if vp > vn or vbp > vlim:
            status = -1 if vp > vn else -2
            break
        if venc == 0:
            d = np.int64(u >> np.uint64(1)) ^ -np.int64(u & np.uint64(1))
            n = (o ^ ((o >> 63) & fmask) if is_float else o) + d
            if n < -half or n >= half:
                status = _ULP_RANGE
                break
            if is_float:
                n ^= (n >> 63) & fmask
        else:
            if u >> np.uint64(bits):
                status = _BAD_VALUE
                break
            n = np.int64(u) ^ (o & umask) if venc == 1 else np.int64(u)
            n = ((n + half) & umask) - half
        flat[p] = n
        w += 1
        acc += _h(p, n, seed, itemsize) - _h(p, o, seed, itemsize)
    if status == 0:
        if gaps and not rans.rans_done(px0, px1, px2, px3, pp, pn):
            status = -1
        elif gaps and not entropy.extra_done(pwords, pbp, pne):
            status = -2
        elif not rans.rans_done(vx0, vx1, vx2, vx3, vp, vn):
            status = -1
        elif not entropy.extra_done(vwords, vbp, vne):
            status = -2
    if status:
        for j in range(w):
            flat[pos[j]] = old_out[j]
    return status, acc


_NO_STREAM = None


def apply_cpu(
    flat: np.ndarray, penc: str, pdata, venc: str, ctx: Context | None, vdata,
    start: int, stop: int, k: int, dt: DTypeInfo, seed: int,
) -> tuple[np.ndarray, np.ndarray, int]:
    """Decode one chunk straight into `flat` (a CPU int view as numpy, itemsize <= 4) in one
    pass: (positions, old bits, fingerprint delta). Raises CodecError, having written nothing."""
    global _NO_STREAM
    if venc not in VAL_CODES:
        raise CodecError(f"unknown value encoding {venc!r}")
    if ctx is not None and (venc != "ulp" or not dt.is_float):
        raise CodecError("value context without a float base")
    gaps = penc == "gaps"
    try:
        if gaps:
            pstream = entropy.parse(pdata, k)
            if pstream.n_ctx != 1:
                raise CodecError("positions: context out of range")
            pst = pstream.kernel_args()
            pos = np.empty(k, dtype=np.int64)
        else:
            pos = decode_positions(penc, pdata, start, stop, k)
            if _NO_STREAM is None:
                _NO_STREAM = entropy.parse(entropy.encode(np.zeros(0, np.uint64)), 0).kernel_args()
            pst = _NO_STREAM
        vst = entropy.parse(vdata, k)
    except entropy.StreamError as e:
        raise CodecError(f"{'positions' if gaps else 'values'}: {e}") from None
    c = (ctx.base, ctx.n, ctx.sign) if ctx is not None else (0, 0, False)
    if vst.n_ctx < (ctx.count if ctx is not None else 1):
        raise CodecError("values: context out of range")
    old = np.empty(k, dtype=np.int64)
    dti = (dt.bits, dt.mantissa_bits, dt.is_float, dt.itemsize)
    status, delta = _apply(flat, pos, gaps, start, stop, pst, vst.kernel_args(), VAL_CODES[venc],
                           c, dti, seed, old)
    if status:
        raise CodecError({-1: "corrupt entropy-coded stream", -2: "corrupt extra bits",
                          _BAD_POS: "position out of chunk range",
                          _BAD_VALUE: f"{venc} value wider than its dtype",
                          _ULP_RANGE: "ulp delta leaves the dtype's range"}[status])
    return pos, old, int(delta)
