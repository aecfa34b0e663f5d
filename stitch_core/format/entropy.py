"""Entropy coding of integer streams: tokens + static rANS + raw extra bits (see docs/format.md).

An unsigned 64-bit value u becomes a token (0..255) and `extra` raw bits:
  u < 16:  token = u, no extra bits
  else:    nb = floor(log2 u) (4..63); token = 16 + 4*(nb-4) + ((u >> (nb-2)) & 3);
           extra = the low nb-2 bits of u
Tokens are coded with a static rANS coder (32-bit state, byte-wise renormalisation, L = 2^23) under
per-context frequency tables stored in the stream; extra bits are packed LSB-first. The hot loops
are small numba kernels; everything around them is vectorised numpy.
"""

from __future__ import annotations

import math
import struct

import numpy as np

from stitch_core._jit import numba
from stitch_core.errors import StitchError

RANS_L = 1 << 23
SCALE_BITS = 14
MAX_SCALE_BITS = 15
MAX_CONTEXTS = 64
# the most probable symbol gets at most 1 - 2**-MIN_COST_SHIFT of a table, so each token costs at
# least MIN_TOKEN_BITS (~0.0227 bits): a stream cannot expand more than ~350 values per byte
MIN_COST_SHIFT = 6
MIN_TOKEN_BITS = -math.log2(1 - 2.0**-MIN_COST_SHIFT) * 0.999


class StreamError(StitchError, ValueError):
    """A coded stream is malformed."""


# ---------------------------------------------------------------- tokens (vectorised)


