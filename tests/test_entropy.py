"""Entropy streams (stitch_core.format.entropy): exact round trips, compression, malformed input."""

from __future__ import annotations

import struct
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stitch_core.format import entropy, rans
from stitch_core.format.entropy import MAX_CONTEXTS, StreamError, decode, encode

U64_MAX = (1 << 64) - 1
HYP = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def u64(values) -> np.ndarray:
    return np.array(values, dtype=np.uint64)


def roundtrip(u: np.ndarray, ctx: np.ndarray | None = None, n_ctx: int = 1) -> bytes:
    s = encode(u, ctx, n_ctx)
    assert isinstance(s, bytes)
    out = decode(s, u.shape[0], ctx)
    assert out.dtype == np.uint64
    assert out.shape == u.shape
    np.testing.assert_array_equal(out, u)
    return s


def ref_token(v: int) -> tuple[int, int, int]:
    """The token scheme of the module docstring, in plain Python."""
    if v < 16:
        return v, 0, 0
    nb = v.bit_length() - 1
    return 16 + 4 * (nb - 4) + ((v >> (nb - 2)) & 3), v & ((1 << (nb - 2)) - 1), nb - 2


def boundary_values() -> list[int]:
    vals = {0, 1, 2, 3, 15, 16, 17, 18, 19, 20, 31, 32, 33, 1 << 63, U64_MAX, U64_MAX - 1}
    for k in range(1, 64):
        vals |= {(1 << k) - 1, 1 << k, (1 << k) + 1, (1 << k) | (1 << (k - 1))}
    vals.add((1 << 64) - (1 << 62))
    return sorted(v for v in vals if v <= U64_MAX)


# ---------------------------------------------------------------- tokens


def test_tokenize_matches_reference_on_boundaries():
    vals = boundary_values()
    tok, extra, nextra = entropy.tokenize(u64(vals))
    for v, t, e, n in zip(vals, tok.tolist(), extra.tolist(), nextra.tolist(), strict=True):
        assert (t, e, n) == ref_token(v), v
    assert int(tok.max()) == 255  # 2^64-1 uses the last token
    np.testing.assert_array_equal(entropy.token_extra_bits(tok), nextra)
    np.testing.assert_array_equal(entropy.detokenize(tok, extra), u64(vals))


@HYP
@given(st.lists(st.integers(0, U64_MAX), max_size=50))
def test_tokenize_matches_reference_property(vals):
    tok, extra, nextra = entropy.tokenize(u64(vals))
    got = list(zip(tok.tolist(), extra.tolist(), nextra.tolist(), strict=True))
    assert got == [ref_token(v) for v in vals]


# ---------------------------------------------------------------- round trips


def test_empty():
    s = roundtrip(u64([]))
    assert decode(s, 0).shape == (0,)


@pytest.mark.parametrize("v", [0, 1, 15, 16, 17, 255, 256, 1 << 32, 1 << 63, U64_MAX])
def test_single_value(v):
    roundtrip(u64([v]))


@pytest.mark.parametrize("k", [1, 2, 4, 5, 8, 16, 31, 32, 33, 48, 62, 63])
def test_powers_of_two(k):
    roundtrip(u64([(1 << k) - 1, 1 << k, (1 << k) + 1] * 3))


def test_all_boundary_values_together_and_repeated():
    vals = boundary_values()
    roundtrip(u64(vals))
    roundtrip(u64(vals[::-1] * 7))


def test_single_symbol_streams():
    for v in (0, 7, 16, 1 << 40, U64_MAX):
        roundtrip(np.full(1000, v, dtype=np.uint64))


@pytest.mark.parametrize("p", [0.9, 0.5, 0.05, 0.001])
def test_geometric_round_trip(p):
    rng = np.random.default_rng(int(p * 1000))
    roundtrip((rng.geometric(p, 20_000) - 1).astype(np.uint64))


def test_uniform_full_width_round_trip():
    rng = np.random.default_rng(1)
    u = rng.integers(0, U64_MAX, size=10_000, dtype=np.uint64, endpoint=True)
    s = roundtrip(u)
    # incompressible: close to 64 bits a value, never hugely more
    assert len(s) <= 8 * u.size * 1.01 + 1024


