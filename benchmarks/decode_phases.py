#!/usr/bin/env python3
"""Where decode+apply spends its time per changed element, phase by phase, against a bare
`index_put_` of the same elements: the floor the entropy coding sets under the apply target.

One bf16 matrix of `--params` elements with pretrained-like weights (`squash.pretrained_tensor`:
Student-t(4) at std 0.02) is moved by one Adam-like step per learning rate (every element by lr
times a unit-scale draw; the served bf16 view changes where the step crosses a rounding
boundary), diffed into a real patch (`PatchBuilder`), and applied in place with the fused CPU
kernel (`patch.apply`, what the codec benchmark times). Then each phase of that kernel runs on
its own over the same chunks, written here with the kernel's own building blocks
(`rans.rans_step`, `entropy.extra_step`, the fingerprint's element hash):

* positions: the gap stream's rANS tokens and extra bits, to absolute positions;
* old loads: each changed element's old bits (prefetched) and its value context;
* value tokens: the value stream's rANS tokens (contexts given) with their extra bits;
* value tokens without extra bits: the same, the rANS steps alone;
* write+fingerprint: the new bits stored and the fingerprint moved (two element hashes).

One thread, min of `--reps` per figure, ns per changed element.

    .venv/bin/python benchmarks/decode_phases.py [--params 22e6] [--lrs 1e-6,3e-6,1e-5] [--md F]
"""

from __future__ import annotations

import argparse
import io
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from squash import pretrained_tensor  # noqa: E402

from stitch_core._jit import numba, prefetch  # noqa: E402
from stitch_core.format import codec, entropy, rans  # noqa: E402
from stitch_core.format import fingerprint as fpr  # noqa: E402
from stitch_core.format.fingerprint import element_hash_nb as _h  # noqa: E402
from stitch_core.format.patch import PatchBuilder, apply  # noqa: E402
from stitch_core.format.stp import PatchReader  # noqa: E402

LAG = codec.LAG


@numba.njit(cache=True, nogil=True)
def positions(pos, start, pst):  # pragma: no cover - compiled
    prans, pn, pwords, pne, pfreq, pcum, plook, psb, planes = pst
    x0, x1, x2, x3, p = rans.rans_states(prans, pn, planes)
    bp = np.uint64(0)
    mask = np.uint64((1 << psb) - 1)
    last = np.int64(start - 1)
    for i in range(pos.shape[0]):
        s, xn, p = rans.rans_step(prans, p, x0, 0, pfreq, pcum, plook, mask, psb)
        x0, x1, x2, x3 = rans.rotate(x1, x2, x3, xn, planes)
        g, bp = entropy.extra_step(pwords, bp, s)
        last += np.int64(g) + 1
        pos[i] = last
    return p


@numba.njit(cache=True, nogil=True)
def old_loads(flat, pos, ctx, mant, old, cs):  # pragma: no cover - compiled
    cbase, cn, csign = ctx
    k = pos.shape[0]
    for j in range(k):
        if j + 16 < k:
            prefetch(flat, pos[j + 16])
        o = np.int64(flat[pos[j]])
        old[j] = o
        ub = o & 0xFFFF
        c = ((ub >> mant) & ((1 << (15 - mant)) - 1)) - cbase
        c = 0 if c < 0 else (cn - 1 if c > cn - 1 else c)
        if csign and (ub >> 15) & 1:
            c += cn
        cs[j] = c
    return 0


@numba.njit(cache=True, nogil=True)
def value_tokens(val, cs, out, extra):  # pragma: no cover - compiled
    vrans, vn, vwords, vne, vfreq, vcum, vlook, vsb, vlanes = val
    x0, x1, x2, x3, p = rans.rans_states(vrans, vn, vlanes)
    bp = np.uint64(0)
    mask = np.uint64((1 << vsb) - 1)
    for j in range(cs.shape[0]):
        s, xn, p = rans.rans_step(vrans, p, x0, cs[j], vfreq, vcum, vlook, mask, vsb)
        x0, x1, x2, x3 = rans.rotate(x1, x2, x3, xn, vlanes)
        if extra:
            u, bp = entropy.extra_step(vwords, bp, s)
            out[j] = u
        else:
            out[j] = s
    return p


@numba.njit(cache=True, nogil=True)
def write_fingerprint(flat, pos, old, new, seed):  # pragma: no cover - compiled
    acc = np.uint64(0)
    for j in range(pos.shape[0]):
        p = pos[j]
        flat[p] = new[j]
        acc += _h(p, np.int64(new[j]), seed, 2) - _h(p, old[j], seed, 2)
    return acc


def step(m: torch.Tensor, lr: float, g: torch.Generator) -> torch.Tensor:
    return m + lr * torch.randn(m.shape, generator=g)


