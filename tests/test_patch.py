"""diff/apply (stitch_core.format.patch): bitwise round trips, whole-tensor changes, header stats,
and
the checks that refuse a wrong base, model, run or version (in place: with everything undone)."""

from __future__ import annotations

import copy
import hashlib
import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stitch_core import Patch, PatchError, apply, diff
from stitch_core.format import dtypes
from stitch_core.format import fingerprint as fpr
from stitch_core.format.patch import DEFAULT_CHUNK_SPAN
from stitch_core.format.stp import END_MAGIC, FOOTER

HYP = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

DTYPES = [
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.float8_e4m3fn,
    torch.int8,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.float8_e5m2,
    torch.uint8,
    torch.float64,
]

# special bit patterns (as signed integers of the element width): +-0, +-inf, NaNs with payloads
SPECIALS = {
    torch.float32: [0, -(1 << 31), 0x7F800000, -0x00800000, 0x7FC00000, 0x7F800001, -0x400000],
    torch.float16: [0, -0x8000, 0x7C00, -0x0400, 0x7E00, 0x7C01, -0x200, 1],
    torch.bfloat16: [0, -0x8000, 0x7F80, -0x0080, 0x7FC0, 0x7F81, -0x40, 1],
    torch.float8_e4m3fn: [0, -128, 0x7F, -1, 0x7E, 1, -2],
    torch.float8_e5m2: [0, -128, 0x7C, -4, 0x7E, 0x7D, 1],
    torch.float64: [0, -(1 << 63), 0x7FF << 52, -(1 << 52), 0x7FF8 << 48, (0x7FF << 52) | 1],
}


# ---------------------------------------------------------------- helpers


