import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stitch_core.format.views import (
    FP8_DTYPE,
    View,
    dequantize,
    is_quantized_weight,
    parse_view,
    project,
    scale_name,
    view_changed_scales,
)

GRANS = ["tensor", "channel", "block"]
HEADROOM = 1 + 1 / 32


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def fresh_scale(amax: torch.Tensor) -> torch.Tensor:
    return amax.float().clamp_min(1e-12) * HEADROOM / 448.0


def make_masters(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(64, 32, generator=g),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(300, 200, generator=g) * 0.02,
        "model.layers.0.self_attn.q_proj.bias": torch.randn(300, generator=g),
        "model.layers.0.mlp.up_proj.weight": torch.randn(256, 128, generator=g) * 0.05,
        "model.layers.0.mlp.down_proj.weight": (
            torch.randn(100, 260, generator=g) * 0.1
        ).bfloat16(),
        "model.layers.0.input_layernorm.weight": 1 + torch.randn(200, generator=g) * 0.1,
        "model.rotary.inv_freq_ids": torch.arange(16),
        "lm_head.weight": torch.randn(64, 32, generator=g),
    }


def quantized_names(masters: dict[str, torch.Tensor]) -> list[str]:
    return [n for n, t in masters.items() if is_quantized_weight(n, t)]


def expected_scale_shape(shape: torch.Size, gran: str) -> tuple[int, ...]:
    rows, cols = shape
    return {
        "tensor": (1,),
        "channel": (rows, 1),
        "block": (math.ceil(rows / 128), math.ceil(cols / 128)),
    }[gran]


# --- bf16 / fp16 ---------------------------------------------------------------------------


@pytest.mark.parametrize("spec,dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_casts_bit_exact_contiguous_no_alias(spec, dtype):
    masters = make_masters()
    masters["transposed.weight"] = torch.randn(40, 30).t()  # non-contiguous input
    masters["already.weight"] = torch.randn(8, 8).to(dtype)  # same dtype: must still be copied
    out = project(masters, spec)
    assert out.keys() == masters.keys()
    for name, t in masters.items():
        o = out[name]
        assert o.is_contiguous() and o.device == t.device
        assert o.data_ptr() != t.data_ptr()
        if t.is_floating_point():
            assert same_bits(o, t.to(dtype)), name
        else:
            assert same_bits(o, t), name


def test_cast_rounds_to_nearest_even():
    # 1 + 2^-8 is exactly halfway between two bf16 values: RNE rounds down to 1.0.
    x = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8], dtype=torch.float32)
    out = project({"x.weight": x}, "bf16")["x.weight"]
    assert out.tolist() == [1.0, 1 + 2**-6]


# --- naming --------------------------------------------------------------------------------


def test_parse_view_names_and_errors():
    assert parse_view("bf16") == View("bf16", "bf16")
    assert parse_view("fp16").kind == "fp16"
    for gran in GRANS:
        v = parse_view(f"fp8-e4m3-{gran}")
        assert (v.name, v.kind, v.granularity) == (f"fp8-e4m3-{gran}", "fp8-e4m3", gran)
    assert parse_view("fp8-e4m3") == parse_view("fp8-e4m3-block")
    custom = View("fp8-e4m3-block", "fp8-e4m3", "block", headroom=0.1)
    assert parse_view(custom) is custom
    for bad in ["fp8", "int8", "FP8-E4M3-row", ""]:
        with pytest.raises(ValueError, match="fp8-e4m3-channel") as e:
            parse_view(bad)
        assert "bf16" in str(e.value)
    with pytest.raises(ValueError):
        View("fp8-x", "fp8-e4m3", None)


def test_is_quantized_weight_and_scale_name():
    w = torch.zeros(4, 4)
    assert is_quantized_weight("model.layers.0.mlp.up_proj.weight", w)
    assert not is_quantized_weight("model.embed_tokens.weight", w)
    assert not is_quantized_weight("lm_head.weight", w)
    assert not is_quantized_weight("model.norm.weight", torch.zeros(4))
    assert not is_quantized_weight("x.bias", w)
    assert not is_quantized_weight("x.weight", torch.zeros(4, 4, dtype=torch.int32))
    assert not is_quantized_weight("x.weight", torch.zeros(2, 2, 2))
    assert scale_name("x.weight", "block") == "x.weight_scale_inv"
    assert scale_name("x.weight", "tensor") == "x.weight_scale"
    assert scale_name("x.weight", "channel") == "x.weight_scale"
    with pytest.raises(ValueError):
        scale_name("x.weight", None)


# --- fp8 projection ------------------------------------------------------------------------