def measure(lr: float, params: int, reps: int) -> dict[str, float]:
    g = torch.Generator().manual_seed(0)
    cols = 4096
    m = pretrained_tensor("w", (params // cols, cols), g)
    a, b = m.bfloat16(), step(m, lr, g).bfloat16()
    buf = io.BytesIO()
    pb = PatchBuilder(buf)
    pb.add("w", a, b)
    pb.finish()
    patch = buf.getvalue()
    fp = fpr.fingerprint("w", a)
    ai, bi = a.view(torch.int16).reshape(-1), b.view(torch.int16).reshape(-1)
    idx = torch.nonzero(ai != bi).squeeze(1)
    vals = bi[idx]
    k = idx.numel()
    out = {"lr": lr, "changed": k, "changed_pct": 100 * k / ai.numel()}

    def fused():
        base = {"w": a.clone()}
        t0 = time.perf_counter()
        apply(base, patch, base_fingerprints={"w": fp}, inplace=True)
        return time.perf_counter() - t0

    def bare():
        x = ai.clone()
        t0 = time.perf_counter()
        x.index_put_((idx,), vals)
        return time.perf_counter() - t0

    out["index_put_"] = min(bare() for _ in range(reps))
    out["fused decode+apply"] = min(fused() for _ in range(reps))
    reader = PatchReader(patch)
    chunks = []
    for c in reader.header.tensors[0].chunks:
        pbytes, vbytes = reader.read_chunk(c)
        ctx = codec.Context.from_list(c.ctx) if c.ctx else None
        chunks.append((c, entropy.parse(pbytes, c.count).kernel_args(),
                       entropy.parse(vbytes, c.count).kernel_args(),
                       (ctx.base, ctx.n, ctx.sign) if ctx else (0, 1, False)))
    flat = ai.clone().numpy()
    data = []
    for c, pst, vst, ctx in chunks:
        pos = np.empty(c.count, np.int64)
        positions(pos, c.start, pst)
        old, cs, u = (np.empty(c.count, np.int64) for _ in range(3))
        old_loads(flat, pos, ctx, 7, old, cs)
        data.append((c, pst, vst, ctx, pos, old, cs, u))
    new = [bi.numpy()[d[4]].astype(np.int64) for d in data]

    def phase(fn, setup=None):
        def run():
            if setup is not None:
                setup()
            t0 = time.perf_counter()
            for i, d in enumerate(data):
                fn(i, *d)
            return time.perf_counter() - t0
        return min(run() for _ in range(reps))

    dti = (16, 7, True, 2)
    seed = fpr.seed_of("w")

    def kernel(i, c, pst, vst, ctx, pos, old, cs, u):
        codec._apply(flat, pos, True, c.start, c.stop, pst, vst, 0,
                     ctx if c.ctx else (0, 0, False), dti, seed, old)

    out["fused kernel"] = phase(kernel, setup=lambda: np.copyto(flat, ai.numpy()))
    out["positions"] = phase(lambda i, c, pst, vst, ctx, pos, old, cs, u:
                             positions(pos, c.start, pst))
    out["old loads"] = phase(lambda i, c, pst, vst, ctx, pos, old, cs, u:
                             old_loads(flat, pos, ctx, 7, old, cs))
    out["value tokens"] = phase(lambda i, c, pst, vst, ctx, pos, old, cs, u:
                                value_tokens(vst, cs, u, True))
    out["value tokens, no extra bits"] = phase(lambda i, c, pst, vst, ctx, pos, old, cs, u:
                                               value_tokens(vst, cs, u, False))
    out["write+fingerprint"] = phase(lambda i, c, pst, vst, ctx, pos, old, cs, u:
                                     write_fingerprint(flat, pos, old, new[i],
                                                       fpr.seed_of("w")))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", type=float, default=22e6)
    ap.add_argument("--lrs", default="1e-6,3e-6,1e-5")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--md", type=Path)
    a = ap.parse_args()
    torch.set_num_threads(1)
    rows = [measure(float(lr), int(a.params), a.reps) for lr in a.lrs.split(",")]
    phases = ["positions", "old loads", "value tokens", "write+fingerprint"]
    lines = [
        "# decode+apply, phase by phase (`benchmarks/decode_phases.py`)",
        "",
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.machine()}, "
        f"{os.cpu_count()} CPUs, torch {torch.__version__}, one thread; a "
        f"{int(a.params) / 1e6:.0f}M-element bf16 matrix (pretrained-like), one Adam-like step "
        f"per lr; min of {a.reps}. ns per changed element.",
        "",
        "| lr | changed | bare `index_put_` | decode+apply (`patch.apply`) | ratio | of which "
        "the fused kernel | positions | old loads | value tokens (rANS only) | write+fingerprint "
        "| phases summed |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ns = {k: 1e9 * r[k] / r["changed"] for k in r if isinstance(r[k], float)
              and k not in ("lr", "changed_pct")}
        lines.append(
            f"| {r['lr']:g} | {r['changed_pct']:.2f}% | {ns['index_put_']:.1f} | "
            f"{ns['fused decode+apply']:.1f} | **{r['fused decode+apply'] / r['index_put_']:.1f}x**"
            f" | {ns['fused kernel']:.1f} | {ns['positions']:.1f} | {ns['old loads']:.1f} | "
            f"{ns['value tokens']:.1f} "
            f"({ns['value tokens, no extra bits']:.1f}) | {ns['write+fingerprint']:.1f} | "
            f"{sum(ns[p] for p in phases):.1f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if a.md:
        a.md.write_text(text)


if __name__ == "__main__":
    main()
