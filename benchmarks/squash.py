"""Catch-up cost for a follower k versions behind: the chain of k patches, the squashed span the
planner picks, and a direct diff, in bytes and apply time.

    .venv/bin/python benchmarks/squash.py [--quick] [--params 20e6] [--lrs 1e-6,3e-6]
        [--starts pretrained,random] [--ks 1,2,5,10,20] [--md out.md] [--json out.json]

For each start and learning rate, an AdamW run (benchmarks/adam_data.py gradients) publishes
max(ks)+1 versions of the bf16 view with the real `Publisher` to a local board, and the real
`Squasher` (`stitch squash`'s engine, horizon 32) writes its spans after every version. Then for
a follower at L-k (L the newest version), for each k:

* chain: the planner's path with spans off (`plan(..., spans=False)`): k patches, k pauses;
* planned: the planner's path with spans (what a follower takes; one span for k >= 2);
* direct: `len(stitch_core.diff(view[L-k], view[L]).to_bytes())`, a diff made on the spot
  from both views (the lower bound a span should meet: the same net difference);
* apply time: the chain's patches applied in place one after the other vs the planned path
  (stitch_core.format.patch.apply, fingerprints checked, min of --reps), each result compared
  bit for bit with view[L] (the run aborts on any mismatch).

Starts: `random` is adam_data's init (matrices ~N(0, 0.02), norms ~1 + N(0, 0.01));
`pretrained` is a pretrained-like start (`pretrained_like` below): heavy-tailed entries
(Student t, 4 degrees of freedom), log-normal row and column scales with a few outlier
feature columns, norm weights spread over a decade, embedding rows whose scale follows token
frequency, and Adam's moments warmed up by --warm-steps at the run's lr before the first
published version. Real pretrained checkpoints have these properties, which decide how many
bf16 roundings an Adam step crosses (more small-magnitude entries: more flips).

Sizes are bytes of `.stp` files, headers included. Times are min-of-reps on this machine
(noise: compare ratios, not absolutes). Torch runs single-threaded (--threads).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from adam_data import Gradients, init_masters, shape_for  # noqa: E402

from stitch_core.format.fingerprint import state_fingerprints  # noqa: E402
from stitch_core.format.patch import apply, diff  # noqa: E402
from stitch_core.versions.board import LocalBoard  # noqa: E402
from stitch_core.versions.squash import Squasher  # noqa: E402
from stitch_core.versions.store import fetch_patch, path_bytes, plan  # noqa: E402
from stitch_trainer.publisher import Publisher  # noqa: E402

RUN = "squash-bench"
ROOT = Path(__file__).resolve().parent
BEGIN, END = "<!-- SQUASH:BEGIN -->", "<!-- SQUASH:END -->"


def pretrained_like(n_params: float, seed: int) -> dict[str, torch.Tensor]:
    """fp32 masters with the statistics of a pretrained checkpoint (see the module doc)."""
    shape = shape_for(n_params)
    g = torch.Generator().manual_seed(seed)
    return {name: pretrained_tensor(name, s, g) for name, s in shape.shapes().items()}


def pretrained_tensor(name: str, s: tuple[int, ...], g: torch.Generator,
                      t4: Callable[[tuple[int, ...], torch.Generator], torch.Tensor] | None = None
                      ) -> torch.Tensor:
    """One tensor of `pretrained_like` (draws from `g`: call in checkpoint order). `t4` draws
    the Student-t(4) values (default: torch's sampler, seeded from `g`)."""
    if len(s) == 1:  # norms: exp(N(0, 0.6)) spans about a decade around 1
        return torch.exp(0.6 * torch.randn(s, generator=g))
    if t4 is None:
        torch.manual_seed(int(torch.randint(0, 2**31 - 1, (), generator=g)))
        w = torch.distributions.StudentT(4.0).sample(s)
    else:
        w = t4(s, g)
    w = w * 0.02 / math.sqrt(2.0)  # t(4) has variance 2
    rows = torch.exp(0.4 * torch.randn(s[0], 1, generator=g))
    cols = torch.exp(0.3 * torch.randn(1, s[1], generator=g))
    outliers = torch.randperm(s[1], generator=g)[: max(1, s[1] // 200)]
    cols[0, outliers] *= 8.0  # a few outlier feature channels
    if "embed_tokens" in name or "lm_head" in name:  # frequent tokens: larger rows
        rank = torch.randperm(s[0], generator=g).to(torch.float32) + 1
        rows = rows * (2.0 * rank.pow(-0.15).reshape(-1, 1) / rank.pow(-0.15).mean())
    return (w * rows * cols).contiguous()


def run_versions(start: str, n_params: float, lr: float, n: int, warm: int, seed: int,
                 work: Path, horizon: int):
    """Publish n versions (v0..v{n-1}); squash after each. Returns (views, squash seconds)."""
    shape = shape_for(n_params)
    masters = pretrained_like(n_params, seed) if start == "pretrained" else \
        init_masters(shape, seed)
    for t in masters.values():
        t.requires_grad_(True)
    opt = torch.optim.AdamW(masters.values(), lr=lr, betas=(0.9, 0.999), weight_decay=0.01)
    grads = Gradients(masters, shape.vocab, seed)
    plain = {k: t.detach() for k, t in masters.items()}

    def adam_step() -> None:
        grads.step(masters)
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(warm if start == "pretrained" else 2):
        adam_step()
    board = LocalBoard(work / "board")
    sq = Squasher(board, RUN, work / "cache", horizon=horizon)
    views, squash_s = [], []
    with Publisher(str(work / "board"), RUN, "bf16", snapshot_every=0) as pub:
        for step in range(n):
            pub.publish(step, plain).result()
            views.append({k: v.to(torch.bfloat16) for k, v in plain.items()})
            t0 = time.perf_counter()
            while asyncio.run(sq.step()) is not None:
                pass
            squash_s.append(time.perf_counter() - t0)
            if step < n - 1:
                adam_step()
    return views, squash_s, board


def _equal(a, b) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k].view(torch.int16), b[k].view(torch.int16)) for k in a)


