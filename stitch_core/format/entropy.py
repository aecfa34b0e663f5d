"""Entropy coding of integer streams: tokens + static rANS + raw extra bits (see docs/format.md).

An unsigned 64-bit value u becomes a token (0..255) and `extra` raw bits:
  u < 16:  token = u, no extra bits
  else:    nb = floor(log2 u) (4..63); token = 16 + 4*(nb-4) + ((u >> (nb-2)) & 3);
           extra = the low nb-2 bits of u
Tokens are coded with static rANS (`stitch_core.format.rans`: 32-bit states, byte-wise
renormalisation, L = 2^23, 1..4 interleaved lanes) under per-context frequency tables stored in the
stream; extra bits are packed LSB-first. The hot loops are small numba kernels; everything around
them is vectorised numpy.

Size: about 480 lines, one job: the stream format (tokens, extra bits, tables on the wire, the
checks). The decoder's per-token steps (`rans.rans_step`, `extra_step`) are public numba functions
that codec's fused apply pass inlines. They are branch-free where a branch would follow the data
(renormalisation, extra-bit reads), which made decoding ~3x faster than byte-by-byte loops, and
four lanes another ~2.3x (benchmarks/codec.py).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import numpy as np

from stitch_core._jit import numba
from stitch_core.errors import StitchError
from stitch_core.format.rans import (
    MAX_LANES,
    PAD_BYTES,
    build_lookup,
    decode_kernel,
    encode_kernel,
    rans_done,
    rans_states,
    rans_step,
    rotate,
    tables,
)

# the encoder's table scale (the format allows 1..MAX_SCALE_BITS per stream): 2^12 rather than
# 2^14 makes each context's decode lookup 4 KiB, not 16, for <= 0.02% larger patches
# (benchmarks/results/codec_scale_bits.md)
SCALE_BITS = 12
LANES = 4  # what `encode` writes for streams of at least LANE_MIN_VALUES values
LANE_MIN_VALUES = 256
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


def _token_tables() -> tuple[np.ndarray, np.ndarray]:
    """Per token: its count of extra bits, and its value with those bits zero."""
    nbits = np.zeros(256, dtype=np.uint64)
    base = np.arange(256, dtype=np.uint64)
    for t in range(16, 256):
        nb = (t - 16) // 4 + 4
        nbits[t] = nb - 2
        base[t] = (1 << nb) | (((t - 16) & 3) << (nb - 2))
    return nbits, base


TOKEN_EXTRA_BITS, TOKEN_BASE = _token_tables()


def token_extra_bits(tokens: np.ndarray) -> np.ndarray:
    """The number of raw extra bits each token carries (uint8)."""
    return TOKEN_EXTRA_BITS[tokens].astype(np.uint8)


def detokenize(tokens: np.ndarray, extra: np.ndarray) -> np.ndarray:
    """(tokens, extra values) -> u (uint64): the inverse of `tokenize`."""
    return TOKEN_BASE[tokens] | np.asarray(extra, dtype=np.uint64)


# ---------------------------------------------------------------- numba kernels


@numba.njit(cache=True, nogil=True, inline="always")
def token_of(v):  # pragma: no cover - compiled
    """(token, extra bit count) of one value."""
    if v < 16:
        return np.uint8(v), 0
    nb = 0
    x = v
    for sh in (32, 16, 8, 4, 2, 1):
        if x >> np.uint64(sh):
            x >>= np.uint64(sh)
            nb += sh
    return np.uint8(16 + 4 * (nb - 4) + int((v >> np.uint64(nb - 2)) & np.uint64(3))), nb - 2


@numba.njit(cache=True, nogil=True)
def _tokenize_count(u, ctx, tok, counts):  # pragma: no cover - compiled
    """Tokens of u into `tok`, their histogram per context into `counts`; total extra bits."""
    total = 0
    for i in range(u.shape[0]):
        t, ne = token_of(u[i])
        tok[i] = t
        counts[ctx[i], t] += 1
        total += ne
    return total


@numba.njit(cache=True, nogil=True)
def _pack_extra(u, tok, out):  # pragma: no cover - compiled
    """Pack each value's extra bits (the low (token - 16) // 4 + 2 bits), LSB-first; bytes used."""
    acc = np.uint64(0)
    have = 0
    p = 0
    for i in range(u.shape[0]):
        t = int(tok[i])
        if t < 16:
            continue
        n = (t - 16) // 4 + 2
        v = u[i]
        while n > 0:
            take = 32 if n > 32 else n
            acc |= (v & ((np.uint64(1) << np.uint64(take)) - np.uint64(1))) << np.uint64(have)
            have += take
            v >>= np.uint64(take)
            n -= take
            if have >= 32:
                out[p] = np.uint8(acc & np.uint64(0xFF))
                out[p + 1] = np.uint8((acc >> np.uint64(8)) & np.uint64(0xFF))
                out[p + 2] = np.uint8((acc >> np.uint64(16)) & np.uint64(0xFF))
                out[p + 3] = np.uint8((acc >> np.uint64(24)) & np.uint64(0xFF))
                p += 4
                acc >>= np.uint64(32)
                have -= 32
    while have > 0:
        out[p] = np.uint8(acc & np.uint64(0xFF))
        p += 1
        acc >>= np.uint64(8)
        have -= 8
    return p


