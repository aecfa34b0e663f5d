#!/usr/bin/env python3
"""What a position model conditioned on the old served value would save, and what it would cost
to decode: the evidence behind the format's choice of context-free gaps (docs/format.md §8).

Stitch codes a chunk's positions as gaps with no context: about the zero-order bound
`log2 C(n, k)` (positions as a random subset). Whether an element flips, though, depends on its
old value: under Adam every weight moves by about the learning rate, and a bf16 value flips only
when that crosses its rounding step, which its exponent sets (|w| / 128). Both sides know the old
view, so a coder could spend fewer bits on the small-exponent elements that flip often and more on
the rest. This script measures, on pretrained-like masters (benchmarks/squash.py
`pretrained_like`: Student-t(4) values, per-row and per-column scales, outlier channels, Zipf-
ranked embedding rows) after warm AdamW steps, per learning rate:

* ours: the position bytes of Stitch's own patch (`PatchBuilder` chunks' `pos_bytes`);
* the zero-order bound `sum log2 C(n, k)` per tensor;
* by exponent: `sum over exponents e of log2 C(n_e, k_e)` plus the class counts (an ideal
  two-part code: what a per-exponent model can reach), and the same by row;
* the decode cost such a model adds: the reader must know the class of every *unchanged* element
  to place the changed ones, i.e. a pass over the whole old tensor. Timed here as one numba pass
  that computes each element's class and counts it (the least such a decoder does), next to a
  bare `index_put_` of the changed elements and Stitch's fused decode+apply of the same patch.

    .venv/bin/python benchmarks/position_models.py [--params 20e6] [--md results/position_models.md]
"""

from __future__ import annotations

import argparse
import math
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent))

from adam_data import Gradients, shape_for  # noqa: E402
from bench_timing import best  # noqa: E402
from squash import pretrained_like  # noqa: E402

import stitch_core  # noqa: E402
from stitch_core._jit import numba  # noqa: E402
from stitch_core.format import fingerprint as fpr  # noqa: E402


def log2_binom(n: np.ndarray, k: np.ndarray) -> float:
    n, k = np.asarray(n, np.float64), np.asarray(k, np.float64)
    lg = np.vectorize(math.lgamma)
    return float(((lg(n + 1) - lg(k + 1) - lg(n - k + 1)) / math.log(2)).sum())


def class_count_bits(n: np.ndarray) -> float:
    """Bits to send each used class's changed count (log2 of its possible values)."""
    return float(np.log2(np.asarray(n, np.float64)[np.asarray(n) > 0] + 1).sum())


@numba.njit(cache=True, nogil=True)
def _class_pass(flat, shift, mask, counts):  # pragma: no cover - compiled
    """The least a value-conditioned position decoder does: each element's class, counted."""
    for i in range(flat.shape[0]):
        counts[(flat[i] >> shift) & mask] += 1


def steps(lr: float, params: float, warm: int, seed: int = 0):
    """(old, new) bf16 views of the 2-D weights around one AdamW step after `warm` steps."""
    m = pretrained_like(params, seed)
    for t in m.values():
        t.requires_grad_(True)
    opt = torch.optim.AdamW(m.values(), lr=lr, betas=(0.9, 0.999), weight_decay=0.01)
    grads = Gradients(m, shape_for(params).vocab, seed)

    def step() -> None:
        grads.step(m)
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(warm):
        step()
    old = {k: v.detach().to(torch.bfloat16) for k, v in m.items() if v.dim() == 2}
    step()
    new = {k: v.detach().to(torch.bfloat16) for k, v in m.items() if v.dim() == 2}
    return old, new


