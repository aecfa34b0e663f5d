"""FP4 views (stitch_core.format.fp4 via views.project): the E2M1 grid against an independent
reference, nibble order, the mxfp4/nvfp4 scales against per-group reference loops, pinning, and
bit-exact patches of FP4 views."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stitch_core import apply, diff
from stitch_core.format import fp4
from stitch_core.format.dtypes import int_view
from stitch_core.format.views import (
    View,
    dequantize,
    parse_view,
    project,
    view_changed_scales,
)

H = 1 + 1 / 32
KINDS = ["mxfp4", "nvfp4"]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))


# --- independent references ------------------------------------------------------------------


def ref_decode(code: int) -> float:
    """E2M1 from its bit fields (OCP MX v1.0): bias 1, subnormals at E == 0."""
    s, e, m = code >> 3, (code >> 1) & 3, code & 1
    mag = 2.0 ** (e - 1) * (1 + m / 2) if e else m / 2
    return -mag if s else mag


GRID = [ref_decode(c) for c in range(8)]


def ref_encode(x: float) -> int:
    """Nearest grid point by distance; ties to the even code; saturation; sign of x kept."""
    a = min(abs(x), 6.0)
    best = min(range(8), key=lambda c: (abs(a - GRID[c]), c % 2))
    return best | (8 if math.copysign(1.0, x) < 0 else 0)


def ref_encode_tensor(x: torch.Tensor) -> torch.Tensor:
    return torch.tensor([ref_encode(v) for v in x.reshape(-1).tolist()],
                        dtype=torch.uint8).reshape(x.shape)


E4M3_POS = sorted({v for v in torch.arange(256, dtype=torch.int32).to(torch.uint8)
                   .view(torch.float8_e4m3fn).float().tolist() if math.isfinite(v) and v > 0})


def ref_e4m3_ceil(x: float) -> float:
    return min(v for v in E4M3_POS if v >= min(x, 448.0))


def make_masters(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(64, 32, generator=g),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(96, 160, generator=g) * 0.02,
        "model.layers.0.self_attn.q_proj.bias": torch.randn(96, generator=g),
        "model.layers.0.mlp.up_proj.weight": (torch.randn(128, 96, generator=g) * 0.05)
        .bfloat16(),
        "model.layers.0.mlp.down_proj.weight": torch.randn(96, 120, generator=g) * 0.05,  # 120 % 32
        "model.layers.0.odd_proj.weight": torch.randn(8, 33, generator=g),  # odd: stays bf16
        "model.norm.weight": 1 + torch.randn(96, generator=g) * 0.1,
        "model.ids": torch.arange(16),
        "lm_head.weight": torch.randn(64, 32, generator=g),
    }


QUANTIZED = ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.up_proj.weight",
             "model.layers.0.mlp.down_proj.weight"]


# --- the E2M1 grid ----------------------------------------------------------------------------


def test_decode_all_16_codes_matches_bit_fields():
    codes = torch.arange(16, dtype=torch.uint8)
    got = fp4.e2m1_decode(codes)
    want = torch.tensor([ref_decode(c) for c in range(16)])
    assert same_bits(got, want)  # -0.0 for code 8 included
    assert list(fp4.E2M1_VALUES) == GRID


def test_every_representable_value_round_trips():
    codes = torch.arange(16, dtype=torch.uint8)
    assert torch.equal(fp4.e2m1_encode(fp4.e2m1_decode(codes)), codes)


def test_ties_go_to_even_codes_and_saturate():
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    want = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]  # the neighbour whose mantissa bit is 0
    for sign in (1.0, -1.0):
        x = torch.tensor([sign * t for t in ties])
        got = fp4.e2m1_decode(fp4.e2m1_encode(x))
        assert got.tolist() == [sign * w for w in want]
    sat = torch.tensor([6.0, 6.5, 7.0, 1e30, float("inf"), -6.5, -float("inf")])
    assert fp4.e2m1_encode(sat).tolist() == [7, 7, 7, 7, 7, 15, 15]


def test_encode_matches_reference_on_dense_and_boundary_inputs():
    g = torch.Generator().manual_seed(0)
    mids = [(a + b) / 2 for a, b in zip(GRID, GRID[1:], strict=False)] + GRID
    near = torch.tensor(mids, dtype=torch.float32)
    up = torch.nextafter(near, torch.tensor(float("inf")))
    down = torch.nextafter(near, torch.tensor(float("-inf")))
    x = torch.cat([near, up, down, torch.randn(4000, generator=g) * 3,
                   torch.rand(2000, generator=g) * 8, torch.tensor([0.0, -0.0, 1e-40])])
    x = torch.cat([x, -x])
    assert torch.equal(fp4.e2m1_encode(x), ref_encode_tensor(x))


def test_nibble_order_low_is_the_even_element():
    codes = torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)
    packed = fp4.pack_nibbles(codes)
    assert packed.tolist() == [[0x21, 0x0F]]
    r = torch.randint(0, 16, (7, 10), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    assert torch.equal(fp4.unpack_nibbles(fp4.pack_nibbles(r)), r)


# --- projection -------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_fp4_outputs_names_shapes_and_error_bound(kind):
    masters = make_masters()
    out = project(masters, kind)
    group = 32 if kind == "mxfp4" else 16
    expected = set(masters) - set(QUANTIZED)
    for n in QUANTIZED:
        expected |= {n + "_packed", n + "_scale"} | ({n + "_global_scale"} if kind == "nvfp4"
                                                      else set())
    assert out.keys() == expected
    deq = dequantize(out, kind)
    assert deq.keys() == masters.keys()
    for n in QUANTIZED:
        rows, cols = masters[n].shape
        assert out[n + "_packed"].dtype == torch.uint8
        assert out[n + "_packed"].shape == (rows, cols // 2)
        sdt = torch.uint8 if kind == "mxfp4" else torch.float8_e4m3fn
        assert out[n + "_scale"].dtype == sdt
        assert out[n + "_scale"].shape == (rows, math.ceil(cols / group))
        w = masters[n].float()
        s = dequantize({**out, n + "_packed": torch.full_like(out[n + "_packed"], 0x22)},
                       kind)[n]  # code 2 = 1.0 in both nibbles: the group's scale per element
        err = (deq[n] - w).abs()
        assert (err <= (0.25 * w.abs() + 0.25 * s) * (1 + 1e-6)).all(), n
        assert (w.abs() <= 6 * s * (1 + 1e-6)).all(), n  # fresh scales never clip
    for n in set(masters) - set(QUANTIZED):
        t = masters[n]
        assert same_bits(out[n], t.to(torch.bfloat16) if t.is_floating_point() else t), n


def test_mxfp4_matches_reference_loop():
    w = torch.randn(5, 70, generator=torch.Generator().manual_seed(2)) * 0.1
    w[1, 32:64] = 0  # an all-zero group
    w[2, 3] = 40.0
    packed, scale = fp4.quantize_mxfp4(w)
    codes = fp4.unpack_nibbles(packed)
    for r in range(5):
        for j in range(3):
            blk = w[r, 32 * j: 32 * (j + 1)]
            y = (blk.abs().max().clamp_min(1e-12) * H / 6.0).item()  # float32 arithmetic
            e = 127 + math.ceil(math.log2(y))
            assert scale[r, j].item() == e, (r, j)
            ref = ref_encode_tensor(blk / 2.0 ** (e - 127))
            assert torch.equal(codes[r, 32 * j: 32 * j + blk.numel()], ref), (r, j)


def test_nvfp4_matches_reference_loop():
    w = torch.randn(4, 48, generator=torch.Generator().manual_seed(3)) * 0.05
    w[0, :16] = 0
    w[3, 20] = 3.0
    packed, scale, gs = fp4.quantize_nvfp4(w)
    gref = torch.tensor(448.0 * 6.0) / (w.abs().max() * torch.tensor(H))
    assert same_bits(gs, gref.reshape(1))
    codes = fp4.unpack_nibbles(packed)
    for r in range(4):
        for j in range(3):
            blk = w[r, 16 * j: 16 * (j + 1)]
            need = (blk.abs().max().clamp_min(1e-12) * H * gref / 6.0).item()
            sb = ref_e4m3_ceil(need)
            assert scale[r, j].float().item() == sb, (r, j)
            eff = torch.tensor(sb) / gref
            assert torch.equal(codes[r, 16 * j: 16 * (j + 1)], ref_encode_tensor(blk / eff))


# --- pinning ----------------------------------------------------------------------------------


def adamw_like(masters, lr=1e-4, seed=7):
    """One sign-like AdamW step (|update| ~ lr) with weight decay on the floating tensors."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for n, t in masters.items():
        if not t.is_floating_point():
            out[n] = t
            continue
        grad = torch.randn(t.shape, generator=g)
        step = lr * grad / (grad.abs() + 1e-1) + lr * 0.01 * t.float()
        out[n] = (t.float() - step).to(t.dtype)
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_pinned_scales_survive_a_small_update(kind):
    masters = make_masters()
    v1 = project(masters, kind)
    v2 = project(adamw_like(masters, lr=1e-5), kind, previous=v1)
    changes = view_changed_scales(v1, v2)
    assert len(changes) == len(QUANTIZED) * (2 if kind == "nvfp4" else 1)
    assert all(c == 0 for c in changes.values()), changes
    for n in QUANTIZED:
        same = (v2[n + "_packed"] == v1[n + "_packed"]).float().mean().item()
        assert same > 0.9, (n, same)
    # without pinning, the nvfp4 global scale follows the new amax (mxfp4's powers of two may not)
    if kind == "nvfp4":
        assert sum(view_changed_scales(v1, project(adamw_like(masters, 1e-3), kind)).values())