def bits(t: torch.Tensor) -> torch.Tensor:
    return dtypes.int_view(t)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (dtype, shape and every bit; NaN payloads and -0.0 included)."""
    return a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape) and torch.equal(bits(a), bits(b))


def assert_state(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for k in want:
        assert same(got[k], want[k]), k


def snapshot(state: dict) -> dict:
    return {k: v.clone() for k, v in state.items()}


def random_bits(info: dtypes.DTypeInfo, n: int, rng: np.random.Generator) -> torch.Tensor:
    """n random bit patterns of the dtype as int64 (sign-extended)."""
    if info.torch_dtype == torch.bool:
        return torch.from_numpy(rng.integers(0, 2, n)).to(torch.int64)
    u = rng.integers(0, np.iinfo(np.uint64).max, n, dtype=np.uint64, endpoint=True)
    v = torch.from_numpy(u.view(np.int64).copy())
    return dtypes.signed(dtypes.unsigned(v, info.itemsize), info.itemsize)


def make_tensor(dtype, shape, rng, mode: str) -> torch.Tensor:
    info = dtypes.info(dtype)
    n = int(np.prod(shape)) if shape else 1
    if mode == "bits" or dtype == torch.bool:
        b = random_bits(info, n, rng)
    elif info.is_float:
        w = torch.from_numpy(rng.standard_normal(n).astype(np.float32) * 0.05)
        b = bits(w.to(dtype)).to(torch.int64)
    else:
        b = torch.from_numpy(rng.integers(-100, 100, n)).to(torch.int64)
        if dtype == torch.uint8:
            b = b & 0xFF
    if info.is_float and n:
        sp = torch.tensor(SPECIALS[dtype], dtype=torch.int64)
        k = min(n, sp.numel(), max(1, n // 50))
        b[torch.from_numpy(rng.choice(n, k, replace=False))] = sp[:k]
    return dtypes.from_int(b.to(info.int_dtype), dtype, tuple(shape))


def change(t: torch.Tensor, rng, density, how: str) -> torch.Tensor:
    """A copy of t with the elements at a random subset (by density) changed."""
    info = dtypes.info(t.dtype)
    b = bits(t).to(torch.int64).clone()
    n = b.numel()
    if density == "one":
        k = min(n, 1)
    else:
        k = int(round(density * n))
        if density and not k and n:
            k = 1
    pos = torch.from_numpy(rng.choice(n, k, replace=False)).to(torch.int64) if k else None
    if pos is not None:
        old = b[pos]
        if t.dtype == torch.bool:
            new = 1 - old
        elif how == "ulp" and info.is_float and info.itemsize <= 4:
            half = 1 << (info.bits - 1)
            d = torch.from_numpy(rng.choice([-3, -2, -1, 1, 1, 1, 2], k)).to(torch.int64)
            key = (dtypes.to_key(old, info) + d).clamp(-half, half - 1)
            new = dtypes.from_key(key, info)
        elif how == "ulp":
            new = old + torch.from_numpy(rng.choice([-2, -1, 1, 3], k)).to(torch.int64)
            new = dtypes.signed(dtypes.unsigned(new, info.itemsize), info.itemsize)
        elif how == "special" and info.is_float:
            sp = torch.tensor(SPECIALS[t.dtype], dtype=torch.int64)
            new = sp[torch.from_numpy(rng.integers(0, sp.numel(), k))]
        else:
            new = random_bits(info, k, rng)
        if density == "one" and int(new[0]) == int(old[0]):
            new = new ^ 1 if t.dtype != torch.bool else 1 - old
        b[pos] = new
    return dtypes.from_int(b.to(info.int_dtype), t.dtype, tuple(t.shape))


def n_changed(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((bits(a) != bits(b)).sum())


def split(data: bytes) -> tuple[int, dict]:
    hoff, hlen, _, _ = FOOTER.unpack(data[-FOOTER.size :])
    return hoff, json.loads(data[hoff : hoff + hlen])


def forge(data: bytes, header: dict | bytes) -> bytes:
    """Replace the header JSON and recompute the footer (a valid checksum)."""
    hoff, _ = split(data)
    blob = header if isinstance(header, bytes) else json.dumps(header).encode()
    body = data[:hoff] + blob + struct.pack("<QQ", hoff, len(blob))
    return body + hashlib.blake2b(body, digest_size=32).digest() + END_MAGIC


def one_line_error(fn, *args, match: str | None = None, **kw) -> PatchError:
    with pytest.raises(PatchError) as ei:
        fn(*args, **kw)
    msg = str(ei.value)
    assert msg and "\n" not in msg
    if match is not None:
        assert match in msg, msg
    return ei.value


# ---------------------------------------------------------------- round trips


@st.composite
def cases(draw):
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(
        st.one_of(
            st.just(()),
            st.lists(st.integers(0, 13), min_size=1, max_size=3),
            st.tuples(st.integers(600, 3000)).map(list),
        )
    )
    density = draw(st.sampled_from([0.0, "one", 0.001, 0.1, 0.5, 1.0]))
    how = draw(st.sampled_from(["ulp", "bits", "special"]))
    mode = draw(st.sampled_from(["weights", "bits"]))
    span = draw(st.sampled_from([64, 100, 1000, DEFAULT_CHUNK_SPAN]))
    seed = draw(st.integers(0, 2**32 - 1))
    return dtype, tuple(shape), density, how, mode, span, seed


@HYP
@given(cases())
def test_round_trip_property(case):
    dtype, shape, density, how, mode, span, seed = case
    rng = np.random.default_rng(seed)
    w = make_tensor(dtype, shape, rng, mode)
    w2 = change(w, rng, density, how)
    bias = make_tensor(torch.float32, (7,), rng, "weights")
    base = {"model.w": w, "model.bias": bias}
    new = {"model.w": w2, "model.bias": change(bias, rng, "one", "ulp")}
    keep = snapshot(base)
    p = diff(base, new, chunk_span=span)
    assert_state(base, keep)  # diff does not touch its inputs

    h = p.header
    want_changed = n_changed(w, w2) + n_changed(bias, new["model.bias"])
    assert h.changed_elements == want_changed
    assert h.total_elements == w.numel() + bias.numel()
    entry = {t.name: t for t in h.tensors}["model.w"]
    assert entry.kind == "patch" and entry.note is None and entry.shape == list(shape)
    assert entry.dtype == dtypes.info(dtype).name
    assert entry.base_fp == fpr.fmt(fpr.fingerprint("model.w", w))
    assert entry.target_fp == fpr.fmt(fpr.fingerprint("model.w", w2))
    diff_mask = (bits(w) != bits(w2)).numpy()
    for c in entry.chunks:  # one chunk per span holding changes, aligned to the span
        assert c.start % span == 0 and c.stop == min(c.start + span, w.numel())
        assert c.count == int(diff_mask[c.start : c.stop].sum()) >= 1
        assert (c.pos == "all") == (c.count == c.stop - c.start)
        if dtypes.info(dtype).itemsize == 8:
            assert c.val != "ulp"
    spans_with_changes = {i // span for i in np.flatnonzero(diff_mask)}
    assert len(entry.chunks) == len(spans_with_changes)

    out = apply(base, p)
    assert_state(out, new)
    assert_state(base, keep)

    inplace = snapshot(base)
    ptrs = {k: v.data_ptr() for k, v in inplace.items()}
    res = apply(inplace, p, inplace=True)
    assert res is inplace
    assert_state(res, new)
    assert {k: v.data_ptr() for k, v in res.items()} == ptrs  # patched where they lie


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("density", [0.0, "one", 0.001, 0.5, 1.0])
def test_round_trip_grid(dtype, density):
    rng = np.random.default_rng(hash((str(dtype), str(density))) & 0xFFFF)
    w = make_tensor(dtype, (40, 50), rng, "weights")
    for how in ("ulp", "special"):
        w2 = change(w, rng, density, how)
        p = diff({"w": w}, {"w": w2}, chunk_span=64)
        assert p.header.changed_elements == n_changed(w, w2)
        assert_state(apply({"w": w}, p), {"w": w2})


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_zero_dim_and_empty_tensors(dtype):
    rng = np.random.default_rng(0)
    scalar = make_tensor(dtype, (), rng, "bits")
    scalar2 = change(scalar, rng, "one", "bits")
    empty = make_tensor(dtype, (0, 4), rng, "bits")
    base = {"s": scalar, "e": empty, "z": make_tensor(dtype, (0,), rng, "bits")}
    new = {"s": scalar2, "e": empty.clone(), "z2": make_tensor(dtype, (3, 0), rng, "bits")}
    p = diff(base, new, chunk_span=64)
    h = p.header
    ents = {t.name: t for t in h.tensors}
    assert ents["s"].shape == [] and ents["s"].changed == 1
    assert ents["e"].changed == 0 and ents["e"].chunks == []
    assert ents["z"].kind == "removed" and ents["z2"].kind == "full"
    assert h.changed_elements == 1 and h.total_elements == 1
    out = apply(base, p)
    assert_state(out, new)
    assert out["s"].shape == torch.Size([])
    assert_state(apply(snapshot(base), p, inplace=True), new)


def test_nan_inf_negzero_bit_patterns_preserved():
    for dtype, specials in SPECIALS.items():
        info = dtypes.info(dtype)
        sp = torch.tensor(specials, dtype=torch.int64)
        base_bits = sp.roll(1)
        w = dtypes.from_int(base_bits.to(info.int_dtype), dtype, (sp.numel(),))
        w2 = dtypes.from_int(sp.to(info.int_dtype), dtype, (sp.numel(),))
        p = diff({"w": w}, {"w": w2})
        assert p.header.changed_elements == n_changed(w, w2) == sp.numel()
        assert same(apply({"w": w}, p)["w"], w2)
        # +0.0 -> -0.0 alone is a change (floats compare equal, bits do not)
        z = torch.zeros(5, dtype=dtype)
        nz = z.clone()
        nz[2] = -0.0
        p = diff({"z": z}, {"z": nz})
        assert p.header.changed_elements == 1
        out = apply({"z": z}, p)["z"]
        assert same(out, nz) and int(bits(out)[2]) == -(1 << (info.bits - 1))


def test_non_contiguous_inputs():
    g = torch.Generator().manual_seed(0)
    m = torch.randn(30, 20, generator=g).bfloat16()
    base_t = m.t()  # (20, 30), not contiguous
    new_t = base_t.contiguous().clone()
    new_t[3, 7] = 5.0
    new_t[19, 29] = -1.0
    p = diff({"w": base_t}, {"w": new_t.t().contiguous().t()})  # new also non-contiguous
    assert p.header.changed_elements == 2
    out = apply({"w": base_t}, p)
    assert same(out["w"], new_t)
    with pytest.raises(PatchError, match="contiguous"):
        apply({"w": base_t}, p, inplace=True)


# ---------------------------------------------------------------- whole tensors


def test_added_removed_reshaped_dtype_changed():
    rng = np.random.default_rng(1)
    base = {
        "keep": make_tensor(torch.bfloat16, (16, 16), rng, "weights"),
        "gone": make_tensor(torch.float32, (5, 3), rng, "weights"),
        "reshaped": make_tensor(torch.bfloat16, (8, 6), rng, "weights"),
        "grown": make_tensor(torch.int32, (10,), rng, "bits"),
        "recast": make_tensor(torch.float32, (4, 4), rng, "weights"),
        "recast_same_width": make_tensor(torch.float16, (9,), rng, "weights"),
    }
    new = {
        "keep": change(base["keep"], rng, 0.1, "ulp"),
        "reshaped": base["reshaped"].reshape(6, 8).clone(),  # same bits, new shape
        "grown": make_tensor(torch.int32, (12,), rng, "bits"),
        "recast": base["recast"].to(torch.bfloat16),
        "recast_same_width": base["recast_same_width"].view(torch.bfloat16).clone(),
        "added": make_tensor(torch.float8_e4m3fn, (3, 70), rng, "bits"),
        "added_bool": make_tensor(torch.bool, (100,), rng, "bits"),
    }
    p = diff(base, new, chunk_span=64)
    h = p.header
    ents = {t.name: t for t in h.tensors}
    assert [t.name for t in h.tensors] == sorted(set(base) | set(new))
    expect = {
        "keep": ("patch", None),
        "gone": ("removed", None),
        "reshaped": ("full", "reshaped"),
        "grown": ("full", "reshaped"),
        "recast": ("full", "dtype changed"),
        "recast_same_width": ("full", "dtype changed"),
        "added": ("full", "added"),
        "added_bool": ("full", "added"),
    }
    assert {k: (e.kind, e.note) for k, e in ents.items()} == expect
    for k, e in ents.items():
        if k in base:
            assert e.base_fp == fpr.fmt(fpr.fingerprint(k, base[k]))
        else:
            assert e.base_fp is None
        if k in new:
            assert e.target_fp == fpr.fmt(fpr.fingerprint(k, new[k]))
            assert e.shape == list(new[k].shape)
            assert e.dtype == dtypes.info(new[k].dtype).name
        else:
            assert e.target_fp is None and e.chunks == [] and e.changed == 0
        if e.kind == "full":
            assert e.changed == new[k].numel()
            assert all(c.val == "raw" and c.pos == "all" for c in e.chunks)
            assert [c.start for c in e.chunks] == list(range(0, new[k].numel(), 64))
    full = sum(new[k].numel() for k, e in ents.items() if e.kind == "full")
    assert h.changed_elements == full + n_changed(base["keep"], new["keep"])
    assert h.total_elements == sum(t.numel() for t in new.values())
    keep = snapshot(base)
    assert_state(apply(base, p), new)
    assert_state(base, keep)
    state = snapshot(base)
    res = apply(state, p, inplace=True)
    assert res is state
    assert_state(res, new)


@HYP
@given(
    st.sampled_from(DTYPES),
    st.sampled_from(DTYPES),
    st.lists(st.integers(0, 9), max_size=3),
    st.lists(st.integers(0, 9), max_size=3),
    st.integers(0, 1000),
)
def test_whole_tensor_changes_property(dt_a, dt_b, shape_a, shape_b, seed):
    rng = np.random.default_rng(seed)
    a = make_tensor(dt_a, tuple(shape_a), rng, "bits")
    b = make_tensor(dt_b, tuple(shape_b), rng, "bits")
    p = diff({"x": a, "old": a}, {"x": b, "new": b}, chunk_span=64)
    ents = {t.name: t for t in p.header.tensors}
    assert ents["old"].kind == "removed" and ents["new"].note == "added"
    if dt_a != dt_b:
        assert (ents["x"].kind, ents["x"].note) == ("full", "dtype changed")
    elif tuple(shape_a) != tuple(shape_b):
        assert (ents["x"].kind, ents["x"].note) == ("full", "reshaped")
    else:
        assert ents["x"].kind == "patch"
    assert_state(apply({"x": a, "old": a}, p), {"x": b, "new": b})


# ---------------------------------------------------------------- encodings and size


def test_typical_sparse_bf16_change_uses_ulp():
    g = torch.Generator().manual_seed(2)
    w = (torch.randn(256, 256, generator=g) * 0.02).bfloat16()
    pos = torch.randperm(w.numel(), generator=g)[:655]  # ~1%
    b = bits(w).to(torch.int64).clone()
    info = dtypes.info(torch.bfloat16)
    step = torch.where(torch.rand(655, generator=g) < 0.5, 1, -1)
    b[pos] = dtypes.from_key(dtypes.to_key(b[pos], info) + step, info)
    w2 = dtypes.from_int(b.to(torch.int16), torch.bfloat16, (256, 256))
    p = diff({"w": w}, {"w": w2})
    (e,) = p.header.tensors
    assert e.changed == 655 and len(e.chunks) == 1
    assert e.chunks[0].val == "ulp" and e.chunks[0].pos == "gaps"
    # ~8 bits of gap and ~1 bit of sign per change, not 16 bits of value + position
    assert e.nbytes < 655 * 1.5
    out = apply({"w": w}, p)["w"]
    assert torch.equal(bits(out), bits(w2))
    assert not torch.equal(bits(out), bits(w))


def test_dense_ulp_change_uses_contexts_and_is_small():
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(64, 256, generator=g) * 0.02).bfloat16()
    info = dtypes.info(torch.bfloat16)
    b = bits(w).to(torch.int64)
    b2 = dtypes.from_key(dtypes.to_key(b, info) + (b >= 0).to(torch.int64) * 2 - 1, info)
    w2 = dtypes.from_int(b2.to(torch.int16), torch.bfloat16, tuple(w.shape))
    p = diff({"w": w}, {"w": w2})
    (c,) = p.header.tensors[0].chunks
    assert c.pos == "all" and c.val == "ulp" and c.ctx is not None and c.ctx[2] == 1
    assert c.pos_bytes == 0 and c.val_bytes < 200  # the sign context makes it nearly free
    assert same(apply({"w": w}, p)["w"], w2)


def test_many_chunks_with_small_span():
    rng = np.random.default_rng(4)
    w = make_tensor(torch.float16, (10_000,), rng, "weights")
    w2 = change(w, rng, 0.05, "ulp")
    p = diff({"w": w}, {"w": w2}, chunk_span=64)
    (e,) = p.header.tensors
    assert len(e.chunks) > 100
    assert [c.start for c in e.chunks] == sorted(c.start for c in e.chunks)
    assert sum(c.count for c in e.chunks) == e.changed == n_changed(w, w2)
    assert same(apply({"w": w}, p)["w"], w2)


def test_identical_states_give_an_empty_patch():
    rng = np.random.default_rng(5)
    base = {k: make_tensor(d, (33, 3), rng, "bits") for k, d in zip("abc", DTYPES, strict=False)}
    p = diff(base, snapshot(base))
    assert p.header.changed_elements == 0
    assert all(t.kind == "patch" and not t.chunks for t in p.header.tensors)
    assert_state(apply(base, p), base)


# ---------------------------------------------------------------- containers and metadata


def test_patch_bytes_path_and_metadata(tmp_path):
    rng = np.random.default_rng(6)
    base = {"w": make_tensor(torch.bfloat16, (50,), rng, "weights")}
    new = {"w": change(base["w"], rng, 0.1, "ulp")}
    p = diff(base, new, run="run-7", base_version=3, target_version=4, view="bf16")
    h = p.header
    assert (h.run, h.base_version, h.target_version, h.view) == ("run-7", 3, 4, "bf16")
    assert h.base_digest == fpr.digest([("w", "BF16", (50,), fpr.fingerprint("w", base["w"]))])
    assert h.target_digest == fpr.digest([("w", "BF16", (50,), fpr.fingerprint("w", new["w"]))])
    path = tmp_path / "x.stp"
    p.write(path)
    assert Patch.read(path).data == p.data == p.to_bytes()
    for src in (p, p.data, bytearray(p.data), str(path), path):
        assert_state(apply(base, src), new)


def test_base_fingerprints_are_used():
    rng = np.random.default_rng(7)
    base = {"w": make_tensor(torch.float32, (40,), rng, "weights")}
    new = {"w": change(base["w"], rng, 0.2, "bits")}
    fps = fpr.state_fingerprints(base)
    p = diff(base, new, base_fingerprints=fps)
    assert p.header.tensors[0].base_fp == fpr.fmt(fps["w"])
    assert_state(apply(base, p, base_fingerprints=fps), new)
    one_line_error(apply, base, p, base_fingerprints={"w": fps["w"] ^ 1}, match="fingerprint")


# ---------------------------------------------------------------- refusals


def model_pair(seed: int = 8):
    rng = np.random.default_rng(seed)
    base = {
        "a.weight": make_tensor(torch.bfloat16, (32, 8), rng, "weights"),
        "b.weight": make_tensor(torch.bfloat16, (32, 8), rng, "weights"),
        "c.bias": make_tensor(torch.float32, (8,), rng, "weights"),
        "d.removed": make_tensor(torch.int8, (5,), rng, "bits"),
    }
    new = {
        "a.weight": change(base["a.weight"], rng, 0.1, "ulp"),
        "b.weight": change(base["b.weight"], rng, 0.1, "ulp"),
        "c.bias": base["c.bias"].clone(),
        "e.added": make_tensor(torch.float16, (4,), rng, "bits"),
    }
    return base, new


def test_wrong_base_one_element_different():
    base, new = model_pair()
    p = diff(base, new)
    for name in ("a.weight", "c.bias", "d.removed"):
        wrong = snapshot(base)
        b = bits(wrong[name])
        b[3] ^= 1
        err = one_line_error(apply, wrong, p, match="fingerprint")
        assert name in str(err)


def test_base_from_the_target_version_is_refused():
    base, new = model_pair()
    p = diff(base, new)
    state = {k: v for k, v in new.items() if k != "e.added"} | {"d.removed": base["d.removed"]}
    one_line_error(apply, state, p, match="fingerprint")


def test_wrong_dtype_or_shape_is_refused():
    base, new = model_pair()
    p = diff(base, new)
    wrong = snapshot(base)
    wrong["a.weight"] = wrong["a.weight"].float()
    one_line_error(apply, wrong, p, match="a.weight")
    wrong = snapshot(base)
    wrong["a.weight"] = wrong["a.weight"].reshape(8, 32)
    one_line_error(apply, wrong, p, match="a.weight")


def test_wrong_model_is_refused():
    base, new = model_pair()
    p = diff(base, new)
    extra = snapshot(base) | {"z.extra": torch.zeros(3)}
    one_line_error(apply, extra, p, match="another model")
    for missing in ("a.weight", "c.bias", "d.removed"):
        state = {k: v for k, v in base.items() if k != missing}
        one_line_error(apply, state, p, match="another model")
    renamed = {("x." + k if k == "c.bias" else k): v for k, v in base.items()}
    one_line_error(apply, renamed, p, match="another model")
    # the names of one model under the tensors of another
    swapped = snapshot(base)
    swapped["a.weight"], swapped["b.weight"] = swapped["b.weight"], swapped["a.weight"]
    one_line_error(apply, swapped, p, match="fingerprint")


def test_wrong_run_or_version_is_refused():
    base, new = model_pair()
    p = diff(base, new, run="r1", base_version=3, target_version=4)
    one_line_error(apply, base, p, run="r2", match="run")
    one_line_error(apply, base, p, base_version=4, match="version")
    one_line_error(apply, base, p, run="r1", base_version=2, match="version")
    assert_state(apply(base, p, run="r1", base_version=3), new)
    assert_state(apply(base, p), new)


def test_refusals_leave_base_untouched():
    base, new = model_pair()
    p = diff(base, new, run="r1", base_version=3)
    keep = snapshot(base)
    for kw in ({"run": "r2"}, {"base_version": 9}):
        state = snapshot(base)
        with pytest.raises(PatchError):
            apply(state, p, inplace=True, **kw)
        assert_state(state, keep)


# ---------------------------------------------------------------- in place, undone on failure


def test_inplace_failure_on_later_tensor_undoes_earlier_writes():
    base, new = model_pair()
    p = diff(base, new)
    state = snapshot(base)
    b = bits(state["c.bias"])  # checked after a.weight and b.weight were patched in place
    b[0] ^= 1
    keep = snapshot(state)
    objs = dict(state)
    one_line_error(apply, state, p, inplace=True, match="c.bias")
    assert_state(state, keep)
    assert all(state[k] is objs[k] for k in objs)  # same dict content, same tensor objects


def test_inplace_failure_on_result_fingerprint_undoes_everything():
    base, new = model_pair()
    p = diff(base, new, chunk_span=64)
    _, h = split(p.data)
    ents = {t["name"]: t for t in h["tensors"]}
    # b.weight's chunks decode fine and are written, then its result fingerprint mismatches
    ents["b.weight"]["target_fp"] = fpr.fmt(fpr.parse(ents["b.weight"]["target_fp"]) ^ 1)
    bad = forge(p.data, h)
    state = snapshot(base)
    keep = snapshot(base)
    one_line_error(apply, state, bad, inplace=True, match="b.weight")
    assert_state(state, keep)
    one_line_error(apply, snapshot(base), bad, match="b.weight")


def test_inplace_failure_on_corrupt_chunk_undoes_everything():
    base, new = model_pair()
    p = diff(base, new, chunk_span=64)
    _, h = split(p.data)
    ents = {t["name"]: t for t in h["tensors"]}
    ents["b.weight"]["chunks"][-1]["crc32"] ^= 1  # last chunk of the second patched tensor
    state = snapshot(base)
    one_line_error(apply, state, forge(p.data, h), inplace=True, match="checksum")
    assert_state(state, base)


def test_forge_helper_is_faithful():
    base, new = model_pair()
    p = diff(base, new)
    _, h = split(p.data)
    assert forge(p.data, h) == p.data or split(forge(p.data, h))[1] == h
    assert_state(apply(base, forge(p.data, copy.deepcopy(h))), new)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32,
                                   torch.float8_e4m3fn, torch.int8, torch.int32])
def test_ulp_numba_path_equals_torch_path(dtype):
    """CPU tensors use fused numba loops, accelerators the torch ops: both must agree bitwise."""
    from stitch_core.format import codec, dtypes

    g = torch.Generator().manual_seed(7)
    dt = dtypes.info(dtype)
    n = 5000
    old = torch.randint(-(1 << (dt.bits - 1)), 1 << (dt.bits - 1), (n,), generator=g)
    new = torch.randint(-(1 << (dt.bits - 1)), 1 << (dt.bits - 1), (n,), generator=g)
    u_numba = codec.values_for("ulp", old, new, dt)
    u_torch = codec.ulp_values_torch(old, new, dt)
    assert np.array_equal(u_numba, u_torch)
    back_numba = codec.apply_values("ulp", u_numba, old, dt)
    back_torch = codec.ulp_apply_torch(torch.from_numpy(u_torch.view(np.int64)), old, dt)
    assert torch.equal(back_numba, new) and torch.equal(back_torch, new)
    ctx = codec.Context(base=100, n=12, sign=True)
    ub = old & ((1 << dt.bits) - 1)
    exp = (ub >> dt.mantissa_bits) & ((1 << (dt.bits - 1 - dt.mantissa_bits)) - 1)
    want = (exp - 100).clamp(0, 11) + 12 * ((ub >> (dt.bits - 1)) & 1)
    assert np.array_equal(ctx.of(old.numpy(), dt), want.numpy().astype(np.uint8))


def _parts(base: dict, new: dict, world: int, span: int = 1000) -> list[bytes]:
    """Sharded producers: rank r holds rows [r*R/world, (r+1)*R/world) of every tensor."""
    import io

    from stitch_core.format.patch import PatchBuilder

    builders, bufs = [], []
    for r in range(world):
        buf = io.BytesIO()
        b = PatchBuilder(buf, run="fsdp", base_version=1, target_version=2, chunk_span=span)
        for name in sorted(base):
            rows = base[name].shape[0]
            lo, hi = r * rows // world, (r + 1) * rows // world
            row_numel = base[name][0].numel()
            b.add(name, base[name][lo:hi].contiguous(), new[name][lo:hi].contiguous(),
                  shape=tuple(base[name].shape), offset=lo * row_numel)
        builders.append(b)
        bufs.append(buf)
    totals: dict[str, tuple[int, int]] = {}
    for b in builders:  # what an all-reduce (sum mod 2^64) of the partial fingerprints gives
        for name, (fb, ft) in b.partial_fingerprints().items():
            tb, tt = totals.get(name, (0, 0))
            totals[name] = ((tb + fb) % 2**64, (tt + ft) % 2**64)
    for r, b in enumerate(builders):
        b.finish(totals=totals, part=(r, world))
    return [buf.getvalue() for buf in bufs]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_multi_part_patch_from_sharded_producers(world):
    g = torch.Generator().manual_seed(3)
    base = {"a.weight": torch.randn(37, 50, generator=g).bfloat16(),
            "b.weight": torch.randn(64, 8, generator=g).to(torch.float8_e4m3fn)}
    new = {k: (v.float() * (1 + 0.05 * torch.randn(v.shape, generator=g))).to(v.dtype)
           for k, v in base.items()}
    parts = _parts(base, new, world)
    single = diff(base, new)
    out = apply(base, parts)
    assert all(torch.equal(dtypes.int_view(out[k]), dtypes.int_view(new[k])) for k in new)
    # the parts carry the same fingerprints as a single-process patch
    ps = [Patch(p).header for p in parts]
    want = {t.name: (t.base_fp, t.target_fp) for t in single.header.tensors}
    assert all({t.name: (t.base_fp, t.target_fp) for t in h.tensors} == want for h in ps)
    assert sum(h.changed_elements for h in ps) == single.header.changed_elements
    if world > 1:
        with pytest.raises(PatchError, match="complete set"):
            apply(base, parts[:-1])
        with pytest.raises(PatchError):
            apply(base, [parts[0], parts[0], *parts[2:]])


def test_reader_hashes_the_bytes_it_reads_through_one_descriptor(tmp_path):
    """`PatchReader(path, sha256=...)`: the manifest's SHA-256 is checked on the descriptor every
    later read uses, so replacing the file at the path after it was opened changes nothing read,
    and a file that is not the listed one is refused."""
    from stitch_core.format.stp import PatchReader

    g = torch.Generator().manual_seed(3)
    base = {"w": torch.randn(64, 64, generator=g).bfloat16()}
    new = {"w": base["w"].clone()}
    new["w"].view(-1)[::7] += 1
    p = tmp_path / "a.stp"
    diff(base, new).write(p)
    orig = p.read_bytes()
    sha = hashlib.sha256(orig).hexdigest()
    with PatchReader(p, sha256=sha) as r:
        other = tmp_path / "b.stp"
        diff(base, {"w": -base["w"]}).write(other)
        other.replace(p)  # swapped at the path after verification
        for c in r.entry("w").chunks:
            pos, val = r.read_chunk(c)
            assert bytes(pos) + bytes(val) == orig[c.offset:c.offset + c.nbytes]
    with pytest.raises(PatchError, match="not the ones the manifest lists"):
        PatchReader(p, sha256=sha)


def test_the_writer_hashes_what_it_writes_and_the_reader_hashes_once(tmp_path, monkeypatch):
    """`PatchBuilder.sha256` is the written file's SHA-256 (a publisher lists it without reading
    the file back); a reader given that SHA-256 hashes the file once (no BLAKE2b pass) and still
    refuses one flipped byte anywhere, the footer's checksum included."""
    from stitch_core.format import stp
    from stitch_core.format.patch import PatchBuilder

    g = torch.Generator().manual_seed(4)
    base = {"w": torch.randn(96, 64, generator=g).bfloat16()}
    new = {"w": base["w"].clone()}
    new["w"].view(-1)[::5] += 1
    p = tmp_path / "a.stp"
    with open(p, "wb") as f:
        b = PatchBuilder(f, run="r", base_version=0, target_version=1)
        b.add("w", base["w"], new["w"])
        b.finish()
    data = p.read_bytes()
    assert b.sha256 == hashlib.sha256(data).hexdigest()
    blakes = []
    real = stp.hashlib.blake2b
    monkeypatch.setattr(stp.hashlib, "blake2b", lambda **kw: blakes.append(kw) or real(**kw))
    with stp.PatchReader(p, sha256=b.sha256):
        pass
    assert blakes == []  # the manifest's SHA-256 alone
    with stp.PatchReader(p):
        pass
    assert len(blakes) == 1  # without it, the footer's BLAKE2b
    for at in (10, len(data) // 2, len(data) - 45, len(data) - 20):  # payload, header, digest
        bad = bytearray(data)
        bad[at] ^= 1
        with pytest.raises(PatchError):
            stp.PatchReader(bytes(bad), sha256=b.sha256)


def test_a_decompression_bomb_is_refused_before_decoding(tmp_path, monkeypatch):
    """A 32 MiB constant tensor added by a patch: an encoder without the format's cap on symbol
    probability writes it in a few hundred bytes (a 100,000:1 expansion); readers refuse such a
    chunk when the patch is opened, before allocating or decoding anything. Our encoder writes
    the same tensor in ~50 KB (every token costs >= 0.0227 bits) and it round-trips."""
    from stitch_core.format import entropy
    from stitch_core.format.stp import PatchReader

    new = {"w": torch.zeros(4096, 4096, dtype=torch.bfloat16)}
    ours = tmp_path / "ours.stp"
    diff({}, new).write(ours)
    assert 40_000 < ours.stat().st_size < 80_000
    out = apply({}, ours)
    assert torch.equal(out["w"].view(torch.int16), new["w"].view(torch.int16))
    from stitch_core.format import header

    monkeypatch.setattr(entropy, "MIN_COST_SHIFT", 40)  # an encoder without the cap
    monkeypatch.setattr(header, "min_stream_bytes", lambda k: 0)  # (and a writer not checking)
    bomb = tmp_path / "bomb.stp"
    diff({}, new).write(bomb)
    monkeypatch.undo()
    assert bomb.stat().st_size < 4_000  # 32 MiB from under 4 KB
    with pytest.raises(PatchError, match="decompression bomb"):
        PatchReader(bomb)
    with pytest.raises(PatchError, match="decompression bomb"):
        apply({}, bomb)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn,
                                   torch.int64, torch.float64, torch.bool, torch.uint8])