@pytest.mark.parametrize("gran", GRANS)
def test_fp8_outputs_and_error_bound(gran):
    masters = make_masters()
    spec = f"fp8-e4m3-{gran}"
    out = project(masters, spec)
    qnames = quantized_names(masters)
    assert sorted(qnames) == sorted(
        n for n in masters if n.endswith("proj.weight")
    )  # embeddings, lm_head, norms excluded
    assert out.keys() == set(masters) | {scale_name(n, gran) for n in qnames}
    deq = dequantize(out, spec)
    assert deq.keys() == masters.keys()
    for name, t in masters.items():
        if name in qnames:
            codes, scale = out[name], out[scale_name(name, gran)]
            assert codes.dtype == FP8_DTYPE and codes.shape == t.shape and codes.is_contiguous()
            assert scale.dtype == torch.float32
            assert tuple(scale.shape) == expected_scale_shape(t.shape, gran)
            assert not torch.isnan(codes.float()).any()
            assert torch.isfinite(scale).all() and (scale > 0).all()
            w = t.float()
            err = (deq[name] - w).abs()
            s = dequantize({name: torch.ones_like(codes), scale_name(name, gran): scale}, spec)
            s = s[name]  # scale broadcast to the weight's shape
            # e4m3: half-ulp is 2^-4 relative for normals, 2^-10 * scale for subnormals.
            assert (err <= (w.abs() * 2**-4 + s * 2**-10) * (1 + 1e-5)).all(), name
            assert (err <= 16 * s).all()
            assert deq[name].dtype == torch.float32
        elif t.is_floating_point():
            assert same_bits(out[name], t.to(torch.bfloat16)), name
        else:
            assert same_bits(out[name], t) and out[name].data_ptr() != t.data_ptr()


def test_fp8_block_matches_reference_loop_on_partial_blocks():
    w = torch.randn(300, 200, generator=torch.Generator().manual_seed(1))
    w[130:140, 5:9] *= 50  # one block with a much larger range
    out = project({"a.weight": w}, "fp8-e4m3-block")
    scale, codes = out["a.weight_scale_inv"], out["a.weight"]
    assert scale.shape == (3, 2)
    for i in range(3):
        for j in range(2):
            blk = w[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128]
            ref = fresh_scale(blk.abs().max())
            assert same_bits(scale[i, j], ref), (i, j)
            ref_codes = (blk / ref).clamp(-448, 448).to(FP8_DTYPE)
            got = codes[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128]
            assert same_bits(got, ref_codes), (i, j)


def test_fp8_channel_and_tensor_match_reference():
    w = torch.randn(50, 70, generator=torch.Generator().manual_seed(2))
    ch = project({"a.weight": w}, "fp8-e4m3-channel")["a.weight_scale"]
    assert same_bits(ch, fresh_scale(w.abs().amax(dim=1, keepdim=True)))
    tn = project({"a.weight": w}, "fp8-e4m3-tensor")["a.weight_scale"]
    assert same_bits(tn, fresh_scale(w.abs().max()).reshape(1))


# --- pinned scales -------------------------------------------------------------------------


@pytest.mark.parametrize("gran", GRANS)
def test_pinned_scales_survive_small_update(gran):
    masters = make_masters()
    spec = f"fp8-e4m3-{gran}"
    v1 = project(masters, spec)
    g = torch.Generator().manual_seed(7)
    nudged = {
        n: t + (1e-6 * torch.randn(t.shape, generator=g)).to(t.dtype)
        if t.is_floating_point()
        else t
        for n, t in masters.items()
    }
    v2 = project(nudged, spec, previous=v1)
    changes = view_changed_scales(v1, v2)
    assert set(changes) == {scale_name(n, gran) for n in quantized_names(masters)}
    assert all(c == 0 for c in changes.values()), changes
    for name in quantized_names(masters):
        sn = scale_name(name, gran)
        assert same_bits(v2[sn], v1[sn])
        same = (bits(v2[name]) == bits(v1[name])).float().mean().item()
        assert same > 0.95, (name, same)
    # Without pinning the fresh scales follow the new amax and differ bitwise.
    v2_free = project(nudged, spec)
    assert sum(view_changed_scales(v1, v2_free).values()) > 0


