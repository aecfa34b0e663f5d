"""Patch size and speed of stitch_core.diff/apply on a realistic AdamW run, against baselines.

    .venv/bin/python benchmarks/codec.py [--quick] [--params 20e6] [--steps 20] \\
        [--lrs 1e-6,3e-6,1e-5] [--views bf16,fp8-e4m3-block] [--json out.json] [--seed 0]

For each learning rate, benchmarks/adam_data.py trains a synthetic transformer with AdamW; after
the warm-up steps, every step's masters are projected to each served view (fp8 scales pinned to
the previous view) and each pair of consecutive views is measured:

* ours: len(stitch_core.diff(prev, cur, base_fingerprints=...).data), the whole .stp file;
* COO + zstd: per tensor, int32 flat indices then the new raw values, zstd level 3;
* XOR + zstd: per tensor, XOR of the raw bytes of old and new, zstd level 3 (dense deltas);
* bound: per tensor, log2 C(n, k) for the positions + k * H(ULP delta), H the empirical
  zero-order entropy of key(new) - key(old) over that tensor's changed elements;
* times, on every --time-every'th step (min of --reps runs each): diff vs. a bare
  compare -> nonzero pass, and in-place apply vs. a bare index_put_ of precomputed positions
  and values (both on clones made outside the timer);
* entropy coders, on the timed steps: every token stream that step's diff codes, coded by
  stitch_core's hand-written rANS and by constriction's AnsCoder (when installed) under the
  same contexts and the same quantised frequency tables; sizes and times of the token coding
  alone (tables and raw extra bits are the same for both and left out).

Every step's patch is applied and checked bitwise against the target view (abort if not).
Sizes are summed over all steps; ratios are of the sums. Prints markdown (and --md / --json).
Torch runs single-threaded by default (--threads): on a shared 2-core machine, 2 intra-op
threads make every torch op, ours and the baselines alike, erratically slower.
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import json
import math
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numba
import numpy as np
import torch
import zstandard

try:
    import constriction
except ImportError:  # optional: only the coder comparison needs it
    constriction = None

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

from adam_data import adamw_run, shape_for  # noqa: E402
from bench_timing import best_of, best_on_clones  # noqa: E402

import stitch_core  # noqa: E402
from stitch_core.format import dtypes, entropy, views  # noqa: E402
from stitch_core.format import fingerprint as fpr  # noqa: E402

Tensors = Mapping[str, torch.Tensor]
Edits = Mapping[str, tuple[torch.Tensor, torch.Tensor]]  # name -> (positions, new int bits)
ZSTD_LEVEL = 3


class RoundTripError(AssertionError):
    """apply() did not reproduce the target view bitwise."""


@dataclass
class PairStats:
    """Measurements of one pair of consecutive views."""

    step: int
    total: int
    changed: int
    ours: int
    pos_bytes: int
    val_bytes: int
    coo_zstd: int
    xor_zstd: int
    bound_pos_bits: float
    bound_val_bits: float
    timed: bool  # t_* are min-of-reps; otherwise single runs, not reported
    t_diff: float
    t_compare: float
    t_apply: float
    t_index_put: float
    t_xor_zstd: float
    scales_changed: int
    coders: dict[str, float] = field(default_factory=dict)  # coder comparison (timed steps)


@dataclass
class Series:
    """All pairs of one (view, lr)."""

    view: str
    lr: float
    scale_entries: int = 0  # fp8: scale entries per version
    pairs: list[PairStats] = field(default_factory=list)

    def sum(self, attr: str, timed_only: bool = False) -> float:
        return sum(getattr(p, attr) for p in self.pairs if p.timed or not timed_only)

    def median(self, fn: Callable[[PairStats], float]) -> float:
        return statistics.median(fn(p) for p in self.pairs)

    @property
    def n_timed(self) -> int:
        return sum(p.timed for p in self.pairs)

    @property
    def bound(self) -> float:
        """The entropy bound in bytes, summed over steps."""
        return (self.sum("bound_pos_bits") + self.sum("bound_val_bits")) / 8


# ---------------------------------------------------------------- helpers


def clone(d: Tensors) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in d.items()}


def check_same(got: Tensors, want: Tensors, what: str) -> None:
    """Raise RoundTripError unless got holds exactly want's tensors, bit for bit."""
    if set(got) != set(want):
        raise RoundTripError(f"{what}: tensor names differ: {sorted(set(got) ^ set(want))[:3]}")
    for n, w in want.items():
        g = got[n]
        if g.dtype != w.dtype or g.shape != w.shape:
            raise RoundTripError(f"{what}: {n} is {g.dtype}{list(g.shape)}, want {w.dtype}")
        if not torch.equal(dtypes.int_view(g), dtypes.int_view(w)):
            raise RoundTripError(f"{what}: {n} differs bitwise from the target view")