def test_fused_compare_equals_torch_compare_and_fingerprint_update(dtype):
    """codec.compare's one numba pass = torch nonzero + gathers + fpr.update."""
    from stitch_core.format import codec, dtypes
    from stitch_core.format import fingerprint as fpr

    g = torch.Generator().manual_seed(3)
    a = (torch.randn(4099, generator=g) * 8).to(dtype)
    b = a.clone()
    idx = torch.randperm(4099, generator=g)[:300]
    b[idx] = (torch.randn(300, generator=g) * 8).to(dtype)
    av, bv = dtypes.int_view(a), dtypes.int_view(b)
    pos, old, new, delta = codec.compare(av, bv, 7, fpr.seed_of("w"))
    want = torch.nonzero(av != bv).reshape(-1)
    assert torch.equal(pos, want + 7)
    assert torch.equal(old, av[want].to(torch.int64)) and torch.equal(new, bv[want].to(torch.int64))
    itemsize = dtypes.info(dtype).itemsize
    assert delta == fpr.update(0, "w", pos, old, new, itemsize)


def _one_chunk(dtype, frac, span=3000):
    from stitch_core.format import dtypes
    from stitch_core.format.stp import PatchReader

    g = torch.Generator().manual_seed(11)
    base = torch.randn(span, generator=g).to(dtype)
    new = base.clone()
    k = max(1, int(frac * span))
    idx = torch.randperm(span, generator=g)[:k]
    nv = dtypes.int_view(new)  # flip low mantissa bits: every chosen element changes
    nv[idx] ^= torch.randint(1, 8, (k,), generator=g).to(nv.dtype)
    p = diff({"w": base}, {"w": new})
    with PatchReader(p.data) as r:
        (c,) = r.header.tensors[0].chunks
        pb, vb = r.read_chunk(c)
        pb, vb = bytes(pb), bytes(vb)
    return base, new, c, pb, vb, dtypes.info(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float32])
