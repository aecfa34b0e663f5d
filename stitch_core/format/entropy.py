"""Entropy coding of integer streams: tokens + static rANS + raw extra bits (see docs/format.md).

An unsigned 64-bit value u becomes a token (0..255) and `extra` raw bits:
  u < 16:  token = u, no extra bits
  else:    nb = floor(log2 u) (4..63); token = 16 + 4*(nb-4) + ((u >> (nb-2)) & 3);
           extra = the low nb-2 bits of u
Tokens are coded with a static rANS coder (32-bit state, byte-wise renormalisation, L = 2^23) under
per-context frequency tables stored in the stream; extra bits are packed LSB-first. The hot loops
are small numba kernels; everything around them is vectorised numpy.

Size: about 600 lines, one job: the stream format. The decoder's per-token steps (`rans_step`,
`extra_step`) are public numba functions that codec's fused apply pass inlines, so a stream is
defined, encoded and decoded in one place. They are branch-free where a branch would follow the
data (renormalisation, extra-bit reads), which made decoding ~3x faster than byte-by-byte loops
(benchmarks/codec.py); the bytes on the wire are the same.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

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


@numba.njit(cache=True, nogil=True)
def _rans_encode(tokens, ctx, freq, cum, scale_bits, out):  # pragma: no cover - compiled
    """Encode in reverse into the tail of `out`; returns the start index of the stream.

    x // f and x % f through a per-symbol reciprocal (ryg_rans' exact scheme for 32-bit states):
    x' = x + bias + mulhi32(x, rcp) >> shift * (2^scale - f), the same state as
    ((x // f) << scale) + x % f + cum, without a division per token."""
    nc = freq.shape[0]
    rcp = np.zeros((nc, 256), dtype=np.uint64)
    rsh = np.zeros((nc, 256), dtype=np.uint64)
    bias = np.zeros((nc, 256), dtype=np.uint64)
    xmax = np.zeros((nc, 256), dtype=np.uint64)
    m = np.uint64(1) << np.uint64(scale_bits)
    for c in range(nc):
        for s in range(256):
            f = np.uint64(freq[c, s])
            xmax[c, s] = np.uint64((RANS_L >> scale_bits) << 8) * f
            if f < 2:
                rcp[c, s] = np.uint64(0xFFFFFFFF)
                bias[c, s] = np.uint64(cum[c, s]) + m - np.uint64(1)
            else:
                sh = 0
                while f > (np.uint64(1) << np.uint64(sh)):
                    sh += 1
                rcp[c, s] = ((np.uint64(1) << np.uint64(sh + 31)) + f - np.uint64(1)) // f
                rsh[c, s] = np.uint64(sh - 1)
                bias[c, s] = np.uint64(cum[c, s])
    p = out.shape[0]
    x = np.uint64(RANS_L)
    for i in range(tokens.shape[0] - 1, -1, -1):
        c = ctx[i]
        s = tokens[i]
        x_max = xmax[c, s]
        while x >= x_max:
            p -= 1
            out[p] = np.uint8(x & np.uint64(0xFF))
            x >>= np.uint64(8)
        q = ((x * rcp[c, s]) >> np.uint64(32)) >> rsh[c, s]
        x = x + bias[c, s] + q * (m - np.uint64(freq[c, s]))
    for _ in range(4):
        p -= 1
        out[p] = np.uint8((x >> np.uint64(24)) & np.uint64(0xFF))
        x = (x << np.uint64(8)) & np.uint64(0xFFFFFFFF)
    return p


# Decoding is branch-free where the branch would follow the data: a token's renormalisation reads
# 0, 1 or 2 bytes by arithmetic, and its extra bits come from a 64-bit window over the extra
# payload (as uint64 words) through two per-token tables. Both payloads are padded with zeros so
# that a step may read past the end; the callers check the read positions after each step (a
# branch that valid streams never take) and stop a malformed stream there.
PAD_BYTES = 16


@numba.njit(cache=True, nogil=True, inline="always")
def rans_step(data, p, x, c, freq, cum, lookup, mask, scale_bits):  # pragma: no cover
    """One decoded token: (symbol, new state, new read position). Reads up to two bytes at
    data[p:] whether it needs them or not (data is padded); the caller checks p <= payload
    length, which also catches a slot no symbol owns (an empty context's table): that step
    returns a read position past any payload."""
    slot = x & mask
    s = lookup[c, slot]
    f = np.uint64(freq[c, s])
    if f == 0:
        return s, x, np.int64(1 << 62)
    x = f * (x >> np.uint64(scale_bits)) + slot - np.uint64(cum[c, s])
    # x >= 2^(23 - scale_bits) >= 2^8 after a step with f >= 1: two bytes always renormalise
    b = np.uint64(x < np.uint64(RANS_L))
    x = (x << (b * np.uint64(8))) | (np.uint64(data[p]) * b)
    p += np.int64(b)
    b = np.uint64(x < np.uint64(RANS_L))
    x = (x << (b * np.uint64(8))) | (np.uint64(data[p]) * b)
    p += np.int64(b)
    return s, x, p


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
def rans_state(data, n):  # pragma: no cover - compiled
    """The initial state from a payload of n bytes, or 0 if it cannot be one the encoder wrote
    (under 4 bytes, or outside [RANS_L, 256 RANS_L)); a 0 state fails the end check."""
    if n < 4:
        return np.uint64(0)
    x = (np.uint64(data[0]) | (np.uint64(data[1]) << np.uint64(8))
         | (np.uint64(data[2]) << np.uint64(16)) | (np.uint64(data[3]) << np.uint64(24)))
    if x < np.uint64(RANS_L) or x >= np.uint64(RANS_L << 8):
        return np.uint64(0)
    return x


@numba.njit(cache=True, nogil=True, inline="always")
def rans_done(x, p, n):  # pragma: no cover - compiled
    """The rANS payload (n bytes) ended exactly where the encoder began."""
    return x == np.uint64(RANS_L) and p == n


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
def _decode_values(rans, n_rans, words, n_extra, ctx, freq, cum, lookup, scale_bits,
                   out):  # pragma: no cover - compiled
    """Tokens and extra bits in one pass into values: 0, or -1 (rANS) / -2 (extra bits) if the
    stream is malformed or not consumed exactly. rans/words: padded payloads (`Stream.padded`)."""
    x = rans_state(rans, n_rans)
    if x == 0:
        return -1
    p, bp = 4, np.uint64(0)
    lim = np.uint64(8 * n_extra)
    mask = np.uint64((1 << scale_bits) - 1)
    for i in range(out.shape[0]):
        s, x, p = rans_step(rans, p, x, ctx[i], freq, cum, lookup, mask, scale_bits)
        if p > n_rans:
            return -1
        out[i], bp = extra_step(words, bp, s)
        if bp > lim:
            return -2
    if not rans_done(x, p, n_rans):
        return -1
    if not extra_done(words, bp, n_extra):
        return -2
    return 0


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


@numba.njit(cache=True, nogil=True)
def _tables(freq, scale_bits, cum, head):  # pragma: no cover - compiled
    """cum from freq, and the stream's table header (scale, n_ctx, per context: u16 count of
    used symbols, then (u8 symbol, u16 frequency) each) into head; its length."""
    head[0], head[1] = scale_bits, freq.shape[0]
    h = 2
    for c in range(freq.shape[0]):
        n = 0
        acc = 0
        for s in range(256):
            cum[c, s] = acc
            acc += freq[c, s]
            n += freq[c, s] > 0
        head[h], head[h + 1] = n & 0xFF, n >> 8
        h += 2
        for s in range(256):
            f = freq[c, s]
            if f:
                head[h], head[h + 1], head[h + 2] = s, f & 0xFF, f >> 8
                h += 3
    return h


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


def encode(u: np.ndarray, ctx: np.ndarray | None = None, n_ctx: int = 1) -> bytes:
    """Encode uint64 values under optional contexts (uint8, < n_ctx) into one stream."""
    if not 1 <= n_ctx <= MAX_CONTEXTS:
        raise ValueError("n_ctx out of range")
    u = np.ascontiguousarray(u, dtype=np.uint64)
    k = u.shape[0]
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
    hlen = _tables(freq, SCALE_BITS, cum, head)
    buf = np.empty(4 + 2 * k + 16, dtype=np.uint8)  # rANS emits < 2 bytes per 8-bit token
    start = _rans_encode(tokens, ctx, freq, cum, SCALE_BITS, buf)
    ebuf = np.empty((extra_bits + 7) // 8 + 8, dtype=np.uint8)
    elen = _pack_extra(u, tokens, ebuf)
    lens = struct.pack("<II", buf.shape[0] - start, elen)
    return b"".join((head[:hlen], lens, buf[start:], ebuf[:elen]))


@dataclass
class Stream:
    """A parsed stream: its frequency tables (and decoding lookup) and its two payloads."""

    scale_bits: int
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
        return (*self.padded(), self.freq, self.cum, self.lookup, self.scale_bits)


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
    scale_bits, n_ctx = int(buf[0]), int(buf[1])
    if not 1 <= scale_bits <= MAX_SCALE_BITS or not 1 <= n_ctx <= MAX_CONTEXTS:
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
    _tables(freq, scale_bits, cum, np.empty(2 + n_ctx * 770, dtype=np.uint8))
    lookup = np.empty((n_ctx, 1 << scale_bits), dtype=np.uint8)
    _build_lookup(freq, cum, scale_bits, lookup)
    return Stream(scale_bits, freq, cum, lookup, buf[p : p + rans_len], buf[p + rans_len :])


def decode(data: bytes | memoryview, k: int, ctx: np.ndarray | None = None) -> np.ndarray:
    """Decode k uint64 values; contexts must be those given to `encode`. Raises StreamError."""
    st = parse(data, k)
    ctx = np.zeros(k, dtype=np.uint8) if ctx is None else np.ascontiguousarray(ctx, np.uint8)
    if ctx.shape[0] != k or (k and int(ctx.max()) >= st.n_ctx):
        raise StreamError("context out of range")
    out = np.empty(k, dtype=np.uint64)
    rans, n_rans, words, n_extra = st.padded()
    check(_decode_values(rans, n_rans, words, n_extra, ctx, st.freq, st.cum, st.lookup,
                         st.scale_bits, out))
    return out


@numba.njit(cache=True, nogil=True)
def _rans_tokens(data, n, ctx, freq, cum, lookup, scale_bits, out):  # pragma: no cover - compiled
    x, p = rans_state(data, n), 4
    if x == 0:
        return -1
    mask = np.uint64((1 << scale_bits) - 1)
    for i in range(out.shape[0]):
        out[i], x, p = rans_step(data, p, x, ctx[i], freq, cum, lookup, mask, scale_bits)
        if p > n:
            return -1
    return 0 if rans_done(x, p, n) else -1


def code_tokens(tokens: np.ndarray, ctx: np.ndarray, freq: np.ndarray) -> bytes:
    """The rANS part of a stream alone: tokens (uint8) under contexts and frequency tables
    (n_ctx, 256) summing to 2^SCALE_BITS. For comparisons with other coders (benchmarks)."""
    freq = np.ascontiguousarray(freq, np.uint32)
    cum = np.empty_like(freq)
    _tables(freq, SCALE_BITS, cum, np.empty(2 + freq.shape[0] * 770, dtype=np.uint8))
    buf = np.empty(4 + 2 * tokens.shape[0] + 16, dtype=np.uint8)
    start = _rans_encode(tokens, np.ascontiguousarray(ctx, np.uint8), freq, cum, SCALE_BITS, buf)
    return buf[start:].tobytes()


def decode_tokens(data: bytes, ctx: np.ndarray, freq: np.ndarray) -> np.ndarray:
    """Inverse of code_tokens. Raises StreamError."""
    freq = np.ascontiguousarray(freq, np.uint32)
    cum = np.empty_like(freq)
    _tables(freq, SCALE_BITS, cum, np.empty(2 + freq.shape[0] * 770, dtype=np.uint8))
    lookup = np.zeros((freq.shape[0], 1 << SCALE_BITS), dtype=np.uint8)
    _build_lookup(freq, cum, SCALE_BITS, lookup)
    out = np.empty(ctx.shape[0], dtype=np.uint8)
    check(_rans_tokens(pad_bytes(np.frombuffer(data, np.uint8)), len(data),
                       np.ascontiguousarray(ctx, np.uint8), freq, cum, lookup, SCALE_BITS, out))
    return out


def check(status: int) -> None:
    """Raise the StreamError a kernel's negative status stands for."""
    if status == -1:
        raise StreamError("corrupt entropy-coded stream")
    if status == -2:
        raise StreamError("corrupt extra bits")