def entropy_bits(values: np.ndarray) -> float:
    """len(values) * H(empirical distribution of values), in bits."""
    _, counts = np.unique(values, return_counts=True)
    return float(-(counts * np.log2(counts / values.size)).sum())


def log2_binom(n: int, k: int) -> float:
    return (math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)) / math.log(2)


# ---------------------------------------------------------------- baselines


def compare_pass(a: Tensors, b: Tensors) -> dict[str, torch.Tensor]:
    """The bare minimum a differ does: compare bits and list the changed positions."""
    return {n: torch.nonzero(dtypes.int_view(a[n]) != dtypes.int_view(b[n])).reshape(-1) for n in b}


def index_put(base: dict[str, torch.Tensor], edits: Edits) -> dict[str, torch.Tensor]:
    """The bare minimum an applier does: scatter precomputed values into the base, in place."""
    for n, (pos, vals) in edits.items():
        dtypes.int_view(base[n]).index_put_((pos,), vals)
    return base


def xor_zstd(a: Tensors, b: Tensors) -> int:
    """Dense deltas: zstd of the XOR of each tensor's raw bytes."""
    z = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
    total = 0
    for n in b:
        x = dtypes.int_view(a[n]).numpy() ^ dtypes.int_view(b[n]).numpy()
        total += len(z.compress(x.tobytes()))
    return total


def coo_zstd(edits: Edits) -> int:
    """Sparse deltas: zstd of int32 flat indices followed by the new raw values, per tensor."""
    z = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
    total = 0
    for pos, vals in edits.values():
        if pos.numel():
            blob = pos.to(torch.int32).numpy().tobytes() + vals.numpy().tobytes()
            total += len(z.compress(blob))
    return total


def bound_bits(
    a: Tensors, b: Tensors, positions: Mapping[str, torch.Tensor]
) -> tuple[float, float]:
    """Empirical zero-order bound in bits, (positions, values): per tensor, the positions as a
    k-subset of n and the values as iid draws of the tensor's ULP-delta distribution."""
    pos_bits = val_bits = 0.0
    for n, pos in positions.items():
        if not pos.numel():
            continue
        dt = dtypes.info(b[n].dtype)
        old = dtypes.int_view(a[n])[pos].to(torch.int64)
        new = dtypes.int_view(b[n])[pos].to(torch.int64)
        delta = dtypes.to_key(new, dt) - dtypes.to_key(old, dt)
        pos_bits += log2_binom(b[n].numel(), pos.numel())
        val_bits += entropy_bits(delta.numpy())
    return pos_bits, val_bits


# ---------------------------------------------------------------- entropy coders


def coder_streams(prev: Tensors, cur: Tensors, fps: Mapping[str, int]) -> list[tuple]:
    """(values, contexts, n_ctx) of every stream stitch_core.diff codes for this pair."""
    streams, real = [], entropy.encode

    def spy(u, ctx=None, n_ctx=1):
        streams.append((np.asarray(u, np.uint64), ctx, n_ctx))
        return real(u, ctx, n_ctx)

    entropy.encode = spy
    try:
        stitch_core.diff(prev, cur, base_fingerprints=fps)
    finally:
        entropy.encode = real
    return streams


