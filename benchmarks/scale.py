#!/usr/bin/env python3
"""One version at realistic shapes: every step from the trainer's compare to the engine's pause.

Per Qwen2.5 shape (0.5B, 1.5B, 3B; 7B for the trainer side only: its engine side does not fit in
24 GiB next to the views) and learning rate, on the CPU, one torch thread:

* **weights**: the statistics of `squash.pretrained_tensor` (Student-t(4) tails, row/column
  scales, outlier columns, Zipf-scaled embedding rows; t(4) drawn as a normal over the root of a
  chi-square(4) from two uniforms, cheaper than torch's sampler at billions of elements), fp32,
  tensor by tensor so that 7B fits: each tensor is drawn, runs `--warm` AdamW steps (betas
  0.9/0.999, wd 0.01, torch's fused CPU AdamW) on synthetic gradients with `adam_data`'s structure
  (a drifting rank-4 signal plus iid noise at twice its std, a per-tensor scale, Zipf rows for the
  embedding), then one measured step; its bf16 views before and after that step are the version
  pair. Drawing and training use `--synth-threads`; everything timed runs on one thread.
* **trainer side**, per tensor, summed: the projection to the served view (what a publish blocks
  the training loop for), a bare compare -> nonzero of the two views, `stitch_core.diff`
  (diff + encode, base fingerprints computed outside the timer), the patch's bytes.
* **core apply**: `stitch_core.apply` in place (decode + write + fingerprint check) against a bare
  `index_put_` of the same elements.
* **engine side** (not 7B): benchmarks/rank_write.py's vLLM-style module (fused qkv and gate_up)
  at the shape: Stitch's first start (layout learned through `load_weights` + the proof's sums)
  and a restart (layout cache), then the version's gather and write (the pause) against a bare
  `index_put_` at the same engine positions.

Every figure is also given per element (per parameter or per changed element) so that it
extrapolates; `--png` draws time against model size. Transfer times are not measured: bytes over a
link are arithmetic (docs/benchmarks.md does it for 1T parameters at 10 Gb/s).

    .venv/bin/python benchmarks/scale.py [--sizes 0.5b,1.5b,3b,7b] [--lrs 1e-6,3e-6] \\
        [--md FILE] [--json FILE] [--png FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from adam_data import NOISE_TO_SIGNAL, SIGNAL_RANK, SIGNAL_RHO, ModelShape  # noqa: E402
from bench_timing import best, best_on_clones  # noqa: E402
from rank_write import FusedEngine  # noqa: E402
from squash import pretrained_tensor  # noqa: E402

import stitch_core  # noqa: E402
from stitch_core.engine.layout_cache import LayoutCache  # noqa: E402
from stitch_core.engine.replica import RankReplica  # noqa: E402
from stitch_core.format import dtypes, views  # noqa: E402
from stitch_core.format import fingerprint as fpr  # noqa: E402
from stitch_dev.rank_baseline import Baseline, baseline  # noqa: E402

SHAPES = {  # Qwen2.5 shapes, lm_head untied; "smoke" checks the script in seconds
    "smoke": ModelShape(hidden=128, intermediate=384, layers=2, vocab=1000, heads=2, kv_heads=1),
    "0.5b": ModelShape(hidden=896, intermediate=4864, layers=24, vocab=151936, heads=14,
                       kv_heads=2),
    "1.5b": ModelShape(hidden=1536, intermediate=8960, layers=28, vocab=151936, heads=12,
                       kv_heads=2),
    "3b": ModelShape(hidden=2048, intermediate=11008, layers=36, vocab=151936, heads=16,
                     kv_heads=2),
    "7b": ModelShape(hidden=3584, intermediate=18944, layers=28, vocab=152064, heads=28,
                     kv_heads=4),
}
TRAINER_ONLY = {"7b"}


def t4_fast(s: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """Student-t(4): a normal over the root of chi-square(4) / 4, the chi-square from two
    uniforms (-2 ln(u1 u2)); cheaper than torch's sampler at billions of elements."""
    chi2_4 = torch.rand(s, generator=g).mul_(torch.rand(s, generator=g)).log_().mul_(-2.0)
    return torch.randn(s, generator=g).div_(chi2_4.div_(4.0).sqrt_())