def _apply_path(base, fps, patches) -> tuple[float, dict]:
    cur = {k: v.clone() for k, v in base.items()}
    t0 = time.perf_counter()
    f = dict(fps)
    for p in patches:
        cur = apply(cur, p, base_fingerprints=f, inplace=True)
        f = {}  # later patches verify against the tracked result
    return time.perf_counter() - t0, cur


def measure(views, board, ks, reps: int, work: Path) -> list[dict]:
    L = len(views) - 1
    rows = []
    for k in ks:
        have = L - k
        chain = asyncio.run(plan(board, RUN, have, L, spans=False))
        planned = asyncio.run(plan(board, RUN, have, L))
        direct = len(diff(views[have], views[L]).to_bytes())
        fps = state_fingerprints(views[have])

        def files(steps):
            out = []
            for s in steps:
                out += [str(p) for p in asyncio.run(fetch_patch(board, s.manifest, work / "c"))]
            return out

        times = {}
        for name, steps in (("chain", chain), ("planned", planned)):
            paths = files(steps)
            best = math.inf
            for _ in range(reps):
                t, out = _apply_path(views[have], fps, paths)
                if not _equal(out, views[L]):
                    raise SystemExit(f"k={k} {name}: result differs from v{L}")
                best = min(best, t)
            times[name] = best
        rows.append({
            "k": k, "chain_bytes": path_bytes(chain), "chain_steps": len(chain),
            "planned_bytes": path_bytes(planned),
            "planned": "+".join(s.label for s in planned), "direct_bytes": direct,
            "planned_vs_direct": path_bytes(planned) / direct,
            "chain_vs_planned": path_bytes(chain) / path_bytes(planned),
            "chain_apply_s": times["chain"], "planned_apply_s": times["planned"],
            "changed_vs_v0": sum(int((views[have][n].view(torch.int16) !=
                                      views[L][n].view(torch.int16)).sum()) for n in views[L])
            / sum(t.numel() for t in views[L].values()),
        })
    return rows