def coder_times(u: np.ndarray, ctx: np.ndarray | None, n_ctx: int, reps: int) -> dict:
    """One stream's token coding by our rANS and by constriction's AnsCoder: same tokens,
    contexts and quantised tables (one constriction Categorical per context, tokens grouped by
    context). Tables are built inside every timed call for both. Checks both round trips."""
    ans, cat = constriction.stream.stack.AnsCoder, constriction.stream.model.Categorical
    tok = entropy.tokenize(u)[0]
    ctx = np.zeros(tok.size, np.uint8) if ctx is None else np.asarray(ctx, np.uint8)
    counts = np.bincount(ctx.astype(np.int64) * 256 + tok, minlength=n_ctx * 256)
    counts = counts.reshape(n_ctx, 256)
    freq = np.stack([entropy.normalize(c) for c in counts])
    used = [c for c in range(n_ctx) if freq[c].any()]
    order = np.argsort(ctx, kind="stable")
    cuts = np.concatenate([[0], np.cumsum(counts.sum(1))])

    def c_encode():
        models = {c: cat(freq[c].astype(np.float64), perfect=False) for c in used}
        coder, grouped = ans(), tok[order].astype(np.int32)
        for c in reversed(used):
            coder.encode_reverse(grouped[cuts[c] : cuts[c + 1]], models[c])
        return coder.get_compressed()

    def c_decode():
        models = {c: cat(freq[c].astype(np.float64), perfect=False) for c in used}
        coder, back = ans(comp), np.empty(tok.size, np.int32)
        parts = [coder.decode(models[c], int(cuts[c + 1] - cuts[c])) for c in used]
        back[order] = np.concatenate(parts) if parts else back[:0]
        return back

    t_oe, ours = best_of(reps, lambda: entropy.code_tokens(tok, ctx, freq))
    t_od, back = best_of(reps, lambda: entropy.decode_tokens(ours, ctx, freq))
    t_ce, comp = best_of(reps, c_encode)
    t_cd, c_back = best_of(reps, c_decode)
    if not (np.array_equal(back, tok) and np.array_equal(c_back, tok)):
        raise RoundTripError("entropy coder comparison: a coder did not round-trip")
    return {"tokens": tok.size, "ours_bytes": len(ours), "c_bytes": 4 * comp.size,
            "ours_enc": t_oe, "ours_dec": t_od, "c_enc": t_ce, "c_dec": t_cd}


def compare_coders(streams: list[tuple], reps: int) -> dict[str, float]:
    """coder_times summed over a diff's streams ({} without constriction)."""
    out: dict[str, float] = {}
    if constriction is not None:
        for st in streams:
            for k, v in coder_times(*st, reps).items():
                out[k] = out.get(k, 0.0) + v
    return out


# ---------------------------------------------------------------- one pair