def grads(name: str, shape: tuple[int, ...], steps: int, vocab: int, g: torch.Generator):
    """`steps` gradients of one tensor with adam_data.Gradients' structure (per tensor)."""
    scale = 1e-3 * 10 ** (torch.rand((), generator=g).item() - 0.5)
    dims = [shape[0]] if len(shape) == 1 else [shape[0], shape[1]]
    rank = 1 if len(shape) == 1 else SIGNAL_RANK
    fs = [torch.randn(d, rank, generator=g) for d in dims]
    zipf = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64) ** 1.1
    for _ in range(steps):
        for i, f in enumerate(fs):
            noise = torch.randn(f.shape, generator=g)
            fs[i] = SIGNAL_RHO * f + math.sqrt(1 - SIGNAL_RHO**2) * noise
        sig = fs[0].reshape(-1) if len(fs) == 1 else (fs[0] @ fs[1].T) / math.sqrt(SIGNAL_RANK)
        out = sig + NOISE_TO_SIGNAL * torch.randn(sig.shape, generator=g)
        out *= scale
        if "embed_tokens" in name:  # only the rows of the batch's tokens
            ids = torch.multinomial(zipf / zipf.sum(), 4 * vocab, replacement=True, generator=g)
            mask = torch.zeros(shape[0], 1)
            mask[ids.unique()] = 1.0
            out *= mask
        yield out


def version_pair(shape: ModelShape, lr: float, warm: int, seed: int, keep: bool, log,
                 synth_threads: int = 2):
    """Per tensor: the bf16 views before/after one AdamW step and the trainer-side timings.
    Returns (prev views or None, {name: (positions, new bits)}, totals)."""
    g = torch.Generator().manual_seed(seed)
    tot = dict(params=0, changed=0, bytes=0, project=0.0, compare=0.0, diff=0.0, apply=0.0,
               index_put=0.0)
    prev_views: dict[str, torch.Tensor] | None = {} if keep else None
    edits: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    t_start = time.perf_counter()
    names = list(shape.shapes().items())
    for i, (name, s) in enumerate(names):
        torch.set_num_threads(synth_threads)
        w = pretrained_tensor(name, s, g, t4_fast).requires_grad_(True)
        opt = torch.optim.AdamW([w], lr=lr, betas=(0.9, 0.999), weight_decay=0.01, fused=True)
        steps = grads(name, s, warm + 1, shape.vocab, g)
        for _ in range(warm):
            w.grad = next(steps)
            opt.step()
        a = views.project({name: w.detach()}, "bf16")
        w.grad = next(steps)
        opt.step()
        del opt
        torch.set_num_threads(1)  # everything timed: one thread
        m = {name: w.detach()}
        t0 = time.perf_counter()
        b = views.project(m, "bf16")
        tot["project"] += time.perf_counter() - t0
        del w, m
        ia, ib = dtypes.int_view(a[name]), dtypes.int_view(b[name])
        tot["compare"] += best(lambda ia=ia, ib=ib: torch.nonzero(ia != ib))
        pos = torch.nonzero(ia != ib).reshape(-1)
        fps = fpr.state_fingerprints(a)
        tot["diff"] += best(lambda a=a, b=b, fps=fps: stitch_core.diff(a, b, base_fingerprints=fps))
        patch = stitch_core.diff(a, b, base_fingerprints=fps)
        tot["apply"] += best_on_clones(
            3, lambda t, patch=patch, fps=fps: stitch_core.apply(t, patch, base_fingerprints=fps,
                                                                 inplace=True), a)[0]
        vals = ib[pos].clone()
        tot["index_put"] += best_on_clones(
            3, lambda t, pos=pos, vals=vals, name=name: dtypes.int_view(t[name]).index_put_(
                (pos,), vals), a)[0]
        tot["params"] += a[name].numel()
        tot["changed"] += pos.numel()
        tot["bytes"] += len(patch.data)
        edits[name] = (pos.numpy(), vals.numpy())
        if prev_views is not None:
            prev_views[name] = a[name]
        if (i + 1) % 40 == 0 or i + 1 == len(names):
            log(f"    {i + 1}/{len(names)} tensors, {time.perf_counter() - t_start:.0f} s")
    return prev_views, edits, tot


