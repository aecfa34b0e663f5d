"""Megatron-core TP/PP shards <-> HF layout: split, gather, position mapping, shard-local diffs."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
import transformers

from stitch_core.format import dtypes
from stitch_core.format import fingerprint as fpr
from stitch_core.format.patch import PatchBuilder, apply
from stitch_trainer.megatron.convert import assemble_hf, split_hf
from stitch_trainer.megatron.layout import MegatronLayout
from stitch_trainer.megatron.shards import add_part, merge_scattered, shard_parts
from stitch_trainer.megatron.tables import ARCHS, LLAMA, register_arch, rule

# tiny GQA models: 8 query heads over 4 KV groups (2 per TP rank), vocab 203 (padded to 256)
SMALL = dict(vocab_size=203, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64)
MODELS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=False)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=False)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(tie_word_embeddings=True, head_dim=8)),
}
# (tp, pp, pipeline_layers)
PARALLEL = [(2, 1, None), (2, 2, (3, 1)), (1, 2, (1, 3))]
_CACHE: dict[str, tuple] = {}


def hf_model(arch: str):
    """(config, HF state dict) of a tiny random model; tied duplicates dropped, values random
    (norms too) so a misplaced element shows."""
    if arch not in _CACHE:
        cfg_cls, model_cls, extra = MODELS[arch]
        cfg = getattr(transformers, cfg_cls)(**SMALL, **extra)
        torch.manual_seed(0)
        model = getattr(transformers, model_cls)(cfg)
        g = torch.Generator().manual_seed(1)
        sd = {k: torch.randn(v.shape, generator=g) for k, v in model.state_dict().items()
              if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
        _CACHE[arch] = (cfg, sd)
    return _CACHE[arch]


def layout_of(arch: str, tp: int, pp: int, pl=None, **kw) -> MegatronLayout:
    cfg, _ = hf_model(arch)
    return MegatronLayout.from_hf_config(cfg, tp=tp, pp=pp, pipeline_layers=pl, **kw)


def bits(t: torch.Tensor) -> torch.Tensor:
    return dtypes.int_view(t)


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(bits(a[k]), bits(b[k])) for k in a)


CASES = [(a, *p) for a in MODELS for p in PARALLEL]


# ------------------------------------------------------------------ tables and layout


def test_tables_cover_the_hf_models():
    for arch in MODELS:
        cfg, sd = hf_model(arch)
        lay = MegatronLayout.from_hf_config(cfg, tp=2, pp=2)
        assert {k: tuple(v.shape) for k, v in sd.items()} == lay.hf_shapes(), arch
    lay = layout_of("qwen2", 2, 1)
    assert (lay.arch, lay.padded_vocab, lay.head_dim, lay.num_kv_heads) == ("qwen2", 256, 4, 4)
    assert layout_of("qwen2", 1, 1).padded_vocab == 256  # multiple of 128 * tp


def test_layout_rejects_unshardable():
    cfg, _ = hf_model("llama")
    with pytest.raises(ValueError, match="num_kv_heads % tp"):
        MegatronLayout.from_hf_config(cfg, tp=8)
    with pytest.raises(ValueError, match="pipeline_layers"):
        MegatronLayout.from_hf_config(cfg, pp=3)
    with pytest.raises(ValueError, match="model_type"):
        MegatronLayout.from_hf_config({**cfg.to_dict(), "model_type": "gpt2"})


def test_register_arch_validates_and_extends():
    with pytest.raises(ValueError, match="needs 3 HF names"):
        register_arch("bad", [rule("decoder.layers.{L}.x.weight", "model.layers.{L}.x.weight",
                                   "qkv", ("qkv", "hidden"))])
    with pytest.raises(ValueError, match="{L}"):
        register_arch("bad", [rule("decoder.layers.{L}.x.weight", "x.weight", "column",
                                   ("hidden",))])
    extra = rule("decoder.layers.{L}.mlp.linear_fc1.bias",
                 ("model.layers.{L}.mlp.gate_proj.bias", "model.layers.{L}.mlp.up_proj.bias"),
                 "gate_up", ("ffn",))
    register_arch("llama_mlp_bias", [*LLAMA, extra], ("llama_mlp_bias_test",))
    try:
        cfg, sd = hf_model("llama")
        lay = MegatronLayout.from_hf_config({**cfg.to_dict(), "model_type":
                                             "llama_mlp_bias_test"}, tp=2)
        assert lay.hf_shapes()["model.layers.0.mlp.up_proj.bias"] == (48,)
        hf = {**sd, **{k: torch.randn(s) for k, s in lay.hf_shapes().items() if k not in sd}}
        assert same(assemble_hf(split_hf(hf, lay), lay), hf)
    finally:
        ARCHS.pop("llama_mlp_bias")


def test_names_offsets_and_specs():
    lay = layout_of("qwen3", 2, 2, (1, 3))
    p = lay.to_hf("module.decoder.layers.2.self_attention.q_layernorm.weight", 1, 1)
    assert [(x.hf_name, x.owned) for x in p] == [("model.layers.3.self_attn.q_norm.weight", False)]
    assert lay.to_hf("decoder.layers.0.mlp.linear_fc1._extra_state", 0, 0) == []
    # the local (non-TE) spec's separate norms map like the fused ones
    te = lay.to_hf("decoder.layers.0.mlp.linear_fc1.layer_norm_weight", 0, 1)
    local = lay.to_hf("decoder.layers.0.pre_mlp_layernorm.weight", 0, 1)
    assert te == local and te[0].hf_name == "model.layers.1.post_attention_layernorm.weight"
    # rank 1 holds KV groups 2, 3: per group [2 q heads; k head; v head] of head_dim 8
    q, k, v = lay.to_hf("decoder.layers.0.self_attention.linear_qkv.weight", 1, 1)
    assert (q.hf_name, q.local_row, q.rows, q.runs, q.local_stride, q.hf_row) == (
        "model.layers.1.self_attn.q_proj.weight", 0, 16, 2, 32, 32)
    assert (k.local_row, k.rows, k.hf_row, v.local_row, v.hf_row) == (16, 8, 16, 24, 16)
    assert q.hf_slice == (32 * 32, 2 * 16 * 32)  # contiguous in HF, strided locally
    for bad, pp in [("decoder.layers.1.mlp.linear_fc2.weight", 0),  # stage 0 has one layer
                    ("decoder.layers.0.mlp.nope.weight", 0),
                    ("embedding.word_embeddings.weight", 1)]:
        with pytest.raises(KeyError):
            lay.to_hf(bad, 0, pp)
    # tied embeddings: the last stage's output layer is a replica of the embedding
    (o,) = lay.to_hf("output_layer.weight", 0, 1)
    assert (o.hf_name, o.owned) == ("model.embed_tokens.weight", False)
    assert "output_layer.weight" not in layout_of("qwen3", 2, 1).megatron_shapes(0, 0)
    loc = layout_of("llama", 2, 1, spec="local").megatron_shapes(0, 0)
    assert "decoder.layers.0.input_layernorm.weight" in loc


# ------------------------------------------------------------------ split / assemble


def reference_split(hf: dict, lay: MegatronLayout, t: int, layer: int, arch: str) -> dict:
    """The conversion as Megatron-LM's tools/checkpoint (loader_llama_mistral + saver) and
    mbridge write it with torch.cat/chunk, independently of the placement tables."""
    ng, h, tp = lay.num_kv_heads, lay.hidden, lay.tp
    a = f"model.layers.{layer}.self_attn."
    m = f"model.layers.{layer}.mlp."

    def qkv(suffix: str) -> torch.Tensor:
        tail = (h,) if suffix == "weight" else ()
        parts = [hf[a + f"{x}_proj.{suffix}"].reshape(ng, -1, *tail) for x in "qkv"]
        return torch.cat(parts, dim=1).reshape(-1, *tail).chunk(tp)[t]

    gate, up = hf[m + "gate_proj.weight"].chunk(tp)[t], hf[m + "up_proj.weight"].chunk(tp)[t]
    out = {
        "self_attention.linear_qkv.weight": qkv("weight"),
        "self_attention.linear_proj.weight": hf[a + "o_proj.weight"].chunk(tp, dim=1)[t],
        "mlp.linear_fc1.weight": torch.cat([gate, up]),
        "mlp.linear_fc2.weight": hf[m + "down_proj.weight"].chunk(tp, dim=1)[t],
        "self_attention.linear_qkv.layer_norm_weight":
            hf[f"model.layers.{layer}.input_layernorm.weight"],
        "mlp.linear_fc1.layer_norm_weight":
            hf[f"model.layers.{layer}.post_attention_layernorm.weight"],
    }
    if arch == "qwen2":
        out["self_attention.linear_qkv.bias"] = qkv("bias")
    if arch == "qwen3":
        out["self_attention.q_layernorm.weight"] = hf[a + "q_norm.weight"]
        out["self_attention.k_layernorm.weight"] = hf[a + "k_norm.weight"]
    return out


@pytest.mark.parametrize("arch,tp,pp,pl", CASES)
def test_split_matches_reference_and_assembles_back(arch, tp, pp, pl):
    cfg, hf = hf_model(arch)
    lay = layout_of(arch, tp, pp, pl)
    shards = split_hf(hf, lay)
    assert sorted(shards) == [(t, p) for t in range(tp) for p in range(pp)]
    assert same(assemble_hf(shards, lay), hf)
    for (t, p), sd in shards.items():
        assert {k: tuple(v.shape) for k, v in sd.items()} == lay.megatron_shapes(t, p)
        for i in range(lay.pipeline_layers[p]):
            ref = reference_split(hf, lay, t, lay.layer_offset(p) + i, arch)
            got = {k: sd[f"decoder.layers.{i}.{k}"] for k in ref}
            assert same(got, ref), (t, p, i)
        n = lay.padded_vocab // tp
        padded = torch.cat([hf["model.embed_tokens.weight"],
                            torch.zeros(lay.padded_vocab - lay.vocab, lay.hidden)])
        if p == 0:
            assert torch.equal(sd["embedding.word_embeddings.weight"], padded[t * n:(t + 1) * n])
        if p == pp - 1:
            assert torch.equal(sd["decoder.final_layernorm.weight"], hf["model.norm.weight"])
            head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
            if "output_layer.weight" in sd:
                want = torch.cat([hf[head], torch.zeros(lay.padded_vocab - lay.vocab, lay.hidden)])
                assert torch.equal(sd["output_layer.weight"], want[t * n:(t + 1) * n])
            else:
                assert cfg.tie_word_embeddings and pp == 1


def test_assemble_rejects_bad_shards():
    _, hf = hf_model("qwen3")
    lay = layout_of("qwen3", 2, 2)
    shards = split_hf(hf, lay)
    with pytest.raises(ValueError, match="2400 elements unwritten"):  # rank 1's real vocab
        assemble_hf({k: v for k, v in shards.items() if k != (1, 0)}, lay)
    with pytest.raises(ValueError, match="no rank holds"):
        assemble_hf({k: v for k, v in shards.items() if k[1] == 0}, lay)
    bad = {k: dict(v) for k, v in shards.items()}
    bad[(1, 1)]["decoder.final_layernorm.weight"] = torch.zeros(lay.hidden)
    with pytest.raises(ValueError, match="replica"):
        assemble_hf(bad, lay)


# ------------------------------------------------------------------ position mapping


@pytest.mark.parametrize("arch,tp,pp,pl", CASES)
def test_map_positions_values_and_exact_cover(arch, tp, pp, pl):
    _, hf = hf_model(arch)
    lay = layout_of(arch, tp, pp, pl)
    shards = split_hf(hf, lay)
    hits = {k: torch.zeros(v.numel(), dtype=torch.int32) for k, v in hf.items()}
    dropped = 0
    for (t, p), sd in shards.items():
        for name, local in sd.items():
            flat = local.reshape(-1)
            mapped = lay.map_positions(name, t, p, torch.arange(flat.numel()), return_index=True)
            for hf_name, (pos, idx) in mapped.items():
                assert torch.equal(flat[idx], hf[hf_name].reshape(-1)[pos]), (name, t, p)
                assert bool((pos[1:] > pos[:-1]).all())  # sorted in, sorted out
                hits[hf_name] += torch.bincount(pos, minlength=hits[hf_name].numel()).int()
            n_mapped = sum(int(i.numel()) for _, i in mapped.values())
            if name.endswith(("word_embeddings.weight", "output_layer.weight")):
                rows = lay.padded_vocab // tp
                real = max(0, min(rows, lay.vocab - t * rows))
                assert n_mapped in (real * lay.hidden, 0)  # 0: tied replica
                dropped += flat.numel() - n_mapped
            elif n_mapped != flat.numel():
                assert n_mapped == 0 and t > 0  # a replica owned by TP rank 0
                # ... which still maps, value for value, when replicas are asked for
                for hf_name, pos in lay.map_positions(name, t, p, torch.arange(flat.numel()),
                                                       replicas=True).items():
                    assert torch.equal(flat, hf[hf_name].reshape(-1)[pos])
    assert all(bool((h == 1).all()) for h in hits.values())  # every HF element exactly once
    assert dropped >= lay.padded_vocab - lay.vocab


def test_padding_only_rank_and_numpy_positions():
    _, hf = hf_model("llama")
    lay = layout_of("llama", 2, 1, padded_vocab=512)  # rank 1's rows [256, 512) are all padding
    assert lay.to_hf("embedding.word_embeddings.weight", 1, 0) == []
    assert lay.map_positions("output_layer.weight", 1, 0, [0, 5]) == {}
    assert same(assemble_hf(split_hf(hf, lay), lay), hf)
    # default padding (256): rank 1 holds vocab rows 128..202 then 53 padding rows
    emb = layout_of("llama", 2, 1).map_positions("embedding.word_embeddings.weight", 1, 0,
                                                  [75 * 32 - 1, 75 * 32, 128 * 32 - 1])
    assert emb["model.embed_tokens.weight"].tolist() == [203 * 32 - 1]
    got = lay.map_positions("decoder.layers.0.self_attention.linear_proj.weight", 1, 0,
                            np.array([0, 15, 16]))
    # local (32, 16) columns of rank 1 are HF columns 16..31 of o_proj (32, 32)
    assert got["model.layers.0.self_attn.o_proj.weight"].tolist() == [16, 31, 48]


def perturb(shards: dict, lay: MegatronLayout, seed: int) -> dict:
    """Change ~3% of elements on every rank, padding included; replicas (replicated tensors on
    TP ranks > 0, a tied output layer) change like their owner's copy, as in training."""
    g = torch.Generator().manual_seed(seed)
    new = {r: {k: v.clone() for k, v in sd.items()} for r, sd in shards.items()}
    for (t, p), sd in sorted(new.items()):  # owners (tp 0, pp 0) come first
        for name, v in sd.items():
            placed = lay.to_hf(name, t, p)
            if name == "output_layer.weight" and lay.tie_embeddings:
                v.copy_(new[(t, 0)]["embedding.word_embeddings.weight"])
            elif placed and not placed[0].owned:
                v.copy_(new[(0, p)][name])
            else:
                v[torch.rand(v.shape, generator=g) < 0.03] += 1.0
    return new


