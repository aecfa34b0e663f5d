"""Fingerprints (stitch_core.format.fingerprint): both paths agree with an independent reference,
and the
sum is decomposable, incremental, position- and name-sensitive."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stitch_core._jit import SUM32_BLOCK
from stitch_core.format import dtypes
from stitch_core.format import fingerprint as fpr
from stitch_core.format.dtypes import INFOS

M32 = 0xFFFFFFFF
M64 = (1 << 64) - 1
HYP = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
INFO_IDS = [i.name for i in INFOS]


# ---------------------------------------------------------------- independent reference


def ref_mix(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x45D9F3B) & M32
    x ^= x >> 16
    x = (x * 0x45D9F3B) & M32
    return x ^ (x >> 16)


def ref_fp(name: str, t: torch.Tensor, offset: int = 0) -> int:
    """The formula of the module docstring, in plain Python over the raw bytes."""
    seed = zlib.crc32(name.encode()) & M32
    size = t.element_size()
    raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    total = 0
    for j in range(t.numel()):
        i = offset + j
        a = ref_mix((i & M32) ^ seed)
        if i >> 32:
            a ^= ref_mix((i >> 32) & M32)
        b = int.from_bytes(raw[j * size : (j + 1) * size], "little")
        if size == 8:
            b = (b & M32) ^ ref_mix(b >> 32)
        total += ref_mix(a ^ b)
    return total & M64


def random_tensor(info: dtypes.DTypeInfo, n: int, seed: int = 0) -> torch.Tensor:
    """Every bit pattern is possible (NaNs, infs, -0.0, subnormals); bool is 0/1."""
    g = torch.Generator().manual_seed(seed)
    if info.torch_dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    if info.itemsize == 8:  # two random 32-bit halves (randint cannot span int64)
        hi32 = torch.randint(-(1 << 31), 1 << 31, (n,), dtype=torch.int64, generator=g)
        lo32 = torch.randint(0, 1 << 32, (n,), dtype=torch.int64, generator=g)
        bits = (hi32 << 32) | lo32
    else:
        lo, hi = -(1 << (info.bits - 1)), 1 << (info.bits - 1)
        bits = torch.randint(lo, hi, (n,), dtype=torch.int64, generator=g).to(info.int_dtype)
    if info.is_float:
        specials = {
            torch.float32: [0x7FC00000, 0x7F800000, -0x00800000, -0x80000000, 0x7FC00001, 1],
            torch.float16: [0x7E00, 0x7C00, -0x0400, -0x8000, 0x7C01, 1],
            torch.bfloat16: [0x7FC0, 0x7F80, -0x0080, -0x8000, 0x7F81, 1],
            torch.float64: [0x7FF8 << 48, 0x7FF << 52, -(1 << 52), -(1 << 63), 1],
            torch.float8_e4m3fn: [0x7F, -1, -128, 1],
            torch.float8_e5m2: [0x7C, 0x7E, -4, -128, 1],
        }[info.torch_dtype]
        k = min(len(specials), n)
        bits[:k] = torch.tensor(specials[:k], dtype=torch.int64).to(info.int_dtype)
    return dtypes.from_int(bits, info.torch_dtype, (n,))


def torch_path(name: str, t: torch.Tensor, offset: int = 0) -> int:
    info = dtypes.info(t.dtype)
    return fpr.fingerprint_torch(dtypes.int_view(t), info.itemsize, fpr.seed_of(name), offset)


# ---------------------------------------------------------------- paths agree


def test_all_safetensors_dtypes_covered():
    names = {i.name for i in INFOS}
    assert {"BOOL", "U8", "I64", "F8_E4M3", "F8_E5M2", "BF16", "F16", "F32", "F64"} <= names


@pytest.mark.parametrize("info", INFOS, ids=INFO_IDS)
def test_numba_torch_and_reference_agree(info):
    t = random_tensor(info, 300, seed=1)
    f = fpr.fingerprint("model.layers.0.mlp.up_proj.weight", t)
    assert f == torch_path("model.layers.0.mlp.up_proj.weight", t)
    assert f == ref_fp("model.layers.0.mlp.up_proj.weight", t)
    assert 0 <= f <= M64


@pytest.mark.parametrize("info", INFOS, ids=INFO_IDS)
def test_paths_agree_on_a_large_tensor(info):
    t = random_tensor(info, 50_000, seed=2)
    assert fpr.fingerprint("w", t) == torch_path("w", t)


@pytest.mark.parametrize("info", INFOS, ids=INFO_IDS)
def test_paths_agree_across_torch_blocks(info, monkeypatch):
    monkeypatch.setattr(fpr, "_BLOCK", 7)  # many blocks, ragged last one
    t = random_tensor(info, 100, seed=3)
    assert fpr.fingerprint("w", t) == torch_path("w", t) == ref_fp("w", t)


@pytest.mark.parametrize("info", INFOS, ids=INFO_IDS)
def test_vector_path_agrees_across_its_blocks_and_up_to_2_32(info):
    # the CPU path sums blocks of SUM32_BLOCK elements in 32-bit lanes while every position is
    # below 2^32: several blocks with a ragged tail, starting at 0 and ending exactly at 2^32
    n = 2 * SUM32_BLOCK + 17
    t = random_tensor(info, n, seed=9)
    for offset in (0, 3, (1 << 32) - n, (1 << 32) - n + 1):
        assert fpr.fingerprint("w", t, offset=offset) == torch_path("w", t, offset), offset


def test_empty_and_scalar():
    assert fpr.fingerprint("x", torch.zeros(0)) == 0 == torch_path("x", torch.zeros(0, 5))
    s = torch.tensor(3.25, dtype=torch.bfloat16)
    assert fpr.fingerprint("x", s) == torch_path("x", s) == ref_fp("x", s.reshape(1))
    assert fpr.fingerprint("x", s) == fpr.fingerprint("x", s.reshape(1))


def test_layout_does_not_matter_values_order_does():
    t = torch.randn(6, 5)
    assert fpr.fingerprint("w", t.t()) == fpr.fingerprint("w", t.t().contiguous())
    assert fpr.fingerprint("w", t.t()) == torch_path("w", t.t())
    assert fpr.fingerprint("w", t.t()) != fpr.fingerprint("w", t)


@HYP
@given(
    st.sampled_from(INFOS),
    st.integers(0, 64),
    st.integers(0, 1 << 40),
    st.integers(0, 2**31),
)
def test_paths_agree_property(info, n, offset, seed):
    t = random_tensor(info, n, seed=seed)
    f = fpr.fingerprint("p", t, offset=offset)
    assert f == torch_path("p", t, offset) == ref_fp("p", t, offset)


# ---------------------------------------------------------------- positions >= 2^32


@pytest.mark.parametrize("info", INFOS, ids=INFO_IDS)
@pytest.mark.parametrize("offset", [(1 << 32) - 5, 1 << 32, (1 << 33) + 17, (1 << 40) - 3])
def test_high_positions(info, offset):
    t = random_tensor(info, 40, seed=4)
    f = fpr.fingerprint("w", t, offset=offset)
    assert f == torch_path("w", t, offset) == ref_fp("w", t, offset)


def test_high_position_term_matters():
    t = torch.randn(16)
    f0 = fpr.fingerprint("w", t)
    assert fpr.fingerprint("w", t, offset=1 << 32) != f0
    assert fpr.fingerprint("w", t, offset=1 << 33) != f0
    assert fpr.fingerprint("w", t, offset=1 << 32) != fpr.fingerprint("w", t, offset=1 << 33)


def test_decomposes_across_the_2_32_boundary():
    t = random_tensor(dtypes.info(torch.float32), 64, seed=5)
    base = (1 << 32) - 20
    whole = fpr.fingerprint("w", t, offset=base)
    for cut in (1, 19, 20, 21, 63):
        parts = fpr.fingerprint("w", t[:cut], offset=base) + torch_path("w", t[cut:], base + cut)
        assert parts & M64 == whole


# ---------------------------------------------------------------- decomposable


@pytest.mark.parametrize("info", INFOS, ids=INFO_IDS)
def test_decomposable_over_random_partitions(info):
    rng = np.random.default_rng(6)
    t = random_tensor(info, 5000, seed=6).reshape(50, 100)
    whole = fpr.fingerprint("w", t)
    flat = t.reshape(-1)
    for _ in range(5):
        cuts = sorted({0, flat.numel(), *rng.integers(0, flat.numel(), 8).tolist()})
        total = 0
        for a, b in zip(cuts[:-1], cuts[1:], strict=True):
            part = flat[a:b]
            fa = fpr.fingerprint("w", part, offset=a)
            assert fa == torch_path("w", part, a)
            total += fa
        assert total & M64 == whole


@HYP
@given(st.integers(1, 400), st.lists(st.integers(0, 400), max_size=10), st.sampled_from(INFOS))
def test_decomposable_property(n, cuts, info):
    flat = random_tensor(info, n, seed=n)
    points = sorted({0, n, *(c for c in cuts if c <= n)})
    total = sum(
        fpr.fingerprint("t", flat[a:b], offset=a)
        for a, b in zip(points[:-1], points[1:], strict=True)
    )
    assert total & M64 == fpr.fingerprint("t", flat)


def test_partial_sum_over_scattered_positions():
    info = dtypes.info(torch.bfloat16)
    t = random_tensor(info, 1000, seed=7)
    bits = dtypes.int_view(t).to(torch.int64)
    seed = fpr.seed_of("w")
    perm = torch.randperm(1000, generator=torch.Generator().manual_seed(0))
    a, b = perm[:333], perm[333:]
    s = fpr.partial_sum(a, bits[a], 2, seed) + fpr.partial_sum(b, bits[b], 2, seed)
    assert s & M64 == fpr.fingerprint("w", t)
    h = fpr.element_hash(torch.arange(1000), bits, 2, seed)
    assert int(h.min()) >= 0 and int(h.max()) <= M32


# ---------------------------------------------------------------- incremental


@pytest.mark.parametrize("info", INFOS, ids=INFO_IDS)
def test_incremental_update_equals_recomputation(info):
    g = torch.Generator().manual_seed(8)
    old_t = random_tensor(info, 2000, seed=8)
    new_t = random_tensor(info, 2000, seed=9)
    for k in (1, 17, 2000):
        pos = torch.randperm(2000, generator=g)[:k]
        mixed = dtypes.int_view(old_t).clone()
        mixed[pos] = dtypes.int_view(new_t)[pos]
        target = dtypes.from_int(mixed, info.torch_dtype, (2000,))
        old_bits = dtypes.int_view(old_t)[pos].to(torch.int64)
        new_bits = mixed[pos].to(torch.int64)
        got = fpr.update(fpr.fingerprint("w", old_t), "w", pos, old_bits, new_bits, info.itemsize)
        assert got == fpr.fingerprint("w", target) == torch_path("w", target)


def test_incremental_update_at_high_positions():
    info = dtypes.info(torch.float16)
    t = random_tensor(info, 50, seed=10)
    off = (1 << 32) - 25
    new = dtypes.int_view(t).clone()
    idx = torch.tensor([3, 24, 25, 49])
    new[idx] ^= 0x1234
    f = fpr.update(
        fpr.fingerprint("w", t, offset=off),
        "w",
        idx + off,
        dtypes.int_view(t)[idx].to(torch.int64),
        new[idx].to(torch.int64),
        2,
    )
    assert f == fpr.fingerprint("w", dtypes.from_int(new, torch.float16, (50,)), offset=off)


def test_update_with_no_positions_is_identity():
    e = torch.zeros(0, dtype=torch.int64)
    assert fpr.update(12345, "w", e, e, e, 4) == 12345


# ---------------------------------------------------------------- sensitivity


@pytest.mark.parametrize("info", INFOS, ids=INFO_IDS)
def test_every_single_bit_flip_changes_fingerprint(info):
    t = random_tensor(info, 64, seed=11)
    base = dtypes.int_view(t)
    f0 = fpr.fingerprint("w", t)
    nbits = 1 if info.torch_dtype == torch.bool else info.bits
    seen = {f0}
    for j in (0, 1, 31, 63):
        for bit in range(nbits):
            b = base.clone()
            flip = (1 << bit) - (1 << info.bits if bit == info.bits - 1 else 0)
            b[j] ^= flip
            f = fpr.fingerprint("w", dtypes.from_int(b, info.torch_dtype, (64,)))
            assert f != f0, (j, bit)
            seen.add(f)
    assert len(seen) == 1 + 4 * nbits  # and all flips give distinct fingerprints


@pytest.mark.parametrize("info", [i for i in INFOS if i.itemsize <= 2], ids=lambda i: i.name)
def test_any_single_changed_narrow_element_changes_fingerprint(info):
    """Up to 2-byte elements: exhaustively, every other value at one position changes F."""
    t = random_tensor(info, 8, seed=12)
    f0 = fpr.fingerprint("w", t)
    base = dtypes.int_view(t)
    values = (
        [0, 1]
        if info.torch_dtype == torch.bool
        else range(-(1 << (info.bits - 1)), 1 << (info.bits - 1))
    )
    pos = torch.tensor([5])
    old = base[pos].to(torch.int64)
    new = torch.tensor(list(values), dtype=torch.int64)
    new = new[new != int(old)]
    # F changes by h(5, new) - h(5, old) mod 2^64; h is in [0, 2^32) so it is zero iff equal
    seed = fpr.seed_of("w")
    h_new = fpr.element_hash(pos.expand(new.numel()), new, info.itemsize, seed)
    h_old = int(fpr.element_hash(pos, old, info.itemsize, seed))
    assert not bool((h_new == h_old).any())
    assert h_new.unique().numel() == new.numel()
    # spot-check through the public path
    b = base.clone()
    b[5] = int(new[0])
    assert fpr.fingerprint("w", dtypes.from_int(b, info.torch_dtype, (8,))) != f0


def test_swapping_two_elements_changes_fingerprint():
    t = torch.arange(10, dtype=torch.float32)
    s = t.clone()
    s[[2, 7]] = s[[7, 2]]
    assert fpr.fingerprint("w", s) != fpr.fingerprint("w", t)


@pytest.mark.parametrize("info", INFOS, ids=INFO_IDS)
def test_different_names_different_fingerprints(info):
    t = random_tensor(info, 100, seed=13)
    names = [
        "a",
        "b",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.1.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "lm_head.weight",
        "ü-名前",
    ]
    fps = [fpr.fingerprint(n, t) for n in names]
    assert len(set(fps)) == len(names)
    assert [torch_path(n, t) for n in names] == fps


def test_seed_is_crc32_of_utf8_name():
    for n in ("", "w", "ü-名前", "x" * 1000):
        assert fpr.seed_of(n) == zlib.crc32(n.encode("utf-8"))


# ---------------------------------------------------------------- version digest


def test_digest_is_order_free_and_sensitive():
    e = [("a", "BF16", (2, 3), 5), ("b", "F32", (4,), 7)]
    d = fpr.digest(e)
    assert len(d) == 64
    assert fpr.digest(e[::-1]) == d
    assert fpr.digest([("a", "BF16", (3, 2), 5), e[1]]) != d
    assert fpr.digest([("a", "F16", (2, 3), 5), e[1]]) != d
    assert fpr.digest([("a", "BF16", (2, 3), 6), e[1]]) != d
    assert fpr.digest(e[:1]) != d


def test_fmt_parse_round_trip():
    for v in (0, 1, 0xDEADBEEF, M64):
        s = fpr.fmt(v)
        assert len(s) == 16 and fpr.parse(s) == v
    assert fpr.fmt(-1) == "f" * 16


def test_state_fingerprints():
    state = {"a": torch.ones(3), "b": torch.zeros(2, dtype=torch.int8)}
    assert fpr.state_fingerprints(state) == {k: ref_fp(k, v) for k, v in state.items()}