def engine_side(shape: ModelShape, view: dict[str, torch.Tensor], edits, work: Path) -> dict:
    eng = FusedEngine(shape)
    eng.load_weights(view.items())
    hf = {n: (tuple(t.shape), "BF16") for n, t in view.items()}
    view.clear()  # the engine holds the weights now (3B: 7 GB less at the layout's peak)
    out = {}
    for run in ("first", "restart"):
        rep = RankReplica(eng, layout_cache=LayoutCache(work / "layouts", {"engine": "bench"}))
        t0 = time.perf_counter()
        r = rep.setup(hf)
        out[run] = (r.learn_s, r.sums_s, time.perf_counter() - t0, r.cached)
    pos = {n: p for n, (p, _) in edits.items()}
    vals = {n: v for n, (_, v) in edits.items()}
    writes = []
    for i in range(3):
        t0 = time.perf_counter()
        rep.gather(f"v{i}", pos)
        gather_s = time.perf_counter() - t0
        w = rep.write(f"v{i}", vals)
        writes.append((w.seconds, baseline(rep, Baseline(5)).index_put_s, gather_s))
        rep.undo(f"v{i}")
    out["write"], out["write_index_put"], out["gather"] = (min(x[k] for x in writes)
                                                           for k in range(3))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--sizes", default="0.5b,1.5b,3b,7b")
    ap.add_argument("--lrs", default="1e-6,3e-6")
    ap.add_argument("--trainer-only-lrs", default=None,
                    help="learning rates for the trainer-only sizes (default: the first of --lrs)")
    ap.add_argument("--warm", type=int, default=3, help="AdamW steps before the measured one")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--synth-threads", type=int, default=2, help="threads drawing and training")
    ap.add_argument("--md", type=Path)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--png", type=Path)
    ap.add_argument("--from-json", type=Path,
                    help="render --md / --png from an earlier run's --json, run nothing")
    a = ap.parse_args(argv)
    if a.from_json:
        rows = json.loads(a.from_json.read_text())
        text = report(rows, a, float("nan"), sys.argv[1:] if argv is None else argv)
        print(text)
        if a.md:
            a.md.write_text(text)
        if a.png:
            plot(rows, a.png)
        return 0
    torch.set_num_threads(1)
    t_all = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_all:6.0f} s] {msg}", flush=True)

    rows = []
    for size in a.sizes.split(","):
        shape = SHAPES[size]
        engine = size not in TRAINER_ONLY
        lrs = a.lrs if engine else (a.trainer_only_lrs or a.lrs.split(",")[0])
        for lr in (float(x) for x in lrs.split(",")):
            log(f"{size} lr {lr:g}: weights, AdamW and the trainer side")
            view, edits, tot = version_pair(shape, lr, a.warm, a.seed, engine, log,
                                            a.synth_threads)
            row = {"size": size, "lr": lr, **tot}
            if engine:
                log(f"{size} lr {lr:g}: engine side")
                with tempfile.TemporaryDirectory() as tmp:
                    row.update(engine_side(shape, view, edits, Path(tmp)))
            del view, edits
            rows.append(row)
            log(f"{size} lr {lr:g}: {fmt_row(row)}")
    shown = sys.argv[1:] if argv is None else argv
    text = report(rows, a, time.perf_counter() - t_all, shown)
    print(text)
    if a.md:
        a.md.write_text(text)
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))
    if a.png:
        plot(rows, a.png)
    return 0


def fmt_row(r: dict) -> str:
    return (f"{100 * r['changed'] / r['params']:.3f}% changed, {r['bytes'] / 1e6:.1f} MB, "
            f"diff {r['diff']:.2f} s (compare {r['compare']:.2f}), apply {r['apply']:.2f} s "
            f"(index_put_ {r['index_put']:.2f})")