@pytest.mark.parametrize("bits", [8, 16, 32])
def test_uniform_narrow_round_trip(bits):
    rng = np.random.default_rng(bits)
    u = rng.integers(0, 1 << bits, size=5000, dtype=np.uint64)
    s = roundtrip(u)
    assert len(s) <= bits * u.size / 8 * 1.03 + 1024


@pytest.mark.parametrize("n_ctx", [1, 2, 7, MAX_CONTEXTS])
def test_contexts_round_trip(n_ctx):
    rng = np.random.default_rng(n_ctx)
    ctx = rng.integers(0, n_ctx, size=8000).astype(np.uint8)
    # each context has its own distribution
    u = (rng.geometric(1.0 / (2.0 + ctx.astype(np.float64) * 3), ctx.size) - 1).astype(np.uint64)
    roundtrip(u, ctx, n_ctx)


def test_contexts_help_when_values_depend_on_context():
    rng = np.random.default_rng(3)
    ctx = rng.integers(0, 4, size=20_000).astype(np.uint8)
    # 8 equally likely tokens overall (3 bits), but only 2 per context (1 bit)
    u = (2 * ctx.astype(np.int64) + rng.integers(0, 2, ctx.size)).astype(np.uint64)
    with_ctx = roundtrip(u, ctx, 4)
    without = roundtrip(u)
    assert len(with_ctx) < 0.4 * len(without)


def test_unused_contexts_round_trip():
    ctx = np.full(100, 5, dtype=np.uint8)  # contexts 0..4 and 6..9 never used
    roundtrip(np.arange(100, dtype=np.uint64) * 3, ctx, 10)


@HYP
@given(st.lists(st.integers(0, U64_MAX), max_size=300))
def test_round_trip_property(vals):
    roundtrip(u64(vals))


@st.composite
def values_with_contexts(draw):
    n_ctx = draw(st.integers(1, MAX_CONTEXTS))
    k = draw(st.integers(0, 200))
    ctx = draw(st.lists(st.integers(0, n_ctx - 1), min_size=k, max_size=k))
    small = st.integers(0, 40)
    vals = draw(st.lists(st.one_of(small, st.integers(0, U64_MAX)), min_size=k, max_size=k))
    return u64(vals), np.array(ctx, dtype=np.uint8), n_ctx


@HYP
@given(values_with_contexts())
def test_round_trip_with_contexts_property(case):
    u, ctx, n_ctx = case
    roundtrip(u, ctx, n_ctx)


def test_encode_rejects_bad_n_ctx():
    for n in (0, MAX_CONTEXTS + 1):
        with pytest.raises(ValueError):
            encode(u64([1, 2]), None, n)


# ---------------------------------------------------------------- size


@pytest.mark.parametrize("p", [0.5, 0.3, 0.1, 0.02])
def test_size_near_empirical_entropy_geometric(p):
    rng = np.random.default_rng(7)
    n = 100_000
    u = (rng.geometric(p, n) - 1).astype(np.uint64)
    s = encode(u)
    _, counts = np.unique(u, return_counts=True)
    h_bits = float(-(counts * np.log2(counts / n)).sum())
    table = 8 * (2 + 2 + 3 * 256 + 8 + 4)  # header, one table, lengths, rANS flush
    assert 8 * len(s) <= 1.02 * h_bits + table
    assert 8 * len(s) >= h_bits  # sanity: no coder beats the empirical entropy


def test_cost_estimate_tracks_real_size():
    rng = np.random.default_rng(11)
    u = (rng.geometric(0.05, 50_000) - 1).astype(np.uint64)
    tok = entropy.tokenize(u)[0]
    est = entropy.cost_bits(tok, np.zeros_like(tok), 1)
    real = 8 * len(encode(u))
    assert abs(real - est) <= 0.02 * real + 512


# ---------------------------------------------------------------- malformed streams


