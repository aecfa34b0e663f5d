"""benchmarks/quant_views.py on a tiny shape: behaviour, not timings (a few seconds)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import quant_views as qv  # noqa: E402
import squash  # noqa: E402

from stitch_core.format import dtypes, views  # noqa: E402
from stitch_core.format import fingerprint as fpr  # noqa: E402
from stitch_core.format.patch import apply  # noqa: E402

FP8 = torch.float8_e4m3fn


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread, as the benchmark runs (two are erratic on a loaded 2-core machine)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def rows(one_thread):
    torch.manual_seed(0)
    return qv.run_lr(qv.tiny_shape(), 1e-5, warm=1, steps=1, seed=0)


def same_bits(a, b) -> bool:
    return a.dtype == b.dtype and torch.equal(dtypes.int_view(a), dtypes.int_view(b))


def test_every_view_measured_with_sane_fractions(rows):
    assert {r["view"] for r in rows} == set(qv.ALL_VIEWS)
    for s in qv.summarize(rows):
        for key in ("weights_frac", "scales_frac", "norms_frac", "changed_frac",
                    "groups_touched_frac", "groups_rescaled_frac", "requant_frac"):
            if s.get(key) is not None:
                assert 0.0 <= s[key] <= 1.0, (s["view"], key, s[key])
        assert s["patch_bytes"] > 0 and s["changed"] <= s["total"]
        assert s["changed"] == s["weights_changed"] + s["scales_changed"] + s["norms_changed"]
    by = {s["view"]: s for s in qv.summarize(rows)}
    assert by["bf16"]["scales_total"] == 0 and by["bf16"]["vs_bf16"] == 1.0
    assert by["bf16"]["weights_changed"] > 0
    for v in ("fp8-e4m3-block", "mxfp4", "nvfp4", *qv.ONLINE):
        assert by[v]["scales_total"] > 0  # scales are counted apart from the codes


def test_patch_round_trips_to_the_exact_next_view():
    shape = qv.tiny_shape()
    m0 = qv.layer_state(qv.pretrained_start(shape, 1))
    g = torch.Generator().manual_seed(2)
    m1 = {n: t + 3e-5 * torch.randn(t.shape, generator=g) for n, t in m0.items()}
    for v in qv.STITCH_VIEWS:
        a = views.project(m0, v)
        b = views.project(m1, v, previous=a)
        fps = fpr.state_fingerprints(a)
        data, header = qv.patch_of(a, b, v, fps, 0)
        got = apply({n: t.clone() for n, t in a.items()}, data, base_fingerprints=fps)
        assert set(got) == set(b) and all(same_bits(got[n], b[n]) for n in b), v
        assert header.changed_elements > 0
    # measure() (used for every row, online fp8 included) raises on a wrong round trip
    a = {"x.weight": torch.zeros(4, dtype=torch.bfloat16)}
    with pytest.raises(AssertionError, match="does not rebuild"):
        qv.measure(a, {"x.weight": torch.ones(4, dtype=torch.bfloat16)}, "bf16", 0,
                   _tamper=lambda got: got["x.weight"].zero_())


def test_pretrained_start_is_squash_generator_at_our_shape():
    shape = qv.tiny_shape()
    m = qv.pretrained_start(shape, 0)
    assert {n: tuple(t.shape) for n, t in m.items()} == shape.shapes()
    assert squash.shape_for is not None and squash.shape_for(4e6) != shape  # patch undone


def ref_per_tensor(w: torch.Tensor):
    """vLLM online fp8_per_tensor, written out directly: scale = amax / 448 (float32), codes =
    e4m3(clamp(w * (1/scale))) (common.cu multiplies by the reciprocal)."""
    amax = w.float().abs().max()
    scale = amax / torch.tensor(448.0)
    return (w.float() * (1.0 / scale)).clamp(-448, 448).to(FP8), scale.reshape(1)


def ref_per_block(w: torch.Tensor, b: int = 128):
    """vLLM per_block_cast_to_fp8, one block at a time."""
    m, n = w.shape
    codes = torch.empty(m, n, dtype=FP8)
    scales = torch.empty(-(-m // b), -(-n // b))
    for i in range(0, m, b):
        for j in range(0, n, b):
            blk = w[i:i + b, j:j + b].float()
            sf = blk.abs().max().clamp(min=1e-4) / 448.0
            scales[i // b, j // b] = sf
            codes[i:i + b, j:j + b] = (blk * (1.0 / sf)).to(FP8)
    return codes, scales


def test_online_fp8_emulation_equals_a_direct_reference():
    shape = qv.tiny_shape()
    bf = {n: t.to(torch.bfloat16) for n, t in qv.layer_state(qv.pretrained_start(shape, 3)).items()}
    bf["model.layers.0.mlp.down_proj.weight"][5, 7] = 0.0  # a zero block would hit the clamp
    bf["model.layers.0.self_attn.o_proj.weight"][:128, :128] = 0.0
    tensor, block = qv.online_fp8(bf, "online-fp8-tensor"), qv.online_fp8(bf, "online-fp8-block")
    p = "model.layers.0."
    fused = {p + "self_attn.q_proj+k_proj+v_proj": ["q_proj", "k_proj", "v_proj"],
             p + "mlp.gate_proj+up_proj": ["gate_proj", "up_proj"],
             p + "self_attn.o_proj.weight": None, p + "mlp.down_proj.weight": None}
    for key, members in fused.items():
        if members:
            mod = "self_attn." if "attn" in key else "mlp."
            w = torch.cat([bf[f"{p}{mod}{m}.weight"] for m in members])  # vLLM's fused order
            name = key + ".weight"
        else:
            w, name = bf[key], key
        codes, scale = ref_per_tensor(w)
        assert same_bits(tensor[name], codes) and same_bits(tensor[name + "_scale"], scale), key
        codes, scales = ref_per_block(w)
        assert same_bits(block[name], codes), key
        assert same_bits(block[name + "_scale_inv"], scales), key
        s = scales.repeat_interleave(128, 0)[: w.shape[0]].repeat_interleave(128, 1)
        s = s[:, : w.shape[1]]  # e4m3: 3 mantissa bits, subnormal step 2^-9 (times the scale)
        err = (block[name].float() * s - w.float()).abs()
        assert bool((err <= w.float().abs() / 16 + s * 2.0**-10).all()), key
    # norms pass through as bf16; nothing else is quantized
    assert same_bits(tensor[p + "input_layernorm.weight"], bf[p + "input_layernorm.weight"])
    assert sum(t.dtype == FP8 for t in tensor.values()) == 4


def test_requant_groups_counts_touched_blocks():
    shape = qv.tiny_shape()
    a = {n: t.to(torch.bfloat16) for n, t in qv.layer_state(qv.pretrained_start(shape, 4)).items()}
    b = {n: t.clone() for n, t in a.items()}
    w = b["model.layers.0.mlp.down_proj.weight"]  # (256, 704): blocks 2 x 6, the last 64 wide
    w[0, 700] = w[0, 700] * 2 + 1e-3
    r = qv.requant_groups(a, b, "online-fp8-block")
    assert r["groups_touched"] == 1 and r["elements_requantized"] == 128 * 64
    r = qv.requant_groups(a, b, "online-fp8-tensor")
    assert r == {"groups_total": 4, "groups_touched": 1, "elements_requantized": w.numel()}
    assert qv.requant_groups(a, a, "online-fp8-block")["groups_touched"] == 0