def tokenize(u: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """u (uint64) -> (tokens uint8, extra values uint64, extra bit counts uint8)."""
    u = np.ascontiguousarray(u, dtype=np.uint64)
    tok = np.empty(u.shape[0], dtype=np.uint8)
    extra = np.empty(u.shape[0], dtype=np.uint64)
    nextra = np.empty(u.shape[0], dtype=np.uint8)
    _tokenize(u, tok, extra, nextra)
    return tok, extra, nextra


def token_extra_bits(tokens: np.ndarray) -> np.ndarray:
    """The number of raw extra bits each token carries (uint8)."""
    t = tokens.astype(np.int64)
    return np.where(t < 16, 0, (t - 16) // 4 + 2).astype(np.uint8)


def detokenize(tokens: np.ndarray, extra: np.ndarray) -> np.ndarray:
    """(tokens, extra values) -> u (uint64): the inverse of `tokenize`."""
    out = np.empty(tokens.shape[0], dtype=np.uint64)
    _detokenize(np.ascontiguousarray(tokens), np.ascontiguousarray(extra, np.uint64), out)
    return out


# ---------------------------------------------------------------- numba kernels


@numba.njit(cache=True, nogil=True)
def _histogram(tokens, ctx, counts):  # pragma: no cover - compiled
    for i in range(tokens.shape[0]):
        counts[ctx[i], tokens[i]] += 1


@numba.njit(cache=True, nogil=True)
def _tokenize(u, tok, extra, nextra):  # pragma: no cover - compiled
    total = 0
    for i in range(u.shape[0]):
        v = u[i]
        if v < 16:
            tok[i] = np.uint8(v)
            extra[i] = 0
            nextra[i] = 0
            continue
        nb = 0
        x = v
        for sh in (32, 16, 8, 4, 2, 1):
            if x >> np.uint64(sh):
                x >>= np.uint64(sh)
                nb += sh
        ne = nb - 2
        tok[i] = np.uint8(16 + 4 * (nb - 4) + int((v >> np.uint64(ne)) & np.uint64(3)))
        extra[i] = v & ((np.uint64(1) << np.uint64(ne)) - np.uint64(1))
        nextra[i] = np.uint8(ne)
        total += ne
    return total


@numba.njit(cache=True, nogil=True)
def _detokenize(tok, extra, out):  # pragma: no cover - compiled
    for i in range(tok.shape[0]):
        t = int(tok[i])
        if t < 16:
            out[i] = np.uint64(t)
        else:
            nb = (t - 16) // 4 + 4
            m = np.uint64((t - 16) & 3)
            out[i] = ((np.uint64(1) << np.uint64(nb)) | (m << np.uint64(nb - 2))) | extra[i]


@numba.njit(cache=True, nogil=True)
def _unpack_detokenize(tok, data, out):  # pragma: no cover - compiled
    """Read each token's extra bits (LSB-first) and rebuild values. Bytes used, or -1."""
    acc = np.uint64(0)
    have = 0
    p = 0
    for i in range(tok.shape[0]):
        t = int(tok[i])
        if t < 16:
            out[i] = np.uint64(t)
            continue
        nb = (t - 16) // 4 + 4
        n = nb - 2
        v = np.uint64(0)
        shift = 0
        while n > 0:
            take = 32 if n > 32 else n
            while have < take:
                if p >= data.shape[0]:
                    return -1
                acc |= np.uint64(data[p]) << np.uint64(have)
                p += 1
                have += 8
            v |= (acc & ((np.uint64(1) << np.uint64(take)) - np.uint64(1))) << np.uint64(shift)
            acc >>= np.uint64(take)
            have -= take
            shift += take
            n -= take
        m = np.uint64((t - 16) & 3)
        out[i] = (np.uint64(1) << np.uint64(nb)) | (m << np.uint64(nb - 2)) | v
    if acc != 0:  # padding bits must be zero
        return -1
    return p


@numba.njit(cache=True, nogil=True)
def _pack_bits(values, nbits, out):  # pragma: no cover - compiled
    acc = np.uint64(0)
    have = 0
    p = 0
    for i in range(values.shape[0]):
        v = values[i]
        n = int(nbits[i])
        while n > 0:
            take = 32 if n > 32 else n
            acc |= (v & ((np.uint64(1) << np.uint64(take)) - np.uint64(1))) << np.uint64(have)
            have += take
            v >>= np.uint64(take)
            n -= take
            while have >= 8:
                out[p] = np.uint8(acc & np.uint64(0xFF))
                p += 1
                acc >>= np.uint64(8)
                have -= 8
    if have > 0:
        out[p] = np.uint8(acc & np.uint64(0xFF))
        p += 1
    return p


@numba.njit(cache=True, nogil=True)
def _rans_encode(tokens, ctx, freq, cum, scale_bits, out):  # pragma: no cover - compiled
    """Encode in reverse into the tail of `out`; returns the start index of the stream."""
    p = out.shape[0]
    x = np.uint64(RANS_L)
    for i in range(tokens.shape[0] - 1, -1, -1):
        c = ctx[i]
        s = tokens[i]
        f = np.uint64(freq[c, s])
        x_max = np.uint64((RANS_L >> scale_bits) << 8) * f
        while x >= x_max:
            p -= 1
            out[p] = np.uint8(x & np.uint64(0xFF))
            x >>= np.uint64(8)
        x = ((x // f) << np.uint64(scale_bits)) + (x % f) + np.uint64(cum[c, s])
    for _ in range(4):
        p -= 1
        out[p] = np.uint8((x >> np.uint64(24)) & np.uint64(0xFF))
        x = (x << np.uint64(8)) & np.uint64(0xFFFFFFFF)
    return p


@numba.njit(cache=True, nogil=True)
def _rans_decode(data, ctx, freq, cum, lookup, scale_bits, out):  # pragma: no cover - compiled
    """Decode len(out) tokens. Returns bytes consumed, or -1 if the stream is malformed."""
    n = data.shape[0]
    if n < 4:
        return -1
    x = (
        np.uint64(data[0])
        | (np.uint64(data[1]) << np.uint64(8))
        | (np.uint64(data[2]) << np.uint64(16))
        | (np.uint64(data[3]) << np.uint64(24))
    )
    p = 4
    mask = np.uint64((1 << scale_bits) - 1)
    for i in range(out.shape[0]):
        c = ctx[i]
        slot = x & mask
        s = lookup[c, slot]
        f = np.uint64(freq[c, s])
        if f == 0:
            return -1
        x = f * (x >> np.uint64(scale_bits)) + slot - np.uint64(cum[c, s])
        while x < np.uint64(RANS_L):
            if p >= n:
                return -1
            x = (x << np.uint64(8)) | np.uint64(data[p])
            p += 1
        out[i] = s
    if x != np.uint64(RANS_L):
        return -1
    return p


@numba.njit(cache=True, nogil=True)
def _build_lookup(freq, cum, scale_bits, lookup):  # pragma: no cover - compiled
    for c in range(freq.shape[0]):
        for s in range(256):
            f = freq[c, s]
            if f:
                b = cum[c, s]
                for j in range(b, b + f):
                    lookup[c, j] = s


# ---------------------------------------------------------------- frequency tables


def normalize(counts: np.ndarray, scale_bits: int = SCALE_BITS) -> np.ndarray:
    """Counts (256,) -> frequencies summing to 2^scale_bits, every used symbol >= 1."""
    total = int(counts.sum())
    target = 1 << scale_bits
    if total == 0:
        return np.zeros(256, dtype=np.int64)
    f = np.where(counts > 0, np.maximum(1, (counts * target) // total), 0).astype(np.int64)
    diff = target - int(f.sum())
    order = np.argsort(-counts, kind="stable")
    i = 0
    while diff != 0:  # at most a few passes over <= 256 symbols
        s = order[i % 256]
        if counts[s] > 0:
            if diff > 0:
                f[s] += diff
                diff = 0
            elif f[s] > 1:
                take = min(f[s] - 1, -diff)
                f[s] -= take
                diff += take
        i += 1
    cap = target - (target >> MIN_COST_SHIFT)
    top = int(np.argmax(f))
    if f[top] > cap:  # no symbol is (nearly) free: every token costs >= MIN_TOKEN_BITS
        spare = np.flatnonzero(f == 0)
        f[spare[0] if spare.size else int(np.argsort(f)[-2])] += int(f[top]) - cap
        f[top] = cap
    return f


def min_stream_bytes(k: int) -> int:
    """The fewest bytes `encode` can write for `k` values: every token costs at least
    MIN_TOKEN_BITS (no symbol's frequency is over 1 - 2^-MIN_COST_SHIFT), less the 32 bits of
    rANS state slack. Readers refuse streams claiming more values than this allows (a
    decompression bomb): see docs/format.md section 3.2."""
    return max(0, int(k * MIN_TOKEN_BITS / 8) - 4)


def cost_bits(tokens: np.ndarray, ctx: np.ndarray, n_ctx: int) -> float:
    """Estimated coded size in bits (entropy of tokens given context + tables + extra bits)."""
    if tokens.size == 0:
        return 0.0
    joint = np.bincount(ctx.astype(np.int64) * 256 + tokens, minlength=n_ctx * 256)
    joint = joint.reshape(n_ctx, 256).astype(np.float64)
    per_ctx = joint.sum(axis=1, keepdims=True)
    nz = joint > 0
    p = np.where(nz, joint / np.maximum(per_ctx, 1), 1.0)
    ent = -(joint * np.log2(p)).sum()
    tables = 8 * (2 * n_ctx + 3 * int(nz.sum()))
    return ent + tables + float(token_extra_bits(tokens).astype(np.int64).sum()) + 80


# ---------------------------------------------------------------- streams


def encode(u: np.ndarray, ctx: np.ndarray | None = None, n_ctx: int = 1) -> bytes:
    """Encode uint64 values under optional contexts (uint8, < n_ctx) into one stream."""
    if not 1 <= n_ctx <= MAX_CONTEXTS:
        raise ValueError("n_ctx out of range")
    u = np.ascontiguousarray(u, dtype=np.uint64)
    k = u.shape[0]
    tokens = np.empty(k, dtype=np.uint8)
    extra = np.empty(k, dtype=np.uint64)
    nextra = np.empty(k, dtype=np.uint8)
    extra_bits = _tokenize(u, tokens, extra, nextra)
    ctx = np.zeros(k, dtype=np.uint8) if ctx is None else np.ascontiguousarray(ctx, np.uint8)
    counts = np.zeros((n_ctx, 256), dtype=np.int64)
    _histogram(tokens, ctx, counts)
    freq = np.stack([normalize(counts[c]) for c in range(n_ctx)]).astype(np.uint32)
    cum = np.zeros_like(freq)
    cum[:, 1:] = np.cumsum(freq, axis=1)[:, :-1]
    head = [struct.pack("<BB", SCALE_BITS, n_ctx)]
    for c in range(n_ctx):
        used = np.flatnonzero(freq[c])
        head.append(struct.pack("<H", used.size))
        rec = np.zeros(used.size, dtype=[("s", "u1"), ("f", "<u2")])
        rec["s"], rec["f"] = used, freq[c, used]
        head.append(rec.tobytes())
    buf = np.empty(4 + 2 * k + 16, dtype=np.uint8)  # rANS emits < 2 bytes per 8-bit token
    start = _rans_encode(tokens, ctx, freq, cum, SCALE_BITS, buf)
    rans = buf[start:].tobytes()
    ebuf = np.empty((extra_bits + 7) // 8 + 8, dtype=np.uint8)
    elen = _pack_bits(extra, nextra, ebuf)
    return b"".join(head) + struct.pack("<II", len(rans), elen) + rans + ebuf[:elen].tobytes()


def decode(data: bytes | memoryview, k: int, ctx: np.ndarray | None = None) -> np.ndarray:
    """Decode k uint64 values; contexts must be those given to `encode`. Raises StreamError."""
    buf = np.frombuffer(data, dtype=np.uint8)
    if buf.size < 2:
        raise StreamError("stream too short")
    scale_bits, n_ctx = int(buf[0]), int(buf[1])
    if not 1 <= scale_bits <= MAX_SCALE_BITS or not 1 <= n_ctx <= MAX_CONTEXTS:
        raise StreamError("bad stream parameters")
    p = 2
    freq = np.zeros((n_ctx, 256), dtype=np.uint32)
    for c in range(n_ctx):
        if p + 2 > buf.size:
            raise StreamError("truncated frequency table")
        n_used = int(buf[p]) | int(buf[p + 1]) << 8
        p += 2
        if n_used > 256 or p + 3 * n_used > buf.size:
            raise StreamError("bad frequency table")
        rec = np.frombuffer(buf[p : p + 3 * n_used].tobytes(), dtype=[("s", "u1"), ("f", "<u2")])
        p += 3 * n_used
        if n_used:
            if (
                np.unique(rec["s"]).size != n_used
                or int(rec["f"].astype(np.int64).sum()) != (1 << scale_bits)
                or (rec["f"] == 0).any()
            ):
                raise StreamError("frequency table does not sum to 2^scale")
            freq[c, rec["s"]] = rec["f"]
    if p + 8 > buf.size:
        raise StreamError("truncated stream header")
    rans_len, extra_len = struct.unpack_from("<II", buf, p)
    p += 8
    if p + rans_len + extra_len != buf.size:
        raise StreamError("stream length mismatch")
    if rans_len + extra_len < min_stream_bytes(k):
        raise StreamError(f"{buf.size} bytes cannot hold {k} values (over the format's "
                          "expansion limit: a decompression bomb?)")
    ctx = np.zeros(k, dtype=np.uint8) if ctx is None else np.ascontiguousarray(ctx, np.uint8)
    if ctx.shape[0] != k or (k and int(ctx.max()) >= n_ctx):
        raise StreamError("context out of range")
    cum = np.zeros_like(freq)
    cum[:, 1:] = np.cumsum(freq, axis=1)[:, :-1]
    lookup = np.zeros((n_ctx, 1 << scale_bits), dtype=np.uint8)
    _build_lookup(freq, cum, scale_bits, lookup)
    tokens = np.empty(k, dtype=np.uint8)
    used = _rans_decode(buf[p : p + rans_len], ctx, freq, cum, lookup, scale_bits, tokens)
    if used != rans_len:
        raise StreamError("corrupt entropy-coded stream")
    out = np.empty(k, dtype=np.uint64)
    got = _unpack_detokenize(tokens, buf[p + rans_len :], out)
    if got != extra_len:
        raise StreamError("corrupt extra bits")
    return out
