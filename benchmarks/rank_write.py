#!/usr/bin/env python3
"""The engine pause on one rank: `RankReplica.write` against a bare `index_put_`, CPU, no engine.

The pause of an in-place apply is the rank's write: new bits into the engine's tensors, read back,
partial fingerprints of what is there now (the proof). This runs that write on a vLLM-style module
(fused ``qkv_proj`` and ``gate_up_proj``, TP=1, bf16) whose layout Stitch learns through its
``load_weights``, exactly as in an engine, at Qwen2.5 shapes, and times in the same process:

* **write (fused)**: `RankReplica.write` as shipped: on CPU one numba kernel per engine tensor
  (write, read back, hash: one pass for rising positions; stitch_core.engine.scatter);
* **write (torch path)**: the same write through the path accelerators and wider engine dtypes
  take (torch ``index_put_``, a gather back, a hash pass), by switching the fused kernel off;
* **bare index_put_**: ``stitch_dev.rank_baseline``: the same elements at the same engine
  positions, nothing else (best of 5).

Changed positions are a uniform random subset of every tensor (AdamW's changes at RL learning
rates look like that to a scatter); new bits are the old ones +-1 ULP. Each write's deltas are
checked against fingerprints of the served view before and after. No vLLM import (vLLM's own
re-pack of packed CPU layouts, `on_dirty`, is not part of this figure: benchmarks/engine_apply.py
measures it in a real engine).

    .venv/bin/python benchmarks/rank_write.py [--sizes 0.5b,1.5b] [--fractions ...] [--md FILE]
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from adam_data import HEAD_DIM, ModelShape  # noqa: E402

from stitch_core.engine import scatter  # noqa: E402
from stitch_core.engine.replica import RankReplica  # noqa: E402
from stitch_core.format import dtypes  # noqa: E402
from stitch_core.format import fingerprint as fpr  # noqa: E402
from stitch_dev.rank_baseline import Baseline, baseline  # noqa: E402

SIZES = {  # Qwen2.5 shapes (untied lm_head); "smoke" checks the script in seconds
    "smoke": ModelShape(hidden=128, intermediate=384, layers=2, vocab=1000, heads=2, kv_heads=1),
    "0.5b": ModelShape(hidden=896, intermediate=4864, layers=24, vocab=151936, heads=14,
                       kv_heads=2),
    "1.5b": ModelShape(hidden=1536, intermediate=8960, layers=28, vocab=151936, heads=12,
                       kv_heads=2),
}


class FusedEngine(nn.Module):
    """vLLM's Qwen2 parameter layout at TP=1: q/k/v and gate/up fused, loaded by load_weights."""

    def __init__(self, s: ModelShape):
        super().__init__()
        self.s = s
        h, q, kv, f = s.hidden, s.heads * HEAD_DIM, s.kv_heads * HEAD_DIM, s.intermediate
        p = lambda *shape: nn.Parameter(torch.zeros(*shape, dtype=torch.bfloat16),  # noqa: E731
                                        requires_grad=False)
        self.model = nn.Module()  # engine parameter names as vLLM's: model.layers.N....
        self.model.embed_tokens = p(s.vocab, h)
        self.model.layers = nn.ModuleList()
        for _ in range(s.layers):
            lay = nn.Module()
            lay.input_layernorm, lay.post_attention_layernorm = p(h), p(h)
            lay.qkv_proj, lay.o_proj = p(q + 2 * kv, h), p(h, q)
            lay.gate_up_proj, lay.down_proj = p(2 * f, h), p(h, f)
            self.model.layers.append(lay)
        self.model.norm, self.lm_head = p(h), p(s.vocab, h)

    def load_weights(self, weights):
        s = self.s
        q, kv, f = s.heads * HEAD_DIM, s.kv_heads * HEAD_DIM, s.intermediate
        for name, t in weights:
            if not name.startswith("model.layers."):
                dst = {"model.embed_tokens.weight": self.model.embed_tokens,
                       "model.norm.weight": self.model.norm, "lm_head.weight": self.lm_head}[name]
                dst.data.copy_(t)
                continue
            i, rest = name[len("model.layers."):].split(".", 1)
            lay = self.model.layers[int(i)]
            fused = {"self_attn.q_proj.weight": (lay.qkv_proj, 0, q),
                     "self_attn.k_proj.weight": (lay.qkv_proj, q, kv),
                     "self_attn.v_proj.weight": (lay.qkv_proj, q + kv, kv),
                     "mlp.gate_proj.weight": (lay.gate_up_proj, 0, f),
                     "mlp.up_proj.weight": (lay.gate_up_proj, f, f)}
            if rest in fused:
                dst, off, n = fused[rest]
                dst.data[off:off + n].copy_(t)
            else:
                dst = {"input_layernorm.weight": lay.input_layernorm,
                       "post_attention_layernorm.weight": lay.post_attention_layernorm,
                       "self_attn.o_proj.weight": lay.o_proj,
                       "mlp.down_proj.weight": lay.down_proj}[rest]
                dst.data.copy_(t)