@pytest.mark.parametrize("kind", KINDS)
def test_clipping_group_is_rescaled_alone(kind):
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(4)) * 0.02
    name = "l.q_proj.weight"
    v1 = project({name: w}, kind)
    sn = name + "_scale"
    group = 32 if kind == "mxfp4" else 16
    deq1 = dequantize(v1, kind)[name]
    w2 = w.clone()
    # 1.2x the group's current range: clips that group; for nvfp4 still within the global range
    scale_one = dequantize({**v1, name + "_packed": torch.full_like(v1[name + "_packed"], 0x22)},
                           kind)[name]
    w2[5, 40] = scale_one[5, 40] * 6 * 1.2
    v2 = project({name: w2}, kind, previous=v1)
    j = 40 // group
    mask = torch.zeros(v1[sn].shape, dtype=torch.bool)
    mask[5, j] = True
    assert same_bits(v2[sn][~mask], v1[sn][~mask])
    assert not same_bits(v2[sn][mask], v1[sn][mask])
    if kind == "nvfp4":
        assert same_bits(v2[name + "_global_scale"], v1[name + "_global_scale"])
    deq2 = dequantize(v2, kind)[name]
    outside = torch.ones_like(w, dtype=torch.bool)
    outside[5, j * group: (j + 1) * group] = False
    assert same_bits(deq2[outside], deq1[outside])
    assert (deq2[5, 40] - w2[5, 40]).abs() <= 0.25 * w2[5, 40].abs()