def measure(lr: float, params: float, warm: int) -> dict:
    old, new = steps(lr, params, warm)
    r = dict(lr=lr, k=0, n=0, zero=0.0, exp=0.0, row=0.0)
    edits = {}
    for name, a in old.items():
        ai, bi = a.view(torch.int16), new[name].view(torch.int16)
        ch = (ai != bi).numpy()
        k = int(ch.sum())
        r["k"] += k
        r["n"] += ch.size
        r["zero"] += log2_binom(ch.size, k)
        e = (ai.numpy().astype(np.int32) >> 7) & 0xFF
        ne = np.bincount(e.ravel(), minlength=256)
        ke = np.bincount(e.ravel(), weights=ch.ravel(), minlength=256)
        r["exp"] += log2_binom(ne, ke) + class_count_bits(ne)
        nr = np.full(a.shape[0], a.shape[1])
        r["row"] += log2_binom(nr, ch.sum(1)) + class_count_bits(nr)
        idx = torch.from_numpy(np.flatnonzero(ch))
        edits[name] = (idx, new[name].reshape(-1)[idx])
    fps = fpr.state_fingerprints(old)
    patch = stitch_core.diff(old, new, base_fingerprints=fps)
    r["ours"] = 8.0 * sum(c.pos_bytes for e in patch.header.tensors for c in e.chunks)
    # decode-side costs, one thread, min of 3, each in-place run on a fresh clone of the old view
    torch.set_num_threads(1)
    flats = [a.reshape(-1).view(torch.int16).numpy() for a in old.values()]
    counts = np.zeros(256, np.int64)
    _class_pass(flats[0][:1024], 7, 0xFF, counts)  # compile / load
    r["class_pass_ms"] = 1e3 * best(lambda: [_class_pass(f, 7, 0xFF, counts) for f in flats])

    def put(base: dict[str, torch.Tensor]) -> None:
        for name, (i, v) in edits.items():
            base[name].reshape(-1).index_put_((i,), v)

    def ours(base: dict[str, torch.Tensor]) -> None:
        stitch_core.apply(base, patch, base_fingerprints=fps, inplace=True)

    for key, fn in (("index_put_ms", put), ("apply_ms", ours)):
        times = []
        for _ in range(3):
            arg = {k: v.clone() for k, v in old.items()}
            t0 = time.perf_counter()
            fn(arg)
            times.append(time.perf_counter() - t0)
            assert all(torch.equal(arg[k].view(torch.int16), new[k].view(torch.int16))
                       for k in new), key
        r[key] = 1e3 * min(times)
    return r


def report(rows: list[dict], args: argparse.Namespace) -> str:
    head = (f"# Position models on pretrained-like weights (`benchmarks/position_models.py`)\n\n"
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
            f"{platform.processor() or platform.machine()}, "
            f"torch {torch.__version__}, one thread; {args.params:.0e}-parameter shape "
            f"(2-D weights only), {args.warm} warm AdamW steps, then one measured step.\n\n")
    t1 = ["| lr | changed | ours bits/changed | zero-order bound | ours / bound | by exponent "
          "(ideal) | by exponent / bound | by row (ideal) | by row / bound |",
          "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    t2 = ["| lr | changed elements | bare `index_put_` ms | Stitch decode+apply ms | "
          "class pass over the old view ms | class pass / `index_put_` |",
          "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        k = r["k"]
        t1.append(f"| {r['lr']:.0e} | {100 * k / r['n']:.3f}% | {r['ours'] / k:.3f} | "
                  f"{r['zero'] / k:.3f} | {r['ours'] / r['zero']:.3f}x | {r['exp'] / k:.3f} | "
                  f"**{r['exp'] / r['zero']:.3f}x** | {r['row'] / k:.3f} | "
                  f"{r['row'] / r['zero']:.3f}x |")
        t2.append(f"| {r['lr']:.0e} | {k:,} | {r['index_put_ms']:.1f} | "
                  f"{r['apply_ms']:.1f} | {r['class_pass_ms']:.1f} | "
                  f"**{r['class_pass_ms'] / r['index_put_ms']:.1f}x** |")
    return (head + "Position bits per changed element:\n\n" + "\n".join(t1) +
            "\n\nDecode side (ms; Stitch's decode+apply in place, as the codec benchmark):\n\n"
            + "\n".join(t2) +
            "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=float, default=20e6)
    ap.add_argument("--warm", type=int, default=10)
    ap.add_argument("--lrs", default="1e-6,3e-6,1e-5")
    ap.add_argument("--md", type=Path)
    args = ap.parse_args()
    rows = []
    for lr in (float(x) for x in args.lrs.split(",")):
        rows.append(measure(lr, args.params, args.warm))
        print(f"lr {lr:.0e} done", file=sys.stderr)
    md = report(rows, args)
    print(md)
    if args.md:
        args.md.write_text(md)


if __name__ == "__main__":
    main()
