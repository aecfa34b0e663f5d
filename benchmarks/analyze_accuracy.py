"""How well `stitch analyze`'s estimates predict the changed fraction of the bf16 view, on
pretrained-like weights, from a bf16 checkpoint and from unrounded fp32 masters.

    .venv/bin/python benchmarks/analyze_accuracy.py [--quick] [--params 6e6] [--lrs 1e-6,3e-6]
        [--steps 10] [--starts bf16,fp32,fp32-warm] [--md out.md] [--json out.json]

Masters: `benchmarks/squash.py`'s `pretrained_like` (heavy tails, row/column scales, outlier
columns, norms over a decade, Zipf-scaled embedding rows), the whole model of
`adam_data.shape_for(--params)`. Gradients: `adam_data.Gradients` (drifting low-rank signal +
noise, row-sparse embeddings). `torch.optim.AdamW(lr, betas (0.9, 0.999), weight decay 0)`.

Starts:

* `bf16`: masters = bf16(pretrained_like), fresh optimizer: a fine-tune of a published bf16
  checkpoint (fp32 masters loaded from bf16 weights sit exactly on the served grid);
* `fp32`: the unrounded fp32 masters, fresh optimizer;
* `fp32-warm`: the same after --warm-steps (10) AdamW steps at the run's lr (warm moments, as
  squash.py's pretrained start), not measured.

Per step, over all tensors (bf16 view, the previous view as the served one):

* measured: served elements that changed (bf16 bits differ);
* rule: |update| > ULP/2 (`predicted`); old: mean(min(1, |update|/ULP)) (`expected`, masters
  uniform in their interval); offsets, independent: `expected_offsets(signed=False)`, one
  per-tensor histogram of the offsets o = (master - served)/ULP, assumed independent of the
  update x = update/ULP, P(|o + x| > 1/2) summed; new: `expected_offsets` (the default), the
  offsets signed along the update and pooled per octave of |x|; oracle: |o + x| > 1/2 with
  each element's own offset (a check of the offset arithmetic: it ignores only binade edges and
  ties);
* mean abs(o): of the masters before the step (uniform = 0.25, on the grid = 0);
* new, lr x3 (lr 1e-6 rows only): `expected_offsets(scale=3)` on the lr 1e-6 run's step, i.e. an
  extrapolation to lr 3e-6 keeping the lr 1e-6 offsets; compare with the lr 3e-6 row's measured
  (the same gradient sequence).

Default run: about 4 minutes on a 2-core machine; --quick: about 30 s.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from adam_data import Gradients, shape_for  # noqa: E402
from squash import pretrained_like  # noqa: E402

from stitch_trainer.analyze.estimate import (  # noqa: E402
    expected_offsets,
    offsets,
    ulp,
)

ROOT = Path(__file__).resolve().parent


def step_stats(old: dict, new: dict, scale: float = 1.0) -> dict:
    """Measured and estimated changed counts of the bf16 view for one step old -> new."""
    keys = ("n", "measured", "rule", "old", "indep", "new", "oracle", "abs_o", "scaled")
    c = dict.fromkeys(keys, 0.0)
    for name, m0 in old.items():
        m1 = new[name]
        s0 = m0.to(torch.bfloat16)
        u = ulp(s0.float(), torch.bfloat16)
        x = (m1 - m0) / u
        o = offsets(m0, s0)
        c["n"] += m0.numel()
        c["measured"] += int((m1.to(torch.bfloat16).view(torch.int16)
                              != s0.view(torch.int16)).sum())
        c["rule"] += int((x.abs() > 0.5).sum())
        c["old"] += float(x.abs().clamp(max=1).sum())
        c["new"] += expected_offsets(m0, m1, s0)
        c["indep"] += expected_offsets(m0, m1, s0, signed=False)
        c["oracle"] += int(((o + x).abs() > 0.5).sum())
        c["abs_o"] += float(o.abs().sum())
        if scale != 1.0:
            c["scaled"] += expected_offsets(m0, m1, s0, scale=scale)
    return c


def run(start: str, params: float, lr: float, steps: int, warm: int, seed: int,
        scale: float = 1.0) -> list[dict]:
    shape = shape_for(params)
    masters = pretrained_like(params, seed)
    if start == "bf16":
        masters = {k: v.to(torch.bfloat16).float() for k, v in masters.items()}
    for t in masters.values():
        t.requires_grad_(True)
    opt = torch.optim.AdamW(masters.values(), lr=lr, betas=(0.9, 0.999), weight_decay=0.0)
    grads = Gradients(masters, shape.vocab, seed)
    plain = {k: t.detach() for k, t in masters.items()}

    def adam_step() -> None:
        grads.step(masters)
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(warm if start == "fp32-warm" else 0):
        adam_step()
    rows = []
    for step in range(1, steps + 1):
        old = {k: v.clone() for k, v in plain.items()}
        adam_step()
        c = step_stats(old, plain, scale)
        rows.append({"step": step, **c})
    return rows


def _pct(c: dict, k: str) -> str:
    return f"{100 * c[k] / c['n']:.3f}"


def table(results: list[dict], ranges: list[tuple[int, int]]) -> str:
    out = ["| start | lr | steps | measured % | rule % | old `expected` % | "
           "offsets, independent % | new `expected_offsets` % | old / measured | "
           "independent / measured | new / measured | oracle % | mean abs(o) | "
           "new, lr x3 % |",
           "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        for a, b in ranges:
            rows = [x for x in r["rows"] if a <= x["step"] <= b]
            if not rows:
                continue
            c = {k: sum(x[k] for x in rows) for k in rows[0] if k != "step"}
            sc = f"{100 * c['scaled'] / c['n']:.3f}" if r["scale"] != 1.0 else ""
            label = f"{a}" if a == b else f"{a}-{b}"
            out.append(
                f"| {r['start']} | {r['lr']:g} | {label} | {_pct(c, 'measured')} | "
                f"{_pct(c, 'rule')} | {_pct(c, 'old')} | {_pct(c, 'indep')} | {_pct(c, 'new')} | "
                f"{c['old'] / c['measured']:.2f} | {c['indep'] / c['measured']:.3f} | "
                f"{c['new'] / c['measured']:.3f} | "
                f"{_pct(c, 'oracle')} | {c['abs_o'] / c['n']:.3f} | {sc} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="3M params, 4 steps, lr 1e-6 only")
    ap.add_argument("--params", type=float, default=6e6)
    ap.add_argument("--lrs", default="1e-6,3e-6")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--starts", default="bf16,fp32,fp32-warm")
    ap.add_argument("--warm-steps", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--md", default=str(ROOT / "results" / "analyze_accuracy.md"))
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if a.quick:
        a.params, a.steps, a.lrs = 3e6, 4, "1e-6"
    torch.set_num_threads(a.threads)
    t0 = time.perf_counter()
    lrs = [float(x) for x in a.lrs.split(",")]
    results = []
    for start in a.starts.split(","):
        for lr in lrs:
            scale = 3.0 if lr == 1e-6 and 3e-6 in lrs else 1.0
            rows = run(start, a.params, lr, a.steps, a.warm_steps, a.seed, scale)
            results.append({"start": start, "lr": lr, "scale": scale, "rows": rows})
            print(f"{start} lr {lr:g}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    ranges = [(1, 1), (2, 2), (3, 5), (6, a.steps), (1, a.steps)]
    if a.steps < 6:
        ranges = [(1, 1), (2, a.steps), (1, a.steps)]
    shape = shape_for(a.params)
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, cwd=ROOT).stdout.strip()
    except OSError:
        commit = "?"
    head = (
        f"# `stitch analyze` estimates vs measured changes (bf16 view)\n\n"
        f"Machine: {platform.machine()} {platform.node()}, {a.threads} torch thread(s), torch "
        f"{torch.__version__}. Date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC. "
        f"Git commit: {commit} (+ this script and estimate.py as committed with this file).\n"
        f"Command: `{' '.join(['benchmarks/analyze_accuracy.py', *sys.argv[1:]])}` "
        f"({time.perf_counter() - t0:.0f} s).\n\n"
        f"Model: pretrained_like masters of `shape_for({a.params:g})`: hidden {shape.hidden}, "
        f"MLP {shape.intermediate}, {shape.layers} layers, vocab {shape.vocab} "
        f"({shape.n_params / 1e6:.1f} M params), AdamW betas (0.9, 0.999), no weight decay, "
        f"adam_data gradients, seed {a.seed}. Percentages are of all served elements, summed "
        f"over the step range (per-step mean).\n\n"
        f"No real pretrained LM is measured: none ships in this project's .venv (no LM "
        f"*.safetensors / *.bin weights in site-packages).\n\n")
    md = head + table(results, ranges) + "\n"
    print(md)
    if a.md:
        Path(a.md).write_text(md)
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