@pytest.mark.parametrize(
    "gran,changed_idx",
    [("block", (1, 1)), ("channel", (150, 0)), ("tensor", (0,))],
)
def test_clipping_group_is_rescaled_alone(gran, changed_idx):
    spec = f"fp8-e4m3-{gran}"
    w = torch.randn(300, 200, generator=torch.Generator().manual_seed(3)) * 0.02
    name, sn = "l.q_proj.weight", scale_name("l.q_proj.weight", gran)
    v1 = project({name: w}, spec)
    w2 = w.clone()
    w2[150, 150] = v1[sn][changed_idx] * 448 * 1.5  # exceeds the range of its group only
    v2 = project({name: w2}, spec, previous=v1)
    s1, s2 = v1[sn], v2[sn]
    mask = torch.zeros_like(s1, dtype=torch.bool)
    mask[changed_idx] = True
    assert same_bits(s2[~mask], s1[~mask])  # every other scale bitwise unchanged
    if gran == "block":
        group = w2[128:256, 128:200]
    elif gran == "channel":
        group = w2[150]
    else:
        group = w2
    assert same_bits(s2[changed_idx], fresh_scale(group.abs().max()))
    assert view_changed_scales(v1, v2) == {sn: 1}
    # Codes outside the rescaled group are untouched; codes stay finite and in range.
    outside = torch.ones_like(w, dtype=torch.bool)
    if gran == "block":
        outside[128:256, 128:200] = False
    elif gran == "channel":
        outside[150] = False
    else:
        outside[:] = False
    assert same_bits(v2[name][outside], v1[name][outside])
    assert not torch.isnan(v2[name].float()).any()
    assert v2[name].float().abs().max() <= 448


def test_codes_never_nan_on_extreme_inputs():
    w = torch.randn(260, 140, generator=torch.Generator().manual_seed(4))
    w[:128, :128] = 0  # all-zero block
    w[128:, :5] *= 1e6
    w[:3, 128:] = 1e-30
    masters = {"e.weight": w}
    for gran in GRANS:
        spec = f"fp8-e4m3-{gran}"
        sn = scale_name("e.weight", gran)
        v1 = project(masters, spec)
        bad = v1[sn].clone().reshape(-1)
        bad[0], bad[-1] = 0.0, float("nan")  # unusable previous scales are recomputed
        bad[len(bad) // 2] = 1e-20  # far too small: would clip
        prev = {sn: bad.reshape(v1[sn].shape)}
        for view in (v1, project(masters, spec, previous=prev)):
            assert not torch.isnan(view["e.weight"].float()).any(), gran
            assert torch.isfinite(view[sn]).all() and (view[sn] > 0).all(), gran
        assert (dequantize(v1, spec)["e.weight"][:128, :128] == 0).all()


def test_previous_scale_of_other_shape_is_ignored():
    w = torch.randn(200, 200, generator=torch.Generator().manual_seed(5))
    stale = {"a.weight_scale_inv": torch.full((1, 1), 1e3)}
    assert same_bits(
        project({"a.weight": w}, "fp8-e4m3", previous=stale)["a.weight_scale_inv"],
        project({"a.weight": w}, "fp8-e4m3")["a.weight_scale_inv"],
    )


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 300),
    cols=st.integers(1, 300),
    gran=st.sampled_from(GRANS),
    log_mag=st.integers(-12, 6),
    seed=st.integers(0, 2**16),
    bf16_master=st.booleans(),
)
def test_projection_is_idempotent_under_pinning(rows, cols, gran, log_mag, seed, bf16_master):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 10.0**log_mag
    if seed % 3 == 0:
        w[: rows // 2] = 0  # some all-zero groups
    masters = {
        "m.w.weight": w.bfloat16() if bf16_master else w,
        "m.norm.weight": torch.randn(cols, generator=g),
        "m.embed.weight": torch.randn(cols, 4, generator=g),
        "m.ids": torch.arange(rows),
    }
    spec = f"fp8-e4m3-{gran}"
    first = project(masters, spec)
    again = project(masters, spec, previous=first)
    assert first.keys() == again.keys()
    for name in first:
        assert same_bits(again[name], first[name]), name
    assert not torch.isnan(first["m.w.weight"].float()).any()
    assert view_changed_scales(first, again) == {scale_name("m.w.weight", gran): 0}


def test_project_without_copy_keeps_masters_already_in_the_served_dtype():
    """copy=False (a checkpoint read from disk): a master in the served dtype is the view's
    tensor itself; others are cast or copied as with copy=True, which never aliases."""
    g = torch.Generator().manual_seed(0)
    m = {"a.weight": torch.randn(8, 4, generator=g).bfloat16(),
         "b.weight": torch.randn(8, 4, generator=g),
         "c.weight": torch.randn(4, 8, generator=g).bfloat16().t(),  # not contiguous
         "d.idx": torch.arange(5)}
    shared = project(m, "bf16", copy=False)
    assert shared["a.weight"] is m["a.weight"] and shared["d.idx"] is m["d.idx"]
    assert shared["b.weight"].dtype == torch.bfloat16
    assert shared["c.weight"].is_contiguous() and torch.equal(shared["c.weight"], m["c.weight"])
    copied = project(m, "bf16")
    for k, t in copied.items():
        assert t.data_ptr() != m[k].data_ptr() and torch.equal(t, shared[k])