def table(results: list[dict]) -> str:
    out = ["| start | lr | k | changed (net) | chain bytes | planned | planned bytes | direct "
           "diff bytes | planned / direct | chain / planned | apply chain | apply planned |",
           "|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        for row in r["rows"]:
            out.append(
                f"| {r['start']} | {r['lr']:g} | {row['k']} | {100 * row['changed_vs_v0']:.2f}% "
                f"| {row['chain_bytes']:,} | {row['planned']} | {row['planned_bytes']:,} | "
                f"{row['direct_bytes']:,} | {row['planned_vs_direct']:.3f} | "
                f"{row['chain_vs_planned']:.2f}x | {1000 * row['chain_apply_s']:.0f} ms | "
                f"{1000 * row['planned_apply_s']:.0f} ms |")
    return "\n".join(out)


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(4.2 * len(results), 3.4), squeeze=False)
    for ax, r in zip(axes[0], results, strict=True):
        ks = [row["k"] for row in r["rows"]]
        for key, label, style in (("chain_bytes", "chain of k patches", "o-"),
                                  ("direct_bytes", "direct diff", "s-"),
                                  ("planned_bytes", "planned (a span; on the direct diff)",
                                   "x--")):
            ax.plot(ks, [row[key] / 1e6 for row in r["rows"]], style, label=label)
        ax.set_title(f"{r['start']} start, lr {r['lr']:g}")
        ax.set_xlabel("k (versions behind)")
        ax.set_ylabel("MB to download")
        ax.grid(alpha=0.3)
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def update_readme(md: str) -> None:
    """The table between the SQUASH markers of docs/benchmarks.md (where the result tables live)."""
    page = ROOT.parent / "docs" / "benchmarks.md"
    text = page.read_text()
    if BEGIN not in text or END not in text:
        sys.exit(f"{page} has no {BEGIN} ... {END} markers: not written")
    a, b = text.index(BEGIN) + len(BEGIN), text.index(END)
    page.write_text(text[:a] + "\n" + md + "\n" + text[b:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="4M params, k up to 5, one run")
    ap.add_argument("--params", type=float, default=20e6)
    ap.add_argument("--lrs", default="1e-6,3e-6")
    ap.add_argument("--starts", default="pretrained,random")
    ap.add_argument("--ks", default="1,2,5,10,20")
    ap.add_argument("--horizon", type=int, default=32)
    ap.add_argument("--warm-steps", type=int, default=10)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--md", default=str(ROOT / "results" / "squash.md"))
    ap.add_argument("--json", default=str(ROOT / "results" / "squash.json"))
    ap.add_argument("--png", default=str(ROOT / "results" / "squash.png"))
    ap.add_argument("--readme", action="store_true",
                    help="also update the SQUASH table of docs/benchmarks.md")
    ap.add_argument("--plot-only", action="store_true", help="redraw --png from --json")
    a = ap.parse_args()
    if a.plot_only:
        plot(json.loads(Path(a.json).read_text())["results"], Path(a.png))
        return
    if a.quick:
        a.params, a.lrs, a.starts, a.ks = 4e6, "1e-6", "pretrained", "1,2,5"
    torch.set_num_threads(a.threads)
    ks = [int(x) for x in a.ks.split(",")]
    results = []
    for start in a.starts.split(","):
        for lr in (float(x) for x in a.lrs.split(",")):
            with tempfile.TemporaryDirectory(prefix="stitch-squash-bench-") as tmp:
                t0 = time.perf_counter()
                views, squash_s, board = run_versions(start, a.params, lr, max(ks) + 1,
                                                      a.warm_steps, a.seed, Path(tmp),
                                                      a.horizon)
                rows = measure(views, board, ks, a.reps, Path(tmp))
                results.append({"start": start, "lr": lr, "rows": rows,
                                "squash_s_per_version":
                                    sum(squash_s[1:]) / max(1, len(squash_s) - 1),
                                "seconds": time.perf_counter() - t0})
                print(f"{start} lr {lr:g}: {len(views)} versions, squash "
                      f"{results[-1]['squash_s_per_version']:.2f} s/version", file=sys.stderr)
    n = shape_for(a.params).n_params
    md = (f"{n / 1e6:.1f}M parameters, bf16 view, horizon {a.horizon}; "
          f"`{' '.join(['benchmarks/squash.py', *sys.argv[1:]])}` on {platform.machine()}, "
          f"torch {torch.__version__}, {a.threads} thread(s).\n\n" + table(results) +
          "\n\nsquash time per version (all spans to it): " +
          ", ".join(f"{r['start']} {r['lr']:g}: {r['squash_s_per_version']:.2f} s"
                    for r in results))
    print(md)
    Path(a.md).write_text(md + "\n")
    Path(a.json).write_text(json.dumps({"params": n, "horizon": a.horizon, "results": results},
                                       indent=1))
    plot(results, Path(a.png))
    if a.readme:
        update_readme(md)


if __name__ == "__main__":
    main()