@pytest.mark.parametrize("frac", [0.01, 0.3, 1.0])
def test_fused_apply_equals_stepwise_decode(dtype, frac):
    """apply_cpu (both streams decoded and written in one kernel) = decode_positions +
    decode_values + scatter, for gap, bitmap and `all` positions."""
    from stitch_core.format import codec, dtypes

    base, new, c, pb, vb, dt = _one_chunk(dtype, frac)
    flat = dtypes.int_view(base.clone()).numpy()
    ctx = codec.Context.from_list(c.ctx) if c.ctx else None
    pos, old, _ = codec.apply_cpu(flat, c.pos, pb, c.val, ctx, vb, c.start, c.stop, c.count, dt, 1)
    assert np.array_equal(flat, dtypes.int_view(new).numpy())
    want = codec.decode_positions(c.pos, pb, c.start, c.stop, c.count)
    assert np.array_equal(pos, want)
    assert np.array_equal(old, dtypes.int_view(base).numpy()[want])


def test_fused_apply_writes_nothing_on_corrupt_streams():
    from stitch_core.format import codec, dtypes

    base, _, c, pb, vb, dt = _one_chunk(torch.bfloat16, 0.2)
    ctx = codec.Context.from_list(c.ctx) if c.ctx else None
    before = dtypes.int_view(base).numpy().copy()
    rng = np.random.default_rng(0)
    fails = 0
    for trial in range(200):
        p2, v2 = bytearray(pb), bytearray(vb)
        buf = v2 if trial % 2 else p2
        buf[int(rng.integers(0, len(buf)))] ^= 1 << int(rng.integers(0, 8))
        flat = before.copy()
        try:
            codec.apply_cpu(flat, c.pos, bytes(p2), c.val, ctx, bytes(v2), c.start, c.stop,
                            c.count, dt, 1)
        except codec.CodecError:
            fails += 1
            assert np.array_equal(flat, before)  # every write undone
    assert fails > 100