def served(s: ModelShape, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for n, shape in s.shapes().items():
        t = torch.randn(shape, generator=g) * (0.01 if len(shape) == 1 else 0.02)
        out[n] = (t + (1.0 if len(shape) == 1 else 0.0)).to(torch.bfloat16)
    return out


def edits(view: dict[str, torch.Tensor], frac: float, rng: np.random.Generator):
    """Per tensor: sorted random positions (a fraction `frac`) and their bits +-1 ULP."""
    pos, vals = {}, {}
    for n, t in view.items():
        k = max(1, int(round(t.numel() * frac)))
        p = np.sort(rng.choice(t.numel(), k, replace=False)).astype(np.int64)
        old = dtypes.int_view(t).numpy()[p].astype(np.int64)
        new = old + np.where(rng.random(k) < 0.5, 1, -1)
        new = np.where((old & 0x7F80) == 0x7F80, old, new)  # keep inf/nan codes out of it
        pos[n], vals[n] = p, new.astype(np.int16)
    return pos, vals


def expected_deltas(view, pos, vals) -> dict[str, int]:
    out = {}
    for n, p in pos.items():
        pt = torch.from_numpy(p)
        old = dtypes.int_view(view[n])[pt]
        out[n] = (fpr.sum_at(n, pt, torch.from_numpy(vals[n]), 2)
                  - fpr.sum_at(n, pt, old, 2)) & fpr.MASK64
    return out


def one_write(rep: RankReplica, view, pos, vals, tag: str) -> tuple[float, float, float]:
    """(gather s, write s, bare index_put_ s) of one apply, undone afterwards."""
    rep.gather(tag, pos)  # plan + old sums (outside the pause)
    t0 = time.perf_counter()
    g = rep.gather(tag, pos)
    t_gather = time.perf_counter() - t0
    del g
    w = rep.write(tag, vals)
    want = expected_deltas(view, pos, vals)
    if w.delta != want:
        bad = [n for n in want if w.delta.get(n) != want[n]]
        raise SystemExit(f"{tag}: write deltas differ from the served view's for {bad[:3]}")
    base = baseline(rep, Baseline(5)).index_put_s
    rep.undo(tag)
    return t_gather, w.seconds, base


def run_size(name: str, fractions: list[float], reps: int) -> list[list[str]]:
    s = SIZES[name]
    t0 = time.perf_counter()
    view = served(s, 0)
    eng = FusedEngine(s)
    eng.load_weights(view.items())
    rep = RankReplica(eng)
    rep.setup({n: (tuple(t.shape), "BF16") for n, t in view.items()})
    n_params = sum(t.numel() for t in view.values())
    print(f"{name}: {n_params / 1e6:.0f}M params, set up in {time.perf_counter() - t0:.1f} s",
          flush=True)
    rng = np.random.default_rng(1)
    rows = []
    for frac in fractions:
        pos, vals = edits(view, frac, rng)
        k = sum(len(p) for p in pos.values())
        res = {}
        for mode in ("fused", "torch"):
            real = scatter.fused
            if mode == "torch":
                scatter.fused = lambda *a: False
            try:
                runs = [one_write(rep, view, pos, vals, f"{mode}{i}") for i in range(reps)]
            finally:
                scatter.fused = real
            res[mode] = min(r[1] for r in runs), min(r[2] for r in runs), min(r[0] for r in runs)
        wf, bf, gather_s = res["fused"]
        wt, bt, _ = res["torch"]
        base = min(bf, bt)
        rows.append([name, f"{n_params / 1e6:.0f}M", f"{100 * frac:g}%", f"{k:,}",
                     f"{gather_s * 1e3:.1f}", f"**{wf * 1e3:.1f}**", f"{wt * 1e3:.1f}",
                     f"**{base * 1e3:.1f}**", f"**{wf / base:.2f}x**", f"{wt / base:.2f}x",
                     f"{wf / k * 1e9:.1f}", f"{base / k * 1e9:.1f}"])
        print(" | ".join(rows[-1]), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--sizes", default="0.5b,1.5b")
    ap.add_argument("--fractions", default="0.002,0.007,0.05",
                    help="changed fraction of every tensor (0.2%%, 0.7%%: bf16 at lr 1e-6 and "
                    "3e-6 on real weights; 5%%: a large step)")
    ap.add_argument("--reps", type=int, default=3, help="writes per case (min kept)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--md", type=Path)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    t0 = time.perf_counter()
    rows = []
    for name in a.sizes.split(","):
        rows += run_size(name, [float(x) for x in a.fractions.split(",")], a.reps)
    head = ["model", "params", "changed", "elements", "gather ms", "write (fused) ms",
            "write (torch path) ms", "bare index_put_ ms", "fused / index_put_",
            "torch path / index_put_", "fused ns/elem", "index_put_ ns/elem"]
    table = "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
                      + ["| " + " | ".join(r) + " |" for r in rows])
    info = Path("/proc/cpuinfo")
    lines = info.read_text().splitlines() if info.exists() else []
    names = [ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")]
    cpu = names[0] if names else platform.machine()
    text = (f"# Rank write (the engine pause) vs bare index_put_\n\nGenerated by "
            f"`benchmarks/rank_write.py {' '.join(sys.argv[1:] if argv is None else argv)}` "
            f"(read its docstring for the method).\n\nMachine: {cpu}, torch "
            f"{torch.__version__}, torch threads {a.threads}; total {time.perf_counter() - t0:.0f}"
            f" s. Each figure is the best of {a.reps} writes (each undone after); the bare "
            f"index_put_ is the best of 5 per write.\n\n{table}\n")
    print(text)
    if a.md:
        a.md.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