@pytest.mark.parametrize("arch,tp,pp,pl", CASES)
def test_changed_positions_match_gathered_diff(arch, tp, pp, pl):
    _, hf = hf_model(arch)
    lay = layout_of(arch, tp, pp, pl)
    old = split_hf(hf, lay)
    new = perturb(old, lay, seed=tp * 10 + pp)
    a, b = assemble_hf(old, lay), assemble_hf(new, lay)
    want = {k: torch.nonzero(bits(a[k]) != bits(b[k])).reshape(-1) for k in a}
    got: dict[str, list[torch.Tensor]] = {k: [] for k in a}
    for (t, p), sd in new.items():
        for name, v in sd.items():
            changed = torch.nonzero(bits(old[(t, p)][name]) != bits(v)).reshape(-1)
            for hf_name, pos in lay.map_positions(name, t, p, changed).items():
                got[hf_name].append(pos)
    for k in a:
        mine = torch.sort(torch.cat(got[k])).values if got[k] else torch.empty(0, dtype=torch.long)
        assert torch.equal(mine, want[k]), k
    assert sum(w.numel() for w in want.values()) > 0


# ------------------------------------------------------------------ shard-local patch parts


def bf16(shards: dict) -> dict:
    return {r: {k: v.bfloat16() for k, v in sd.items()} for r, sd in shards.items()}