def sample_stream(n: int = 500, seed: int = 0) -> tuple[np.ndarray, bytes]:
    rng = np.random.default_rng(seed)
    u = np.concatenate(
        [(rng.geometric(0.2, n) - 1), rng.integers(1 << 20, 1 << 40, n // 10)]
    ).astype(np.uint64)
    return u, encode(u)


def decode_or_stream_error(data: bytes, k: int, ctx=None) -> np.ndarray | None:
    """Decode; only StreamError may come out. Returns None on StreamError."""
    try:
        out = decode(data, k, ctx)
    except StreamError:
        return None
    assert out.dtype == np.uint64 and out.shape == (k,)
    return out


def test_stream_error_is_value_error():
    assert issubclass(StreamError, ValueError)


def test_every_truncation_is_rejected():
    u, s = sample_stream(120)
    for cut in range(len(s)):
        with pytest.raises(StreamError):
            decode(s[:cut], u.size)


def test_appended_bytes_are_rejected():
    u, s = sample_stream(120)
    for extra in (b"\x00", b"\xff" * 3):
        with pytest.raises(StreamError):
            decode(s + extra, u.size)


def test_wrong_k_is_rejected():
    u, s = sample_stream(300)
    assert np.unique(entropy.tokenize(u)[0]).size > 1  # not a single-symbol stream
    for k in (0, 1, u.size - 2, u.size - 1, u.size + 1, u.size + 2, 2 * u.size):
        with pytest.raises(StreamError):
            decode(s, k)


def test_bad_parameters_are_rejected():
    u, s = sample_stream(50)
    for scale_bits, n_ctx in ((0, 1), (16, 1), (255, 1), (14, 0), (14, MAX_CONTEXTS + 1)):
        with pytest.raises(StreamError):
            decode(struct.pack("<BB", scale_bits, n_ctx) + s[2:], u.size)
    for short in (b"", b"\x0e"):
        with pytest.raises(StreamError):
            decode(short, 0)


def test_bad_frequency_tables_are_rejected():
    u, s = sample_stream(50)
    n_used = s[2] | s[3] << 8
    assert n_used >= 2
    first = 4  # first record: u8 symbol, u16 frequency
    # frequencies no longer sum to 2^scale
    bad = bytearray(s)
    bad[first + 1] ^= 1
    with pytest.raises(StreamError):
        decode(bytes(bad), u.size)
    # duplicate symbol
    bad = bytearray(s)
    bad[first + 3] = bad[first]
    with pytest.raises(StreamError):
        decode(bytes(bad), u.size)
    # more than 256 symbols
    bad = bytearray(s)
    bad[2:4] = struct.pack("<H", 257)
    with pytest.raises(StreamError):
        decode(bytes(bad), u.size)


def test_zero_frequency_entry_is_rejected():
    # a table listing a symbol with frequency 0 (and the rest summing to 2^14)
    tbl = struct.pack("<BB", 14, 1) + struct.pack("<H", 2) + struct.pack("<BHBH", 0, 1 << 14, 1, 0)
    with pytest.raises(StreamError):
        decode(tbl + struct.pack("<II", 4, 0) + struct.pack("<I", rans.RANS_L), 1)


def _payload_offsets(s: bytes, n_ctx: int = 1) -> tuple[int, int, int]:
    """(offset of the rANS payload, its length, extra payload length) of a stream."""
    p = 2
    for _ in range(n_ctx):
        p += 2 + 3 * (s[p] | s[p + 1] << 8)
    rans_len, extra_len = struct.unpack_from("<II", s, p)
    return p + 8, rans_len, extra_len


def test_initial_state_outside_the_encoders_range_is_rejected():
    # the decoder renormalises by at most two bytes a token, which holds only for states the
    # encoder can write: [RANS_L, 256 RANS_L)
    u, s = sample_stream(120)
    off, _, _ = _payload_offsets(s)
    assert rans.RANS_L <= struct.unpack_from("<I", s, off)[0] < rans.RANS_L << 8
    for x in (0, 1, rans.RANS_L - 1, rans.RANS_L << 8, (1 << 32) - 1):
        bad = bytearray(s)
        struct.pack_into("<I", bad, off, x)
        with pytest.raises(StreamError):
            decode(bytes(bad), u.size)


def test_a_context_with_no_table_is_rejected_when_used():
    u = np.arange(40, dtype=np.uint64) % 7
    s = encode(u, np.zeros(40, np.uint8), 2)  # context 1 has an empty table
    np.testing.assert_array_equal(decode(s, 40, np.zeros(40, np.uint8)), u)
    ctx = np.zeros(40, np.uint8)
    ctx[5] = 1
    with pytest.raises(StreamError):
        decode(s, 40, ctx)


def test_leftover_bits_in_the_last_extra_byte_are_rejected():
    u = u64([16, 3, 17])  # tokens 16, 3, 16: 2 + 0 + 2 extra bits, one byte with 4 bits unused
    s = encode(u)
    np.testing.assert_array_equal(decode(s, 3), u)
    _, _, extra_len = _payload_offsets(s)
    assert extra_len == 1
    for bit in range(4, 8):
        bad = bytearray(s)
        bad[-1] |= 1 << bit
        with pytest.raises(StreamError):
            decode(bytes(bad), 3)


def test_bad_context_vectors_are_rejected():
    rng = np.random.default_rng(5)
    ctx = rng.integers(0, 3, 400).astype(np.uint8)
    u = rng.integers(0, 50, 400).astype(np.uint64)
    s = encode(u, ctx, 3)
    np.testing.assert_array_equal(decode(s, u.size, ctx), u)
    bad = ctx.copy()
    bad[17] = 3  # == n_ctx
    with pytest.raises(StreamError):
        decode(s, u.size, bad)
    bad[17] = 255
    with pytest.raises(StreamError):
        decode(s, u.size, bad)
    with pytest.raises(StreamError):
        decode(s, u.size, ctx[:-1])  # wrong length
    with pytest.raises(StreamError):
        decode(s, u.size - 1, ctx)


def test_random_byte_flips_never_crash_or_hang():
    rng = np.random.default_rng(9)
    u, s = sample_stream(400, seed=2)
    t0 = time.monotonic()
    rejected = 0
    for _ in range(600):
        bad = bytearray(s)
        for _ in range(int(rng.integers(1, 4))):
            i = int(rng.integers(0, len(bad)))
            bad[i] ^= int(rng.integers(1, 256))
        out = decode_or_stream_error(bytes(bad), u.size)
        rejected += out is None
    assert time.monotonic() - t0 < 20
    assert rejected > 300  # most corruptions are caught by the stream's own checks


def test_random_garbage_never_crashes():
    rng = np.random.default_rng(10)
    for _ in range(300):
        n = int(rng.integers(0, 200))
        data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        if n >= 2 and rng.random() < 0.7:  # plausible parameters, random rest
            data = bytes([14, int(rng.integers(1, 4))]) + data[2:]
        k = int(rng.integers(0, 100))
        ctx = rng.integers(0, 3, k).astype(np.uint8) if rng.random() < 0.5 else None
        decode_or_stream_error(data, k, ctx)


@HYP
@given(st.binary(max_size=64), st.integers(0, 1000))
def test_arbitrary_bytes_property(data, k):
    decode_or_stream_error(data, k)


@pytest.mark.parametrize("n_ctx", [1, 3, 24])
def test_token_coding_alone_round_trips_and_matches_streams(n_ctx):
    """code_tokens/decode_tokens (the rANS part alone, for coder comparisons) round-trip, and
    code the same bytes as the rANS part of a whole stream."""
    rng = np.random.default_rng(n_ctx)
    u = rng.geometric(0.2, size=20000).astype(np.uint64)
    ctx = rng.integers(0, n_ctx, size=u.size).astype(np.uint8)
    tok = entropy.tokenize(u)[0]
    counts = np.bincount(ctx.astype(np.int64) * 256 + tok, minlength=n_ctx * 256)
    freq = np.stack([entropy.normalize(c) for c in counts.reshape(n_ctx, 256)])
    data = entropy.code_tokens(tok, ctx, freq)
    np.testing.assert_array_equal(entropy.decode_tokens(data, ctx, freq), tok)
    st = entropy.parse(encode(u, ctx, n_ctx), u.size)
    assert st.rans.tobytes() == data
    with pytest.raises(StreamError):
        entropy.decode_tokens(data[:-1], ctx, freq)


def test_normalize_caps_the_top_symbol_and_sums_exactly():
    for counts in ([10**9] + [0] * 255, [10**9] + [1] * 255, list(range(256)), [1] * 256):
        f = entropy.normalize(np.array(counts, dtype=np.int64))
        assert int(f.sum()) == 1 << entropy.SCALE_BITS
        assert ((f > 0) == (np.array(counts) > 0)).all() or (np.array(counts) == 0).any()
        assert int(f.max()) <= (1 << entropy.SCALE_BITS) - (1 << entropy.SCALE_BITS >> 6)


def test_repeated_symbol_in_a_table_is_rejected():
    s = bytearray(encode(u64([1, 2, 3, 1, 2, 3] * 50)))
    # first table: u16 count, then (u8 symbol, u16 freq) records; make record 2 repeat record 1
    assert s[2] | s[3] << 8 >= 2
    s[7] = s[4]
    with pytest.raises(StreamError, match="frequency table"):
        decode(bytes(s), 300)


# ---------------------------------------------------------------- interleaved rANS lanes


@pytest.mark.parametrize("lanes", [1, 2, 3, 4])
@pytest.mark.parametrize("k", [0, 1, 2, 3, 4, 5, 7, 64, 1001])
def test_lanes_round_trip(lanes, k):
    """Every lane count decodes every length, including fewer values than lanes; the count is
    in the stream's first byte (high nibble: lanes - 1)."""
    rng = np.random.default_rng(k * 7 + lanes)
    u = u64(rng.geometric(0.1, k))
    ctx = rng.integers(0, 3, k).astype(np.uint8)
    s = encode(u, ctx, 3, lanes=lanes)
    assert s[0] >> 4 == lanes - 1 and s[0] & 15 == entropy.SCALE_BITS
    np.testing.assert_array_equal(decode(s, k, ctx), u)
    assert entropy.parse(s, k).lanes == lanes


def test_encode_picks_lanes_by_length():
    short, long_ = entropy.LANE_MIN_VALUES - 1, entropy.LANE_MIN_VALUES
    assert encode(u64(np.ones(short, np.int64)))[0] >> 4 == 0
    assert encode(u64(np.ones(long_, np.int64)))[0] >> 4 == entropy.LANES - 1
    u = u64(np.random.default_rng(1).geometric(0.05, 5000))
    one, four = encode(u, lanes=1), encode(u, lanes=4)
    assert len(four) - len(one) <= 3 * 4 + 2  # three more states, rounding aside
    with pytest.raises(ValueError):
        encode(u, lanes=rans.MAX_LANES + 1)
    with pytest.raises(ValueError):
        encode(u, lanes=0)


def test_a_lane_count_over_the_maximum_is_rejected():
    u = u64(np.arange(600) % 9)
    s = bytearray(encode(u, lanes=4))
    for nibble in range(rans.MAX_LANES, 16):
        s[0] = (nibble << 4) | entropy.SCALE_BITS
        with pytest.raises(StreamError, match="parameters"):
            decode(bytes(s), u.size)


@pytest.mark.parametrize("lane", [0, 1, 2, 3])
def test_every_lanes_initial_state_is_checked(lane):
    u = u64(np.random.default_rng(2).geometric(0.2, 700))
    s = encode(u, lanes=4)
    off, _, _ = _payload_offsets(s)
    for x in (0, rans.RANS_L - 1, rans.RANS_L << 8):
        bad = bytearray(s)
        struct.pack_into("<I", bad, off + 4 * lane, x)
        with pytest.raises(StreamError):
            decode(bytes(bad), u.size)


def test_swapped_lane_states_and_a_wrong_lane_count_are_rejected():
    """Each lane must end where the encoder began: states in another order, or the stream read
    with another lane count, fail the end check (or decode garbage that fails it)."""
    u = u64(np.random.default_rng(3).geometric(0.1, 2000))
    s = encode(u, lanes=4)
    off, _, _ = _payload_offsets(s)
    bad = bytearray(s)
    bad[off:off + 4], bad[off + 4:off + 8] = s[off + 4:off + 8], s[off:off + 4]
    with pytest.raises(StreamError):
        decode(bytes(bad), u.size)
    for lanes in (1, 2, 3):
        bad = bytearray(s)
        bad[0] = ((lanes - 1) << 4) | (s[0] & 15)
        with pytest.raises(StreamError):
            decode(bytes(bad), u.size)


def test_a_payload_too_short_for_its_lanes_is_rejected():
    u = u64(np.zeros(1, np.int64))
    s = encode(u, lanes=1)  # 4 bytes of state for one value
    bad = bytearray(s)
    bad[0] = (3 << 4) | (s[0] & 15)  # claims 4 lanes: 16 bytes of state
    with pytest.raises(StreamError):
        decode(bytes(bad), 1)
