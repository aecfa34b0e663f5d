"""Static rANS over byte tokens with up to four interleaved states ("lanes"): the coder kernels
of an integer stream (docs/format.md section 4). `entropy` owns the stream around them (tokens,
extra bits, tables on the wire, checks); this module only turns tokens into bytes and back.

Token j is coded by lane j mod W on one shared byte stream. The lanes' dependency chains (table
lookups, a multiply, renormalisation) are independent, so an out-of-order CPU overlaps them: four
lanes decode about 2.3x faster than one (benchmarks/codec.py). Decoding kernels take a window
(x0, x1, x2, x3): a token decodes from x0, then `rotate` moves the next lane there, so one loop
body serves every lane count.
"""

from __future__ import annotations

import numpy as np

from stitch_core._jit import numba

RANS_L = 1 << 23
MAX_LANES = 4

# Decoding is branch-free where the branch would follow the data: a token's renormalisation reads
# 0, 1 or 2 bytes by arithmetic, and its extra bits come from a 64-bit window over the extra
# payload (as uint64 words) through two per-token tables. Both payloads are padded with zeros so
# that a step may read past the end; the callers check the read positions after each step (a
# branch that valid streams never take) and stop a malformed stream there.
PAD_BYTES = 16


@numba.njit(cache=True, nogil=True)
def encode_kernel(tokens, ctx, freq, cum, scale_bits, lanes, out):  # pragma: no cover - compiled
    """Encode in reverse into the tail of `out` with `lanes` interleaved states (token i on lane
    i mod lanes); returns the start index of the stream.

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
    xs = np.full(lanes, RANS_L, dtype=np.uint64)
    for i in range(tokens.shape[0] - 1, -1, -1):
        c = ctx[i]
        s = tokens[i]
        lane = i % lanes
        x = xs[lane]
        x_max = xmax[c, s]
        while x >= x_max:
            p -= 1
            out[p] = np.uint8(x & np.uint64(0xFF))
            x >>= np.uint64(8)
        q = ((x * rcp[c, s]) >> np.uint64(32)) >> rsh[c, s]
        xs[lane] = x + bias[c, s] + q * (m - np.uint64(freq[c, s]))
    for lane in range(lanes - 1, -1, -1):  # lane 0's state ends up first
        x = xs[lane]
        for _ in range(4):
            p -= 1
            out[p] = np.uint8((x >> np.uint64(24)) & np.uint64(0xFF))
            x = (x << np.uint64(8)) & np.uint64(0xFFFFFFFF)
    return p


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
def _state_at(data, p):  # pragma: no cover - compiled
    """The u32 LE state at data[p:], or 0 if it cannot be one the encoder wrote (outside
    [RANS_L, 256 RANS_L))."""
    x = (np.uint64(data[p]) | (np.uint64(data[p + 1]) << np.uint64(8))
         | (np.uint64(data[p + 2]) << np.uint64(16)) | (np.uint64(data[p + 3]) << np.uint64(24)))
    if x < np.uint64(RANS_L) or x >= np.uint64(RANS_L << 8):
        return np.uint64(0)
    return x


@numba.njit(cache=True, nogil=True, inline="always")
def rans_states(data, n, lanes):  # pragma: no cover - compiled
    """(x0, x1, x2, x3, read position): the initial window of a payload of n bytes with `lanes`
    states (lanes past `lanes` hold RANS_L). x0 == 0 if the payload cannot hold them or one is
    not a state the encoder wrote; a 0 state fails the end check. Each token decodes from x0,
    then `rotate` moves the next lane there."""
    one = np.uint64(RANS_L)
    if n < 4 * lanes:
        return np.uint64(0), one, one, one, 0
    x0 = _state_at(data, 0)
    x1 = _state_at(data, 4) if lanes > 1 else one
    x2 = _state_at(data, 8) if lanes > 2 else one
    x3 = _state_at(data, 12) if lanes > 3 else one
    if x1 == 0 or x2 == 0 or x3 == 0:
        x0 = np.uint64(0)
    return x0, x1, x2, x3, 4 * lanes


@numba.njit(cache=True, nogil=True, inline="always")
def rotate(x1, x2, x3, xn, lanes):  # pragma: no cover - compiled
    """The window after a token decoded from x0 left the state xn (a branch on `lanes`, the
    same for every token of a stream)."""
    if lanes == 1:
        return xn, x1, x2, x3
    if lanes == 2:
        return x1, xn, x2, x3
    if lanes == 3:
        return x1, x2, xn, x3
    return x1, x2, x3, xn


@numba.njit(cache=True, nogil=True, inline="always")
def rans_done(x0, x1, x2, x3, p, n):  # pragma: no cover - compiled
    """The rANS payload (n bytes) ended exactly where the encoder began, on every lane."""
    one = np.uint64(RANS_L)
    return x0 == one and x1 == one and x2 == one and x3 == one and p == n


@numba.njit(cache=True, nogil=True)
def build_lookup(freq, cum, scale_bits, lookup):  # pragma: no cover - compiled
    for c in range(freq.shape[0]):
        for s in range(256):
            f = freq[c, s]
            if f:
                b = cum[c, s]
                for j in range(b, b + f):
                    lookup[c, j] = s


@numba.njit(cache=True, nogil=True)
def tables(freq, scale_bits, cum, head):  # pragma: no cover - compiled
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


@numba.njit(cache=True, nogil=True)
def decode_kernel(data, n, ctx, freq, cum, lookup, scale_bits, lanes,
                 out):  # pragma: no cover - compiled
    x0, x1, x2, x3, p = rans_states(data, n, lanes)
    if x0 == 0:
        return -1
    mask = np.uint64((1 << scale_bits) - 1)
    for i in range(out.shape[0]):
        out[i], xn, p = rans_step(data, p, x0, ctx[i], freq, cum, lookup, mask, scale_bits)
        x0, x1, x2, x3 = rotate(x1, x2, x3, xn, lanes)
        if p > n:
            return -1
    return 0 if rans_done(x0, x1, x2, x3, p, n) else -1