def test_fused_apply_undoes_its_writes_when_a_late_value_leaves_the_range():
    """ulp deltas decoded fine but the last one overflows: the kernel has written the others
    and must restore them."""
    from stitch_core.format import codec, dtypes, entropy

    dt = dtypes.info(torch.bfloat16)
    flat = np.array([0, 1, 2, 0x7F7F, 4], dtype=np.int16)
    before = flat.copy()
    u = np.array([2, 2, 2, 2 * 0x200], dtype=np.uint64)  # +1 ulp, ..., then far past the top
    pos = np.array([0, 1, 2, 3], dtype=np.int64)
    pe, pb = codec.encode_positions(pos, 0, 5)
    with pytest.raises(codec.CodecError, match="range"):
        codec.apply_cpu(flat, pe, pb, "ulp", None, entropy.encode(u), 0, 5, 4, dt, 1)
    assert np.array_equal(flat, before)


def test_fused_apply_undoes_every_write_when_the_end_check_fails():
    """Values decode and are written one by one; a stream that fails only its end check (here:
    a set padding bit after the last extra bits) has every write put back."""
    from stitch_core.format import codec, dtypes, entropy

    dt = dtypes.info(torch.bfloat16)
    flat = np.arange(1, 601, dtype=np.int16)
    before = flat.copy()
    u = np.full(300, 2, dtype=np.uint64)  # +1 ulp each
    u[-1] = 20  # + 10 ulp, two extra bits: the extra payload's one byte has six padding bits
    pos = np.arange(0, 600, 2, dtype=np.int64)
    pe, pb = codec.encode_positions(pos, 0, 600)
    vb = bytearray(entropy.encode(u))
    assert entropy.parse(bytes(vb), 300).lanes == entropy.LANES
    good = flat.copy()
    codec.apply_cpu(good, pe, pb, "ulp", None, bytes(vb), 0, 600, 300, dt, 1)
    assert np.array_equal(good[pos], before[pos] + np.where(np.arange(300) < 299, 1, 10))
    vb[-1] |= 0x80
    with pytest.raises(codec.CodecError, match="extra bits"):
        codec.apply_cpu(flat, pe, pb, "ulp", None, bytes(vb), 0, 600, 300, dt, 1)
    assert np.array_equal(flat, before)