def report(rows: list[dict], a: argparse.Namespace, total_s: float, shown: list[str]) -> str:
    took = "rendered from a run's --json" if math.isnan(total_s) else f"total {total_s:.0f} s"
    lines = [
        "# One version at realistic shapes (benchmarks/scale.py)", "",
        f"`benchmarks/scale.py {' '.join(shown)}` (read its docstring); "
        f"{platform.machine()}, torch {torch.__version__}, one torch thread; AdamW "
        f"{a.warm} warm-up steps then the measured one; {took}.", "",
        "## Trainer side and core apply (sums over tensors)", "",
        "| model | params | lr | changed | patch MB | bits/changed | project ms | compare ms | "
        "diff+encode ms | / compare | decode+apply ms | index_put_ ms | / index_put_ |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r['size']} | {r['params'] / 1e9:.2f}B | {r['lr']:g} | "
            f"{100 * r['changed'] / r['params']:.3f}% | {r['bytes'] / 1e6:.1f} | "
            f"{8 * r['bytes'] / max(r['changed'], 1):.2f} | {1e3 * r['project']:.0f} | "
            f"{1e3 * r['compare']:.0f} | {1e3 * r['diff']:.0f} | "
            f"**{r['diff'] / r['compare']:.2f}x** | {1e3 * r['apply']:.0f} | "
            f"{1e3 * r['index_put']:.0f} | **{r['apply'] / r['index_put']:.2f}x** |")
    lines += ["", "Per element (ns): project, compare and diff+encode per parameter; "
              "decode+apply and index_put_ per changed element.", "",
              "| model | lr | project / param | compare / param | diff+encode / param | "
              "decode+apply / changed | index_put_ / changed |",
              "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        p, c = r["params"], max(r["changed"], 1)
        lines.append(f"| {r['size']} | {r['lr']:g} | {1e9 * r['project'] / p:.2f} | "
                     f"{1e9 * r['compare'] / p:.2f} | {1e9 * r['diff'] / p:.2f} | "
                     f"{1e9 * r['apply'] / c:.1f} | {1e9 * r['index_put'] / c:.1f} |")
    eng = [r for r in rows if "write" in r]
    if eng:
        lines += ["", "## Engine side (vLLM-style fused module, TP=1)", "",
                  "| model | lr | first start: layout + sums s | per param ns | restart: layout + "
                  "sums s | per param ns | gather ms | write (pause) ms | bare index_put_ ms | "
                  "/ index_put_ | write ns / changed |", "|---|---|---:|---:|---:|---:|---:|---:|"
                  "---:|---:|---:|"]
        for r in eng:
            f, s = r["first"], r["restart"]
            lines.append(
                f"| {r['size']} | {r['lr']:g} | {f[0]:.2f} + {f[1]:.2f} | "
                f"{1e9 * f[2] / r['params']:.1f} | {s[0]:.3f} + {s[1]:.2f} | "
                f"{1e9 * s[2] / r['params']:.2f} | {1e3 * r['gather']:.0f} | "
                f"{1e3 * r['write']:.0f} | {1e3 * r['write_index_put']:.0f} | "
                f"**{r['write'] / r['write_index_put']:.2f}x** | "
                f"{1e9 * r['write'] / max(r['changed'], 1):.1f} |")
    lines += extrapolate(rows)
    return "\n".join(lines) + "\n"


LINK_BPS = 10e9  # a 10 Gb/s link
BIG = 1e12  # parameters
TP = 8


def extrapolate(rows: list[dict]) -> list[str]:
    """Per-element rates of the largest measured shape, carried to 1T parameters."""
    out = ["", "## Carried to 1T parameters (arithmetic, not a measurement)", "",
           f"Rates per element of the largest shape measured at each lr, times {BIG:.0e} "
           f"parameters; a 10 Gb/s link; TP={TP} per node. One CPU thread for every Stitch step "
           "(nothing here ran on a GPU).", "",
           "| lr | from | changed | patch GB | on the link s | full bf16 checkpoint on the link s "
           "| trainer diff+encode, per 1B params of a rank's shard, s | node decode+apply "
           "(one thread, whole patch) s | rank write (pause) per rank s |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for lr in sorted({r["lr"] for r in rows}):
        rs = [r for r in rows if r["lr"] == lr]
        t = max(rs, key=lambda r: r["params"])
        e = max((r for r in rs if "write" in r), key=lambda r: r["params"], default=None)
        frac = t["changed"] / t["params"]
        changed = frac * BIG
        patch = t["bytes"] / t["params"] * BIG
        apply_ns = t["apply"] / max(t["changed"], 1)
        write = (f"{e['write'] / max(e['changed'], 1) * changed / TP:.0f} ({e['size']})"
                 if e else "-")
        out.append(f"| {lr:g} | {t['size']} | {100 * frac:.2f}% | {patch / 1e9:.1f} | "
                   f"{patch * 8 / LINK_BPS:.1f} | {2 * BIG * 8 / LINK_BPS:.0f} | "
                   f"{t['diff'] / t['params'] * 1e9:.1f} | {apply_ns * changed:.0f} | {write} |")
    return out


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, lr in zip(axes, sorted({r["lr"] for r in rows}), strict=False):
        rs = sorted((r for r in rows if r["lr"] == lr), key=lambda r: r["params"])
        x = [r["params"] / 1e9 for r in rs]
        series = [("diff+encode", "diff", "-o"), ("bare compare", "compare", "--o"),
                  ("decode+apply", "apply", "-s"), ("bare index_put_", "index_put", "--s")]
        for label, key, style in series:
            ax.plot(x, [r[key] for r in rs], style, label=label)
        er = [r for r in rs if "write" in r]
        if er:
            ex = [r["params"] / 1e9 for r in er]
            ax.plot(ex, [r["write"] for r in er], "-^", label="engine pause (rank write)")
            ax.plot(ex, [r["first"][2] for r in er], "-v", label="first start (layout + sums)")
            ax.plot(ex, [r["restart"][2] for r in er], ":v", label="restart (cached layout)")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.xaxis.set_major_locator(FixedLocator([0.5, 1, 2, 3, 5, 7, 10]))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("parameters (billions)")
        ax.set_ylabel("seconds per version, one CPU thread")
        ax.set_title(f"AdamW lr {lr:g}, Qwen2.5 shapes")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