def test_nvfp4_global_scale_changes_only_on_block_overflow():
    w = torch.randn(4, 32, generator=torch.Generator().manual_seed(5)) * 0.02
    name = "a.weight"
    v1 = project({name: w}, "nvfp4")
    gn = name + "_global_scale"
    # grows 20% but within 448 * 6 / global: global kept, the grown block re-scaled
    w2 = w.clone()
    w2[0, 0] = w.abs().max() * 1.01
    v2 = project({name: w2}, "nvfp4", previous=v1)
    assert same_bits(v2[gn], v1[gn])
    # beyond what the largest block scale can hold: a fresh global scale, every block recomputed
    w3 = w.clone()
    w3[0, 0] = w.abs().max() * 2
    v3 = project({name: w3}, "nvfp4", previous=v1)
    assert same_bits(v3[gn], project({name: w3}, "nvfp4")[gn])
    assert same_bits(v3[name + "_scale"], project({name: w3}, "nvfp4")[name + "_scale"])
    assert not same_bits(v3[gn], v1[gn])


@pytest.mark.parametrize("kind", KINDS)
def test_unusable_previous_scales_are_recomputed(kind):
    w = torch.randn(6, 64, generator=torch.Generator().manual_seed(6))
    name = "e.weight"
    fresh = project({name: w}, kind)
    bad = dict(fresh)
    s = fresh[name + "_scale"].clone()
    if kind == "mxfp4":
        s[0, 0] = 255  # E8M0 NaN
        s[1, 1] = 0  # 2^-127: far too small, would clip
    else:
        sb = s.view(torch.uint8)
        sb[0, 0] = 0x7F  # E4M3 NaN
        sb[1, 1] = 0  # zero
    bad[name + "_scale"] = s
    again = project({name: w}, kind, previous=bad)
    assert same_bits(again[name + "_scale"], fresh[name + "_scale"])
    if kind == "nvfp4":
        nan_global = {**fresh, name + "_global_scale": torch.tensor([float("nan")])}
        assert same_bits(project({name: w}, kind, previous=nan_global)[name + "_global_scale"],
                         fresh[name + "_global_scale"])


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 40), half_cols=st.integers(1, 70), kind=st.sampled_from(KINDS),
       log_mag=st.integers(-10, 6), seed=st.integers(0, 2**16), zero_rows=st.booleans())