@numba.njit(cache=True, nogil=True)
def _tokenize(u, tok, extra, nextra):  # pragma: no cover - compiled
    total = 0
    for i in range(u.shape[0]):
        t, ne = token_of(u[i])
        tok[i] = t
        extra[i] = u[i] & ((np.uint64(1) << np.uint64(ne)) - np.uint64(1))
        nextra[i] = np.uint8(ne)
        total += ne
    return total


@numba.njit(cache=True, nogil=True, inline="always")
def extra_step(words, bp, s):  # pragma: no cover - compiled
    """The value of token s with its extra bits read at bit bp of `words` (the padded extra
    payload as uint64): (value, new bp). The caller checks bp <= 8 * payload bytes."""
    one = np.uint64(1)
    o = bp & np.uint64(63)
    w = bp >> np.uint64(6)
    win = (words[w] >> o) | ((words[w + one] << one) << (np.uint64(63) - o))
    n = TOKEN_EXTRA_BITS[s]
    return TOKEN_BASE[s] | (win & ((one << n) - one)), bp + n


@numba.njit(cache=True, nogil=True, inline="always")
def extra_done(words, bp, n):  # pragma: no cover - compiled
    """The extra payload (n bytes) was read to its last byte and nothing is left in it."""
    if (bp + np.uint64(7)) >> np.uint64(3) != np.uint64(n):
        return False
    o = bp & np.uint64(63)
    w = bp >> np.uint64(6)
    win = (words[w] >> o) | ((words[w + np.uint64(1)] << np.uint64(1)) << (np.uint64(63) - o))
    return win == 0


@numba.njit(cache=True, nogil=True)
def _decode_values(rans, n_rans, words, n_extra, freq, cum, lookup, scale_bits, lanes, ctx,
                   out):  # pragma: no cover - compiled
    """Tokens and extra bits in one pass into values: 0, or -1 (rANS) / -2 (extra bits) if the
    stream is malformed or not consumed exactly. The arguments before ctx are a stream's
    `kernel_args()` (rans/words: padded payloads)."""
    x0, x1, x2, x3, p = rans_states(rans, n_rans, lanes)
    if x0 == 0:
        return -1
    bp = np.uint64(0)
    lim = np.uint64(8 * n_extra)
    mask = np.uint64((1 << scale_bits) - 1)
    for i in range(out.shape[0]):
        s, xn, p = rans_step(rans, p, x0, ctx[i], freq, cum, lookup, mask, scale_bits)
        x0, x1, x2, x3 = rotate(x1, x2, x3, xn, lanes)
        if p > n_rans:
            return -1
        out[i], bp = extra_step(words, bp, s)
        if bp > lim:
            return -2
    if not rans_done(x0, x1, x2, x3, p, n_rans):
        return -1
    if not extra_done(words, bp, n_extra):
        return -2
    return 0


