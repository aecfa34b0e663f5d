#!/usr/bin/env python3
"""Layout learning's transient memory on one tensor-parallel rank: row/column ids vs the full index.

One rank (rank 0 of TP) of an engine-style model at real shapes (a vocab-parallel embedding and
lm_head with padded rows, fused qkv and gate/up column-parallel, o and down row-parallel,
replicated norms; the loaders narrow each HF tensor to the rank's slice, as vLLM's and SGLang's
do), one decoder layer (layer templates learn one layer of each kind and copy its map to the
others) plus the embedding/lm_head group. Each (shape, TP, way) runs in a fresh process:
`learn_layout(..., split_index=True)` (two loads of row and column ids, the default on a sharded
rank) against `split_index=False` (the full HF-shaped index every rank loaded before). Reported:
the bytes of shadows and index tensors learning held at once (`Layout.learn_bytes`), the
process's peak resident memory above its memory before learning (the model's own weights
excluded), and the time. The two maps are compared (equal, or the run fails).

    .venv/bin/python benchmarks/layout_memory.py [--cases q05b:1,q7b:2,q7b:8,l70b:8] [--md FILE]

(SHAPE:TP pairs; a 70B rank at TP=1 would need ~30 GB, more than this 24 GiB box.)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# (vocab, hidden, intermediate, heads, kv heads): Qwen2.5-7B, Llama-3-70B
SHAPES = {"q05b": (151936, 896, 4864, 14, 2), "q7b": (152064, 3584, 18944, 28, 4),
          "l70b": (128256, 8192, 28672, 64, 8)}


def _engine(shape: str, tp: int):
    import torch
    from torch import nn

    vocab, d, f, heads, kvh = SHAPES[shape]
    hd = d // heads
    q, kv = d // tp, max(kvh // tp, 1) * hd
    vr = -(-vocab // (64 * tp)) * 64  # this rank's vocab rows, padded

    class Rank(nn.Module):
        def __init__(self):
            super().__init__()
            p = lambda *s: nn.Parameter(torch.zeros(*s, dtype=torch.bfloat16),  # noqa: E731
                                        requires_grad=False)
            self.embed, self.lm_head, self.norm = p(vr, d), p(vr, d), p(d)
            self.layers = nn.ModuleList([nn.Module()])
            lay = self.layers[0]
            lay.qkv, lay.o, lay.gate_up, lay.down = p(q + 2 * kv, d), p(d, q), p(2 * f // tp, d), \
                p(d, f // tp)
            lay.ln1, lay.ln2 = p(d), p(d)

        def load_weights(self, weights):
            lay = self.layers[0]
            for name, t in weights:
                part = name.split(".")[-2]
                if part in ("embed_tokens", "lm_head"):
                    dst = self.embed if part == "embed_tokens" else self.lm_head
                    rows = t[:vr][: min(vr, vocab)]
                    dst.data[: rows.shape[0]].copy_(rows)
                    dst.data[rows.shape[0]:].zero_()
                elif part in ("q_proj", "k_proj", "v_proj"):
                    off, n = {"q_proj": (0, q), "k_proj": (q, kv), "v_proj": (q + kv, kv)}[part]
                    lay.qkv.data[off:off + n].copy_(t.narrow(0, 0, n))
                elif part == "o_proj":
                    lay.o.data.copy_(t.narrow(1, 0, q))
                elif part in ("gate_proj", "up_proj"):
                    off = 0 if part == "gate_proj" else f // tp
                    lay.gate_up.data[off:off + f // tp].copy_(t.narrow(0, 0, f // tp))
                elif part == "down_proj":
                    lay.down.data.copy_(t.narrow(1, 0, f // tp))
                elif part == "norm":
                    self.norm.data.copy_(t)
                elif part in ("input_layernorm", "post_attention_layernorm"):
                    (lay.ln1 if part == "input_layernorm" else lay.ln2).data.copy_(t)
            return None

    hf = {"model.embed_tokens.weight": (vocab, d), "lm_head.weight": (vocab, d),
          "model.norm.weight": (d,)}
    pre = "model.layers.0."
    hf.update({pre + "self_attn.q_proj.weight": (d, d),
               pre + "self_attn.k_proj.weight": (kvh * hd, d),
               pre + "self_attn.v_proj.weight": (kvh * hd, d),
               pre + "self_attn.o_proj.weight": (d, d), pre + "mlp.gate_proj.weight": (f, d),
               pre + "mlp.up_proj.weight": (f, d), pre + "mlp.down_proj.weight": (d, f),
               pre + "input_layernorm.weight": (d,), pre + "post_attention_layernorm.weight": (d,)})
    return Rank(), {n: (s, torch.bfloat16) for n, s in hf.items()}


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child(shape: str, tp: int, split: bool, out: str) -> None:
    import numpy as np
    import torch

    from stitch_core.engine.layout import learn_layout

    torch.set_num_threads(1)
    model, hf = _engine(shape, tp)
    before = _rss()
    t0 = time.perf_counter()
    lay = learn_layout(model, hf, split_index=split)
    secs = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    runs = {n: [(s.param, s.hf_start.tolist()[:4], int(s.n_elems)) for s in t.segments]
            for n, t in lay.tensors.items()}
    digest = {n: [int(np.int64(s.hf_start.sum() + s.eng_start.sum() + s.length.sum()))
                  for s in t.segments] for n, t in lay.tensors.items()}
    Path(out).write_text(json.dumps({
        "learn_bytes": lay.learn_bytes, "seconds": secs, "peak_above": peak - before,
        "full_groups": lay.full_index_groups, "runs": runs, "digest": digest,
        "rank_elements": sum(p.numel() for p in model.parameters()),
        "hf_elements": sum(int(np.prod(s)) for s, _ in hf.values())}))


def measure(shape: str, tp: int, split: bool, tmp: Path) -> dict:
    out = tmp / f"{shape}-{tp}-{int(split)}.json"
    subprocess.run([sys.executable, __file__, "--child", shape, str(tp), str(int(split)),
                    str(out)], check=True)
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="q05b:1,q7b:2,q7b:8,l70b:8")
    ap.add_argument("--md", type=Path, default=None)
    ap.add_argument("--child", nargs=4, default=None)
    a = ap.parse_args()
    if a.child:
        shape, tp, split, out = a.child
        child(shape, int(tp), split == "1", out)
        return
    import tempfile

    import torch

    gb = 1e9
    rows = []
    with tempfile.TemporaryDirectory() as td:
        for case in a.cases.split(","):
            shape, tp_s = case.split(":")
            tp = int(tp_s)
            full = measure(shape, tp, False, Path(td))
            split = measure(shape, tp, True, Path(td))
            assert split["digest"] == full["digest"] and split["runs"] == full["runs"], \
                f"{shape} tp{tp}: the two ways learned different maps"
            assert split["full_groups"] == [] and full["full_groups"], (shape, tp)
            rows.append(
                f"| {shape} | {tp} | {split['rank_elements'] / 1e9:.3f}B | "
                f"{full['learn_bytes'] / gb:.2f} | **{split['learn_bytes'] / gb:.2f}** | "
                f"{split['learn_bytes'] / full['learn_bytes']:.2f}x | "
                f"{full['peak_above'] / gb:.2f} | {split['peak_above'] / gb:.2f} | "
                f"{full['seconds']:.2f} | {split['seconds']:.2f} |")
            print(rows[-1], flush=True)
    head = (
        "# Layout learning's transient memory on one TP rank: row/column ids vs the full index\n\n"
        f"`benchmarks/layout_memory.py --cases {a.cases}`; "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {platform.machine()} "
        f"{os.cpu_count()} CPUs, torch {torch.__version__}, one torch thread. Rank 0 of TP, "
        "the embedding + lm_head group and one decoder layer (templates copy its map to the "
        "others); both ways learned the same map (checked).\n\n"
        "| shape | TP | rank's elements | full index: learning bytes GB | row/col ids: learning "
        "bytes GB | ratio | full: peak RSS above start GB | row/col: peak RSS above start GB | "
        "full s | row/col s |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
    text = head + "\n".join(rows) + "\n"
    print(text)
    if a.md:
        a.md.write_text(text)


if __name__ == "__main__":
    main()