def test_projection_is_idempotent_under_pinning(rows, half_cols, kind, log_mag, seed, zero_rows):
    w = torch.randn(rows, 2 * half_cols, generator=torch.Generator().manual_seed(seed))
    w = w * 10.0**log_mag
    if zero_rows:
        w[: rows // 2] = 0
    masters = {"m.w.weight": w, "m.norm.weight": torch.randn(4)}
    first = project(masters, kind)
    again = project(masters, kind, previous=first)
    assert first.keys() == again.keys()
    for n in first:
        assert same_bits(again[n], first[n]), n
    assert torch.isfinite(dequantize(first, kind)["m.w.weight"]).all()


def test_views_are_registered():
    assert parse_view("mxfp4").block == 32 and parse_view("nvfp4").block == 16
    assert parse_view("mxfp4").quantized and not parse_view("bf16").quantized
    with pytest.raises(ValueError, match="mxfp4, nvfp4"):
        parse_view("fp4")


# --- patches of FP4 views ---------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_patch_of_an_fp4_update_is_bit_exact(kind):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(),
                                torch.nn.Linear(512, 256))
    masters = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    v1 = project(masters, kind)
    v2 = project(adamw_like(masters, lr=1e-4), kind, previous=v1)
    patch = diff(v1, v2, view=kind)
    got = apply(v1, patch)
    assert got.keys() == v2.keys()
    for n in v2:
        assert same_bits(got[n], v2[n]), n
    h = patch.header
    total = sum(t.numel() for t in v2.values())
    changed = sum(e.changed for e in h.tensors)
    want_changed = sum(int((int_view(v1[n]) != int_view(v2[n])).sum()) for n in v2)
    assert changed == want_changed > 0
    frac = changed / total
    assert 0 < frac < 0.5, frac  # a small update is a small patch
    dt = {e.name: e.dtype for e in h.tensors}
    assert dt["model.0.weight_packed"] == "U8"
    assert dt["model.0.weight_scale"] == ("U8" if kind == "mxfp4" else "F8_E4M3")
    print(f"{kind}: {changed}/{total} elements changed ({frac:.2%}), patch {len(patch.data)} B")


def test_mxfp4_scale_is_exact_at_powers_of_two():
    # headroom 0: a group whose amax / 6 is exactly 2^k gets scale 2^k (not 2^(k+1))
    v = View("mxfp4", "mxfp4", block=32, headroom=0.0)
    w = torch.zeros(3, 32)
    w[0, 5], w[1, 7], w[2, 0] = 6 * 2.0**-3, -6 * 2.0**4, 6 * 2.0**-3 * 1.0000001
    out = project({"p.weight": w}, v)
    assert out["p.weight_scale"].reshape(-1).tolist() == [127 - 3, 127 + 4, 127 - 2]
    codes = fp4.unpack_nibbles(out["p.weight_packed"])
    assert codes[0, 5] == 7 and codes[1, 7] == 15  # +-6.0: the top of the grid, not clipped