@pytest.mark.parametrize("arch,tp,pp,pl", [("qwen2", 2, 2, None), ("qwen3", 2, 1, None),
                                           ("llama", 1, 2, (1, 3))])
def test_shard_parts_rebuild_the_hf_diff(arch, tp, pp, pl):
    _, hf = hf_model(arch)
    lay = layout_of(arch, tp, pp, pl)
    old = bf16(split_hf(hf, lay))
    new = bf16(perturb(split_hf(hf, lay), lay, seed=7))
    a, b = assemble_hf(old, lay), assemble_hf(new, lay)
    rebuilt = {k: bits(v).clone() for k, v in a.items()}
    base_fp = dict.fromkeys(a, 0)
    scattered: dict[str, list] = {}
    for (t, p) in old:
        parts = shard_parts(old[(t, p)], new[(t, p)], lay, t, p)
        assert [x.name for x in parts] == sorted(a)
        for x in parts:
            flat = rebuilt[x.name]
            if x.scattered:
                scattered.setdefault(x.name, []).append(x)
                assert bool((x.positions[1:] > x.positions[:-1]).all())
                assert torch.equal(flat[x.positions], x.old)
                flat[x.positions] = x.new_bits
                base_fp[x.name] += x.base_fp
            else:
                sl = slice(x.offset, x.offset + x.base.numel())
                assert torch.equal(flat[sl], bits(x.base))
                flat[sl] = bits(x.new)
                base_fp[x.name] += fpr.fingerprint(x.name, x.base, offset=x.offset)
    assert any(x.scattered for x in parts) == (tp > 1)
    for k in a:
        assert torch.equal(rebuilt[k], bits(b[k])), k
        assert base_fp[k] % 2**64 == fpr.fingerprint(k, a[k]), k
    for k, xs in scattered.items():  # one part per tensor, as gathered over the TP group
        assert len(xs) == tp
        m = merge_scattered(xs)
        assert torch.equal(m.positions, torch.nonzero(bits(a[k]) != bits(b[k])).reshape(-1))
        assert torch.equal(m.new_bits, bits(b[k])[m.positions])
        assert m.base_fp == fpr.fingerprint(k, a[k])
    if scattered:
        with pytest.raises(ValueError, match="same position"):
            merge_scattered([xs[0], xs[0]])