FORMAT_V1 = Path(__file__).parent / "data" / "format_v1"


def test_a_format_version_1_patch_still_applies():
    """tests/data/format_v1: a patch written before streams had rANS lanes (format version 1,
    every stream one lane), with its base and target. This build reads it bit-exactly."""
    from safetensors.torch import load_file

    from stitch_core.format.header import FORMAT_VERSION
    from stitch_core.format.stp import PatchReader

    data = (FORMAT_V1 / "patch.stp").read_bytes()
    assert struct.unpack_from("<I", data, 8)[0] == 1 and FORMAT_VERSION == 2
    with PatchReader(data) as r:
        assert r.header.format_version == 1
    base, target = (load_file(FORMAT_V1 / f) for f in ("base.safetensors", "target.safetensors"))
    got = apply(base, data)
    assert sorted(got) == sorted(target)
    for n, t in target.items():
        assert torch.equal(dtypes.int_view(got[n]), dtypes.int_view(t)), n
    # the same pair written by this build: version 2, and the result is the same
    p = diff(base, target)
    assert struct.unpack_from("<I", p.data, 8)[0] == 2
    for n, t in apply(base, p).items():
        assert torch.equal(dtypes.int_view(t), dtypes.int_view(target[n])), n


def test_a_header_version_other_than_the_preambles_is_refused():
    base = {"w": torch.randn(64, 64).to(torch.bfloat16)}
    new = {"w": base["w"] + 0.5}
    data = diff(base, new).data
    _, h = split(data)
    h["format_version"] = 1
    one_line_error(apply, base, forge(data, h), match="format version 1, its preamble 2")
    wrong = bytearray(data)
    struct.pack_into("<I", wrong, 8, 3)
    one_line_error(apply, base, bytes(wrong), match="unsupported patch format version 3")