def test_nvfp4_fused_layers_share_one_global_scale():
    g = torch.Generator().manual_seed(8)
    pre = "model.layers.3"
    m = {f"{pre}.self_attn.q_proj.weight": torch.randn(32, 64, generator=g) * 0.01,
         f"{pre}.self_attn.k_proj.weight": torch.randn(16, 64, generator=g) * 0.5,
         f"{pre}.self_attn.v_proj.weight": torch.randn(16, 64, generator=g) * 0.1,
         f"{pre}.self_attn.o_proj.weight": torch.randn(64, 32, generator=g) * 0.1,
         f"{pre}.mlp.gate_proj.weight": torch.randn(48, 64, generator=g) * 0.02,
         f"{pre}.mlp.up_proj.weight": torch.randn(48, 64, generator=g) * 0.2}
    v1 = project(m, "nvfp4")
    gs = {n: v1[n + "_global_scale"] for n in m}
    qkv = [n for n in m if n.split(".")[-2] in ("q_proj", "k_proj", "v_proj")]
    gate_up = [n for n in m if "mlp" in n]
    for members in (qkv, gate_up):
        amax = max(m[n].abs().max() for n in members)
        want = torch.tensor(448.0 * 6.0) / (amax * torch.tensor(H))
        for n in members:
            assert same_bits(gs[n], want.reshape(1)), n  # the group's largest amax sets it
    assert not same_bits(gs[qkv[0]], gs[gate_up[0]])
    o = f"{pre}.self_attn.o_proj.weight"
    assert same_bits(gs[o], fp4.quantize_nvfp4(m[o])[2])  # unfused: its own
    deq = dequantize(v1, "nvfp4")
    for n in m:  # the small members keep their precision through their block scales
        assert ((deq[n] - m[n]).abs() <= 0.25 * m[n].abs() + 0.25 * m[n].abs().max() / 6).all()
    # a member outgrowing the shared range re-scales the whole group, together
    m2 = dict(m)
    m2[qkv[0]] = m[qkv[0]].clone()
    m2[qkv[0]][0, 0] = 10.0
    v2 = project(m2, "nvfp4", previous=v1)
    new = {n: v2[n + "_global_scale"] for n in qkv}
    assert all(same_bits(new[n], new[qkv[0]]) for n in qkv)
    assert not same_bits(new[qkv[0]], gs[qkv[0]])
    for n in gate_up + [o]:
        assert same_bits(v2[n + "_global_scale"], gs[n])


def test_e8m0_decodes_every_byte():
    got = fp4.e8m0_value(torch.arange(256, dtype=torch.int32).to(torch.uint8)).tolist()
    assert got[:255] == [2.0 ** (e - 127) for e in range(255)]  # exact, 2^-127 included
    assert math.isnan(got[255])


@pytest.mark.parametrize("kind,preset", [("nvfp4", "NVFP4A16"), ("mxfp4", "MXFP4A16")])
def test_compressed_tensors_reads_the_view_as_we_do(kind, preset):
    """compressed-tensors (the library that defines the layout; a test dependency, not a
    runtime one): its unpacking and its decompressor agree with ours."""
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization import preset_name_to_scheme

    if kind == "nvfp4":
        from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor as C
    else:
        from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor as C
    w = torch.randn(32, 128, generator=torch.Generator().manual_seed(9)) * 0.05
    name = "l.q_proj.weight"
    view = project({name: w}, kind)
    packed = view[name + "_packed"]
    ours = fp4.e2m1_decode(fp4.unpack_nibbles(packed))
    assert same_bits(unpack_fp4_from_uint8(packed, 32, 128, dtype=torch.float32), ours)
    sd = {k.removeprefix("l.q_proj."): t for k, t in view.items()}
    theirs = C.decompress(sd, preset_name_to_scheme(preset, ["Linear"]))["weight"].float()
    mine = dequantize(view, kind)[name]
    assert torch.allclose(theirs, mine, rtol=2**-7, atol=0)  # theirs is computed in bf16