def multi_part_patch(old: dict, new: dict, lay: MegatronLayout) -> list[bytes]:
    """What each rank does: diff its shard into a part, all-reduce the partial fingerprints."""
    builders, bufs = [], []
    ranks = sorted(old)
    for r in ranks:
        buf = io.BytesIO()
        pb = PatchBuilder(buf, run="megatron", base_version=1, target_version=2, chunk_span=1024)
        for part in shard_parts(old[r], new[r], lay, *r):
            add_part(pb, part)
        builders.append(pb)
        bufs.append(buf)
    totals: dict[str, tuple[int, int]] = {}
    for pb in builders:
        for name, (fb, ft) in pb.partial_fingerprints().items():
            tb, tt = totals.get(name, (0, 0))
            totals[name] = ((tb + fb) % 2**64, (tt + ft) % 2**64)
    for i, pb in enumerate(builders):
        pb.finish(totals=totals, part=(i, len(ranks)))
    return [buf.getvalue() for buf in bufs]


@pytest.mark.parametrize("arch,tp,pp,pl", [
    ("llama", 1, 2, (1, 3)),
    ("qwen3", 1, 2, None),
    ("qwen2", 2, 2, None),
])
def test_multi_part_patch_from_megatron_ranks(arch, tp, pp, pl):
    _, hf = hf_model(arch)
    lay = layout_of(arch, tp, pp, pl)
    old = bf16(split_hf(hf, lay))
    new = bf16(perturb(split_hf(hf, lay), lay, seed=11))
    parts = multi_part_patch(old, new, lay)
    a, b = assemble_hf(old, lay), assemble_hf(new, lay)
    assert same(apply(a, parts), b)


def test_row_parallel_part_needs_core_api():
    _, hf = hf_model("llama")
    lay = layout_of("llama", 2, 1)
    old = bf16(split_hf(hf, lay))
    parts = shard_parts(old[(0, 0)], old[(0, 0)], lay, 0, 0)
    row = next(x for x in parts if x.scattered)
    assert row.name.endswith(("o_proj.weight", "down_proj.weight")) and row.positions.numel() == 0

    class Old:
        pass

    with pytest.raises(NotImplementedError, match="add_positions"):  # a builder without it
        add_part(Old(), row)
