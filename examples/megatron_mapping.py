"""Megatron-core shards -> HF positions, on CPU, with a tiny random Qwen2-shaped model.

    python examples/megatron_mapping.py

1. the table and the placements of one rank's fused QKV;
2. HF -> Megatron shards (TP=2, PP=2) and back, bitwise;
3. a training step changes some elements on every rank: each rank names its changed elements
   by global HF flat position (no gather), and the union equals the gathered diff;
4. a multi-part patch written by the ranks of a TP=1, PP=2 job, applied to the gathered base.
"""

from __future__ import annotations

import io

import torch

from stitch_core.format import dtypes
from stitch_core.format.patch import PatchBuilder, apply
from stitch_trainer.megatron.convert import assemble_hf, split_hf
from stitch_trainer.megatron.layout import MegatronLayout
from stitch_trainer.megatron.shards import add_part, shard_parts

CONFIG = dict(model_type="qwen2", vocab_size=203, hidden_size=32, intermediate_size=48,
              num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
              tie_word_embeddings=False)


def random_hf(layout: MegatronLayout, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g).bfloat16() for k, s in layout.hf_shapes().items()}


def step(shards: dict, layout: MegatronLayout, seed: int = 1) -> dict:
    """A fake optimizer step: ~2% of elements move; replicas move like their owner's copy."""
    g = torch.Generator().manual_seed(seed)
    new = {r: {k: v.clone() for k, v in sd.items()} for r, sd in shards.items()}
    for (t, p), sd in sorted(new.items()):
        for name, v in sd.items():
            placed = layout.to_hf(name, t, p)
            if placed and not placed[0].owned:
                v.copy_(new[(0, p)][name])
            else:
                v[torch.rand(v.shape, generator=g) < 0.02] += 0.5
    return new


def main() -> None:
    lay = MegatronLayout.from_hf_config(CONFIG, tp=2, pp=2)
    print(lay)
    print("\nqwen2 table:")
    for r in lay.rules:
        print(f"  {r.megatron:58} {r.kind:10} -> {', '.join(r.hf)}")

    qkv = "decoder.layers.1.self_attention.linear_qkv.weight"
    print(f"\n{qkv} on (tp=1, pp=1) is global layer {lay.layer_offset(1) + 1}:")
    for p in lay.to_hf(qkv, 1, 1):
        print(f"  local rows {p.local_row}+{p.local_stride}*j+[0,{p.rows}) j<{p.runs} -> "
              f"{p.hf_name} rows {p.hf_row}+{p.hf_stride}*j")

    hf = random_hf(lay)
    shards = split_hf(hf, lay)
    assert all(torch.equal(assemble_hf(shards, lay)[k], hf[k]) for k in hf)
    print(f"\nsplit into {len(shards)} ranks and gathered back bitwise")

    new = step(shards, lay)
    found = 0
    for (t, p), sd in new.items():
        for name, v in sd.items():
            changed = torch.nonzero(dtypes.int_view(shards[(t, p)][name]) != dtypes.int_view(v))
            for _, pos in lay.map_positions(name, t, p, changed.reshape(-1)).items():
                found += pos.numel()
    a, b = assemble_hf(shards, lay), assemble_hf(new, lay)
    want = sum(int((dtypes.int_view(a[k]) != dtypes.int_view(b[k])).sum()) for k in a)
    print(f"changed HF elements named by the ranks: {found}, by the gathered diff: {want}")
    assert found == want

    parts = [x for x in shard_parts(shards[(1, 0)], new[(1, 0)], lay, 1, 0) if x.scattered]
    print(f"rank (1, 0): {len(parts)} row-parallel tensors come as scattered positions "
          f"(PatchBuilder.add_positions), the rest as contiguous slices (PatchBuilder.add)")

    pp_lay = MegatronLayout.from_hf_config(CONFIG, tp=1, pp=2)
    old_s = split_hf(hf, pp_lay)
    new_s = step(old_s, pp_lay, seed=2)
    builders, bufs = [], []
    for r in sorted(old_s):
        buf = io.BytesIO()
        pb = PatchBuilder(buf, run="example", base_version=1, target_version=2)
        for part in shard_parts(old_s[r], new_s[r], pp_lay, *r):
            add_part(pb, part)
        builders.append(pb)
        bufs.append(buf)
    totals: dict[str, tuple[int, int]] = {}
    for pb in builders:  # an all-reduce (sum mod 2^64) in a real job
        for name, (fb, ft) in pb.partial_fingerprints().items():
            tb, tt = totals.get(name, (0, 0))
            totals[name] = ((tb + fb) % 2**64, (tt + ft) % 2**64)
    for i, pb in enumerate(builders):
        pb.finish(totals=totals, part=(i, len(builders)))
    out = apply(assemble_hf(old_s, pp_lay), [buf.getvalue() for buf in bufs])
    target = assemble_hf(new_s, pp_lay)
    assert all(torch.equal(out[k], target[k]) for k in target)
    print(f"TP=1, PP=2: {len(bufs)}-part patch ({sum(len(x.getvalue()) for x in bufs)} bytes) "
          "applied to the gathered base gives the gathered new version bitwise")


if __name__ == "__main__":
    main()