# ---------------------------------------------------------------- frequency tables


@numba.njit(cache=True, nogil=True)
def _normalize(counts, target, cap, f):  # pragma: no cover - compiled
    """`normalize` of one row into f; False when its rare last case (every symbol used and the
    top one over the cap) is left to the caller."""
    total = counts.sum()
    for s in range(256):
        f[s] = max(1, (counts[s] * target) // total) if counts[s] > 0 else 0
    diff = target - f.sum()
    order = np.argsort(-counts, kind="mergesort")
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
    top = np.argmax(f)
    if f[top] > cap:
        for s in range(256):
            if f[s] == 0:
                f[s] += f[top] - cap
                f[top] = cap
                return True
        return False
    return True


@numba.njit(cache=True, nogil=True)
def _normalize_all(counts, target, cap, freq):  # pragma: no cover - compiled
    """`normalize` of every row of counts into freq; False if a row needs the Python path."""
    for c in range(counts.shape[0]):
        if counts[c].sum() and not _normalize(counts[c], target, cap, freq[c]):
            return False
    return True


def normalize(counts: np.ndarray, scale_bits: int = SCALE_BITS) -> np.ndarray:
    """Counts (256,) -> frequencies summing to 2^scale_bits, every used symbol >= 1. The most
    probable symbol gets at most 1 - 2^-MIN_COST_SHIFT of the table."""
    target = 1 << scale_bits
    f = np.zeros(256, dtype=np.int64)
    counts = np.ascontiguousarray(counts, dtype=np.int64)
    if int(counts.sum()) == 0:
        return f
    cap = target - (target >> MIN_COST_SHIFT)
    if not _normalize(counts, target, cap, f):  # no symbol is (nearly) free: give one away
        top = int(np.argmax(f))
        f[int(np.argsort(f)[-2])] += int(f[top]) - cap
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


def lanes_for(k: int) -> int:
    """The rANS lanes `encode` gives a stream of k values: LANES, or 1 for short streams (each
    lane costs 4 bytes of state)."""
    return LANES if k >= LANE_MIN_VALUES else 1


def encode(
    u: np.ndarray, ctx: np.ndarray | None = None, n_ctx: int = 1, lanes: int | None = None
) -> bytes:
    """Encode uint64 values under optional contexts (uint8, < n_ctx) into one stream, with
    `lanes` interleaved rANS states (default `lanes_for(len(u))`)."""
    if not 1 <= n_ctx <= MAX_CONTEXTS:
        raise ValueError("n_ctx out of range")
    u = np.ascontiguousarray(u, dtype=np.uint64)
    k = u.shape[0]
    lanes = lanes_for(k) if lanes is None else lanes
    if not 1 <= lanes <= MAX_LANES:
        raise ValueError("lanes out of range")
    tokens = np.empty(k, dtype=np.uint8)
    ctx = np.zeros(k, dtype=np.uint8) if ctx is None else np.ascontiguousarray(ctx, np.uint8)
    counts = np.zeros((n_ctx, 256), dtype=np.int64)
    extra_bits = _tokenize_count(u, ctx, tokens, counts)
    target = 1 << SCALE_BITS
    freq = np.zeros((n_ctx, 256), dtype=np.int64)
    if not _normalize_all(counts, target, target - (target >> MIN_COST_SHIFT), freq):
        freq = np.stack([normalize(counts[c]) for c in range(n_ctx)])
    freq = freq.astype(np.uint32)
    cum = np.empty_like(freq)
    head = np.empty(2 + n_ctx * (2 + 3 * 256), dtype=np.uint8)
    hlen = tables(freq, SCALE_BITS, cum, head)
    head[0] |= (lanes - 1) << 4
    buf = np.empty(4 * lanes + 2 * k + 16, dtype=np.uint8)  # < 2 bytes per 8-bit token
    start = encode_kernel(tokens, ctx, freq, cum, SCALE_BITS, lanes, buf)
    ebuf = np.empty((extra_bits + 7) // 8 + 8, dtype=np.uint8)
    elen = _pack_extra(u, tokens, ebuf)
    lens = struct.pack("<II", buf.shape[0] - start, elen)
    return b"".join((head[:hlen], lens, buf[start:], ebuf[:elen]))


@dataclass
class Stream:
    """A parsed stream: its frequency tables (and decoding lookup) and its two payloads."""

    scale_bits: int
    lanes: int  # interleaved rANS states, 1..MAX_LANES
    freq: np.ndarray  # (n_ctx, 256) uint32
    cum: np.ndarray
    lookup: np.ndarray  # (n_ctx, 2^scale_bits) uint8: slot -> symbol
    rans: np.ndarray  # uint8
    extra: np.ndarray  # uint8

    @property
    def n_ctx(self) -> int:
        return self.freq.shape[0]

    def padded(self) -> tuple[np.ndarray, int, np.ndarray, int]:
        """(rANS payload zero-padded, its length, extra payload as zero-padded uint64 words, its
        length in bytes): what the decoding kernels read."""
        return pad_bytes(self.rans), self.rans.shape[0], pad_words(self.extra), self.extra.shape[0]

    def kernel_args(self) -> tuple:
        """Everything a decoding kernel takes, in the order `_decode_values` takes it."""
        return (*self.padded(), self.freq, self.cum, self.lookup, self.scale_bits, self.lanes)


def pad_bytes(data: np.ndarray) -> np.ndarray:
    out = np.zeros(data.shape[0] + PAD_BYTES, dtype=np.uint8)
    out[: data.shape[0]] = data
    return out


def pad_words(data: np.ndarray) -> np.ndarray:
    out = np.zeros((data.shape[0] + 7) // 8 * 8 + PAD_BYTES, dtype=np.uint8)
    out[: data.shape[0]] = data
    return out.view(np.uint64)


@numba.njit(cache=True, nogil=True)
def _read_tables(buf, scale_bits, freq):  # pragma: no cover - compiled
    """Read freq's tables from buf[2:]: the offset after them, or -1 (truncated), -2 (bad size),
    -3 (repeated symbol, zero frequency, or not summing to 2^scale_bits)."""
    p = 2
    for c in range(freq.shape[0]):
        if p + 2 > buf.shape[0]:
            return -1
        n_used = int(buf[p]) | int(buf[p + 1]) << 8
        p += 2
        if n_used > 256 or p + 3 * n_used > buf.shape[0]:
            return -2
        total = 0
        for _ in range(n_used):
            s, f = buf[p], int(buf[p + 1]) | int(buf[p + 2]) << 8
            p += 3
            if f == 0 or freq[c, s] != 0:
                return -3
            freq[c, s] = f
            total += f
        if n_used and total != 1 << scale_bits:
            return -3
    return p


def parse(data: bytes | memoryview | np.ndarray, k: int) -> Stream:
    """Read a stream's tables and locate its payloads; checks everything but the payloads
    themselves. Raises StreamError."""
    buf = np.frombuffer(data, dtype=np.uint8)
    if buf.size < 2:
        raise StreamError("stream too short")
    scale_bits, lanes, n_ctx = int(buf[0]) & 15, (int(buf[0]) >> 4) + 1, int(buf[1])
    if (not 1 <= scale_bits <= MAX_SCALE_BITS or not 1 <= n_ctx <= MAX_CONTEXTS
            or lanes > MAX_LANES):
        raise StreamError("bad stream parameters")
    freq = np.zeros((n_ctx, 256), dtype=np.uint32)
    p = _read_tables(buf, scale_bits, freq)
    if p < 0:
        raise StreamError(("truncated frequency table", "bad frequency table",
                           "frequency table does not sum to 2^scale")[-p - 1])
    if p + 8 > buf.size:
        raise StreamError("truncated stream header")
    rans_len, extra_len = struct.unpack_from("<II", buf, p)
    p += 8
    if p + rans_len + extra_len != buf.size:
        raise StreamError("stream length mismatch")
    if rans_len + extra_len < min_stream_bytes(k):
        raise StreamError(f"{buf.size} bytes cannot hold {k} values (over the format's "
                          "expansion limit: a decompression bomb?)")
    cum = np.empty_like(freq)
    tables(freq, scale_bits, cum, np.empty(2 + n_ctx * 770, dtype=np.uint8))
    lookup = np.empty((n_ctx, 1 << scale_bits), dtype=np.uint8)
    build_lookup(freq, cum, scale_bits, lookup)
    return Stream(scale_bits, lanes, freq, cum, lookup, buf[p : p + rans_len],
                  buf[p + rans_len :])


def decode(data: bytes | memoryview, k: int, ctx: np.ndarray | None = None) -> np.ndarray:
    """Decode k uint64 values; contexts must be those given to `encode`. Raises StreamError."""
    st = parse(data, k)
    ctx = np.zeros(k, dtype=np.uint8) if ctx is None else np.ascontiguousarray(ctx, np.uint8)
    if ctx.shape[0] != k or (k and int(ctx.max()) >= st.n_ctx):
        raise StreamError("context out of range")
    out = np.empty(k, dtype=np.uint64)
    check(_decode_values(*st.kernel_args(), ctx, out))
    return out


def code_tokens(
    tokens: np.ndarray, ctx: np.ndarray, freq: np.ndarray, lanes: int | None = None
) -> bytes:
    """The rANS part of a stream alone: tokens (uint8) under contexts and frequency tables
    (n_ctx, 256) summing to 2^SCALE_BITS, with `encode`'s lanes unless given. For comparisons
    with other coders (benchmarks)."""
    lanes = lanes_for(tokens.shape[0]) if lanes is None else lanes
    freq = np.ascontiguousarray(freq, np.uint32)
    cum = np.empty_like(freq)
    tables(freq, SCALE_BITS, cum, np.empty(2 + freq.shape[0] * 770, dtype=np.uint8))
    buf = np.empty(4 * lanes + 2 * tokens.shape[0] + 16, dtype=np.uint8)
    start = encode_kernel(tokens, np.ascontiguousarray(ctx, np.uint8), freq, cum, SCALE_BITS, lanes,
                         buf)
    return buf[start:].tobytes()


def decode_tokens(
    data: bytes, ctx: np.ndarray, freq: np.ndarray, lanes: int | None = None
) -> np.ndarray:
    """Inverse of code_tokens. Raises StreamError."""
    lanes = lanes_for(ctx.shape[0]) if lanes is None else lanes
    freq = np.ascontiguousarray(freq, np.uint32)
    cum = np.empty_like(freq)
    tables(freq, SCALE_BITS, cum, np.empty(2 + freq.shape[0] * 770, dtype=np.uint8))
    lookup = np.zeros((freq.shape[0], 1 << SCALE_BITS), dtype=np.uint8)
    build_lookup(freq, cum, SCALE_BITS, lookup)
    out = np.empty(ctx.shape[0], dtype=np.uint8)
    check(decode_kernel(pad_bytes(np.frombuffer(data, np.uint8)), len(data),
                       np.ascontiguousarray(ctx, np.uint8), freq, cum, lookup, SCALE_BITS, lanes,
                       out))
    return out


def check(status: int) -> None:
    """Raise the StreamError a kernel's negative status stands for."""
    if status == -1:
        raise StreamError("corrupt entropy-coded stream")
    if status == -2:
        raise StreamError("corrupt extra bits")