def measure_pair(
    step: int, prev: Tensors, cur: Tensors, fps: Mapping[str, int], reps: int
) -> PairStats:
    """Sizes, times (min of reps) and a bitwise round-trip check of one pair of views."""
    t_compare, positions = best_of(reps, lambda: compare_pass(prev, cur))
    edits = {n: (p, dtypes.int_view(cur[n])[p]) for n, p in positions.items()}
    changed = sum(p.numel() for p in positions.values())

    t_diff, patch = best_of(reps, lambda: stitch_core.diff(prev, cur, base_fingerprints=fps))

    def ours_apply(base: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return stitch_core.apply(base, patch, base_fingerprints=fps, inplace=True)

    t_apply, got = best_on_clones(reps, ours_apply, prev)
    check_same(got, cur, f"step {step}: stitch_core.apply")
    t_index_put, got = best_on_clones(reps, lambda base: index_put(base, edits), prev)
    check_same(got, cur, f"step {step}: index_put_ baseline")

    header = patch.header
    if header.changed_elements != changed:
        raise RoundTripError(
            f"step {step}: patch says {header.changed_elements} elements changed, the compare "
            f"pass found {changed}"
        )
    chunks = [c for t in header.tensors for c in t.chunks]
    t0 = time.perf_counter()
    xz = xor_zstd(prev, cur)
    t_xor = time.perf_counter() - t0
    b_pos, b_val = bound_bits(prev, cur, positions)
    return PairStats(
        step=step,
        total=sum(t.numel() for t in cur.values()),
        changed=changed,
        ours=len(patch.data),
        pos_bytes=sum(c.pos_bytes for c in chunks),
        val_bytes=sum(c.val_bytes for c in chunks),
        coo_zstd=coo_zstd(edits),
        xor_zstd=xz,
        bound_pos_bits=b_pos,
        bound_val_bits=b_val,
        timed=reps > 1,
        t_diff=t_diff,
        t_compare=t_compare,
        t_apply=t_apply,
        t_index_put=t_index_put,
        t_xor_zstd=t_xor,
        scales_changed=sum(views.view_changed_scales(prev, cur).values()),
        coders=compare_coders(coder_streams(prev, cur, fps), reps) if reps > 1 else {},
    )


# ---------------------------------------------------------------- the run


def warm_up_numba() -> None:
    """Compile (or load) every kernel diff/apply use, on a tiny dict, before any timing."""
    g = torch.Generator().manual_seed(123)
    base = {
        "a.weight": 0.02 * torch.randn(300, 300, generator=g),
        "b.weight": 1 + 0.01 * torch.randn(4096, generator=g),
    }
    new = {n: t + 1e-3 * torch.randn(t.shape, generator=g) for n, t in base.items()}
    for view in ("bf16", "fp8-e4m3-block"):
        a = views.project(base, view)
        b = views.project(new, view, previous=a)
        fps = fpr.state_fingerprints(a)
        got = stitch_core.apply(a, stitch_core.diff(a, b, base_fingerprints=fps))
        check_same(got, b, "warm-up")


def run_lr(lr: float, args: argparse.Namespace) -> list[Series]:
    """Train at one lr; measure every view on every step after the warm-up."""
    series = {v: Series(v, lr) for v in args.view_list}
    prev: dict[str, dict[str, torch.Tensor]] = {}
    fps: dict[str, dict[str, int]] = {}
    trajectory = adamw_run(args.params, lr, args.warmup + args.steps, seed=args.seed)
    for step, masters in enumerate(trajectory):
        t0 = time.perf_counter()
        k = step - args.warmup  # measured step number, 1-based
        for v, s in series.items():
            cur = views.project(masters, v, previous=prev.get(v))
            if k >= 1:
                reps = args.reps if (k - 1) % args.time_every == 0 else 1
                s.pairs.append(measure_pair(k, prev[v], cur, fps[v], reps))
            if k >= 0:
                fps[v] = fpr.state_fingerprints(cur)  # outside every timer, once per version
                # against an empty view every scale entry counts as changed: the total
                s.scale_entries = sum(views.view_changed_scales({}, cur).values())
            prev[v] = cur
        if k >= 1:
            done = ", ".join(
                f"{v} {100 * s.pairs[-1].changed / s.pairs[-1].total:.2f}% changed "
                f"{s.pairs[-1].ours / 1e3:.0f} kB"
                for v, s in series.items()
            )
            log(f"  lr {lr:g} step {k}/{args.steps}: {done} ({time.perf_counter() - t0:.1f} s)")
    return list(series.values())


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- report


def fmt_bytes(n: float) -> str:
    return f"{n / 1e6:.3f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


def table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def size_row(s: Series) -> list[str]:
    changed, ours, xz = s.sum("changed"), s.sum("ours"), s.sum("xor_zstd")
    return [
        s.view,
        f"{s.lr:g}",
        f"{100 * s.median(lambda p: p.changed / p.total):.3f}%",
        fmt_bytes(s.median(lambda p: p.ours)),
        fmt_bytes(ours),
        f"{8 * ours / changed:.2f}",
        fmt_bytes(s.bound),
        fmt_bytes(s.sum("coo_zstd")),
        fmt_bytes(xz),
        f"**{ours / s.bound:.3f}**",
        f"**{ours / xz:.3f}**",
        f"{ours / s.sum('coo_zstd'):.3f}",
    ]


def time_row(s: Series) -> list[str]:
    n = s.n_timed
    td, tc, ta, ti, tx = (
        s.sum(a, timed_only=True)
        for a in ("t_diff", "t_compare", "t_apply", "t_index_put", "t_xor_zstd")
    )
    return [
        s.view,
        f"{s.lr:g}",
        str(n),
        f"{1e3 * td / n:.1f}",
        f"{1e3 * tc / n:.1f}",
        f"**{td / tc:.1f}x**",
        f"{1e3 * ta / n:.1f}",
        f"{1e3 * ti / n:.1f}",
        f"**{ta / ti:.1f}x**",
        f"{1e3 * tx / n:.1f}",
    ]


def split_row(s: Series) -> list[str]:
    changed, ours = s.sum("changed"), s.sum("ours")
    pos, val = s.sum("pos_bytes"), s.sum("val_bytes")
    other = ours - pos - val
    bp, bv = s.sum("bound_pos_bits"), s.sum("bound_val_bits")
    return [
        s.view,
        f"{s.lr:g}",
        f"{8 * pos / changed:.3f}",
        f"{bp / changed:.3f}",
        f"{8 * val / changed:.3f}",
        f"{bv / changed:.3f}",
        f"{8 * other / changed:.3f}",
        fmt_bytes(other / len(s.pairs)),
        f"{8 * ours / changed:.3f}",
        f"{(bp + bv) / changed:.3f}",
    ]


def coder_row(s: Series) -> list[str]:
    tot = {k: sum(p.coders.get(k, 0.0) for p in s.pairs) for k in
           ("tokens", "ours_bytes", "c_bytes", "ours_enc", "ours_dec", "c_enc", "c_dec")}
    n = sum(1 for p in s.pairs if p.coders)
    return [
        s.view, f"{s.lr:g}", f"{tot['tokens'] / n / 1e6:.2f}M",
        f"{8 * tot['ours_bytes'] / tot['tokens']:.4f}", f"{8 * tot['c_bytes'] / tot['tokens']:.4f}",
        f"**{tot['ours_bytes'] / tot['c_bytes']:.4f}**",
        *(f"{1e3 * tot[k] / n:.1f}" for k in ("ours_enc", "c_enc", "ours_dec", "c_dec")),
    ]  # fmt: skip


def report(all_series: list[Series], args: argparse.Namespace) -> str:
    shape = shape_for(args.params)
    timed = sorted({p.step for s in all_series for p in s.pairs if p.timed})
    out = [
        f"Model: {shape.n_params / 1e6:.2f}M params ({shape.layers} layers, hidden "
        f"{shape.hidden}, vocab {shape.vocab}, {len(shape.shapes())} tensors); AdamW betas "
        f"(0.9, 0.999), wd 0.01; {args.warmup} warm-up steps, then {args.steps} measured "
        f"steps per lr (= pairs of consecutive views). Seed {args.seed}.",
        "",
        "### Patch size (summed over all steps; ratios of the sums)",
        "",
        table(
            ["view", "lr", "changed (median step)", "ours (median step)", "ours total",
             "ours bits/changed", "bound", "COO+zstd", "XOR+zstd", "ours/bound",
             "ours/XOR+zstd", "ours/COO+zstd"],
            [size_row(s) for s in all_series],
        ),
        "",
        f"### Time per step, ms (min of {args.reps} runs, mean over timed steps {timed}; "
        f"torch threads {torch.get_num_threads()})",
        "",
        table(
            ["view", "lr", "timed steps", "diff+encode", "compare->nonzero", "ratio",
             "decode+apply (in place)", "index_put_", "ratio", "XOR+zstd (1 run)"],
            [time_row(s) for s in all_series],
        ),
        "",
        "### Bits per changed element by stream: ours (from chunk pos_bytes/val_bytes) vs bound",
        "",
        table(
            ["view", "lr", "ours positions", "bound positions", "ours values", "bound values",
             "ours header+container", "header+container per step", "ours total", "bound total"],
            [split_row(s) for s in all_series],
        ),
    ]  # fmt: skip
    coder_rows = [coder_row(s) for s in all_series if any(p.coders for p in s.pairs)]
    if coder_rows:
        out += [
            "",
            f"### Entropy coder: hand-written rANS (ours) vs constriction "
            f"{importlib.metadata.version('constriction')} AnsCoder, token coding only "
            f"(same tokens, contexts and quantised tables; ms per timed step, min of {args.reps})",
            "",
            table(["view", "lr", "tokens", "ours bits/token", "constriction bits/token",
                   "size ours/constriction", "encode ours", "encode constriction",
                   "decode ours", "decode constriction"], coder_rows),
        ]  # fmt: skip
    scale_rows = [
        [s.view, f"{s.lr:g}", str(s.scale_entries), str(len(s.pairs)),
         str(int(s.sum("scales_changed")))]
        for s in all_series
        if s.scale_entries
    ]  # fmt: skip
    if scale_rows:
        out += [
            "",
            "### fp8 scales (pinned): entries changed over the run (views.view_changed_scales)",
            "",
            table(["view", "lr", "scale entries per version", "steps", "entries changed"],
                  scale_rows),
        ]  # fmt: skip
    out += ["", "### Targets", "", targets(all_series)]
    return "\n".join(out)


def targets(all_series: list[Series]) -> str:
    lines = []

    def check(ok: bool, text: str) -> None:
        lines.append(f"- {'PASS' if ok else 'MISS'}: {text}")

    for s in all_series:
        ours, tag = s.sum("ours"), f"{s.view} lr {s.lr:g}"
        if s.view == "bf16":
            r_bound, r_xor = ours / s.bound, ours / s.sum("xor_zstd")
            stretch = "met" if r_xor <= 0.5 else "not met"
            check(r_bound <= 1.10, f"{tag}: ours/bound {r_bound:.3f} <= 1.10")
            check(r_xor <= 0.6, f"{tag}: ours/XOR+zstd {r_xor:.3f} <= 0.6 (stretch 0.5 {stretch})")
        r_d = s.sum("t_diff", True) / s.sum("t_compare", True)
        r_a = s.sum("t_apply", True) / s.sum("t_index_put", True)
        check(r_d <= 2, f"{tag}: diff+encode / compare pass {r_d:.1f}x <= 2x")
        check(r_a <= 3, f"{tag}: decode+apply / index_put_ {r_a:.1f}x <= 3x")
    coded = [p.coders for s in all_series for p in s.pairs if p.coders]
    if coded:
        tot = {k: sum(c[k] for c in coded) for k in coded[0]}
        # ours has 4 lanes (entropy.LANES): 12 more bytes of state per stream than one coder
        # state, a fixed cost bought for decode speed; the size rule allows it
        check(tot["ours_bytes"] <= 1.005 * tot["c_bytes"] and tot["ours_enc"] <= tot["c_enc"]
              and tot["ours_dec"] <= tot["c_dec"],
              f"hand-written rANS vs constriction, all timed steps: size "
              f"{tot['ours_bytes'] / tot['c_bytes']:.4f}x, encode "
              f"{tot['ours_enc'] / tot['c_enc']:.2f}x, decode "
              f"{tot['ours_dec'] / tot['c_dec']:.2f}x "
              f"(ours / constriction; size <= 1.005 with ours' lane states, times <= 1 keep ours)")
    return "\n".join(lines)


def machine_info() -> str:
    cpu = platform.processor() or "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (
        f"Machine: {cpu}, os.cpu_count() {os.cpu_count()}, load average "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())} at start; torch threads "
        f"{torch.get_num_threads()}. Python {platform.python_version()}, torch "
        f"{torch.__version__}, numpy {np.__version__}, numba {numba.__version__}, zstandard "
        f"{zstandard.__version__}, constriction "
        f"{'absent' if constriction is None else importlib.metadata.version('constriction')}, "
        f"stitch_core {stitch_core.__version__}."
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--params", type=float, default=20e6, help="model size")
    ap.add_argument("--steps", type=int, default=20, help="measured steps per lr")
    ap.add_argument("--warmup", type=int, default=2, help="AdamW steps before the first base")
    ap.add_argument("--lrs", default="1e-6,3e-6,1e-5", help="comma-separated learning rates")
    ap.add_argument("--views", default="bf16,fp8-e4m3-block", help="comma-separated views")
    ap.add_argument("--reps", type=int, default=3, help="timing repeats (the min is kept)")
    ap.add_argument("--time-every", type=int, default=4, help="time steps 1, 1+N, 1+2N, ...")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="smoke run: 4M params, 6 steps")
    ap.add_argument("--json", type=Path, help="write every per-step measurement here")
    ap.add_argument("--md", type=Path, help="also write the printed report here")
    args = ap.parse_args(argv)
    if args.quick:
        args.params, args.steps = 4e6, 6
    args.lr_list = [float(x) for x in args.lrs.split(",")]
    args.view_list = [views.parse_view(v).name for v in args.views.split(",")]
    if min(args.steps, args.reps, args.time_every, args.threads) < 1 or args.warmup < 0:
        ap.error("--steps, --reps, --time-every, --threads must be >= 1, --warmup >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    argv_shown = sys.argv[1:] if argv is None else argv
    head = (
        f"$ .venv/bin/python {shlex.join(['benchmarks/codec.py', *argv_shown])}\n\n"
        f"{machine_info()}\n"
    )
    print(head, flush=True)
    t0 = time.perf_counter()
    warm_up_numba()
    gc.freeze()  # the many long-lived objects of torch & co. need no more scanning
    all_series = [s for lr in args.lr_list for s in run_lr(lr, args)]
    all_series.sort(key=lambda s: (args.view_list.index(s.view), s.lr))
    body = report(all_series, args) + f"\n\nTotal wall time {time.perf_counter() - t0:.0f} s."
    print(body, flush=True)
    if args.md:
        args.md.parent.mkdir(parents=True, exist_ok=True)
        args.md.write_text(head + "\n" + body + "\n")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        blob = {
            "argv": argv_shown,
            "machine": machine_info(),
            "n_params": shape_for(args.params).n_params,
            "series": [asdict(s) for s in all_series],
        }
        args.json.write_text(json.dumps(blob, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
