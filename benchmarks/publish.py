#!/usr/bin/env python3
"""`stitch publish` from a checkpoint directory vs `stitch diff` vs a bare load+compare, whole
processes, side by side in one run.

Four commands, each a fresh process (subprocess), each timed from spawn to exit, median of
`--reps` (3):

* bare: a script that loads both checkpoints (`safetensors.torch.load_file`) and runs
  `torch.nonzero(a.view(int16) != b.view(int16))` on every tensor: the floor any diff pays;
* `stitch diff A B -o p.stp`;
* `stitch publish BOARD B --run R`, with its local state (`<cache>/<run>/published/`, written by
  the publish of A): the board's latest is A, the state holds A;
* the same publish with the state removed: it rebuilds A from the board (a snapshot + a patch).

Before each publish the board and the cache are put back as they were (outside the timer), so
every publish makes the same version from the same base, and before every timed command what
the set-up wrote is written back (`os.sync`, outside the timer), so no command pays for another
step's writeback.

Data: a Llama-like model of SmolLM-135M's shape (30 layers, hidden 576, MLP 1536, 9 heads, 3 KV
heads, vocab 49152, tied embeddings: 134.5M params, 269 MB in bf16), one safetensors file in an
HF directory with a config.json. fp32 masters ~N(0, 0.02) for matrices, 1 + N(0, 0.01) for norms;
each checkpoint is the bf16 cast of the masters after an Adam-like step (every element moves by
lr * sign(noise), lr 2e-7), which changes ~1% of the bf16 elements per step. Checkpoints: C
(published first, a snapshot), A (a patch), B (the publish measured).

    .venv/bin/python benchmarks/publish.py [--layers 30] [--reps 3] [--md results/publish.md]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]
RUN = "bench"
BARE = """
import sys, torch
from safetensors.torch import load_file
a, b = load_file(sys.argv[1]), load_file(sys.argv[2])
n = 0
for k in a:
    n += len(torch.nonzero(a[k].view(torch.int16) != b[k].view(torch.int16)))
print(n)
"""
# where a `stitch diff` process spends its time (what is left above the bare compare)
PHASES = """
import io, json, sys, time
t = [time.perf_counter()]
import torch, safetensors.torch
t.append(time.perf_counter())
import stitch_core.cli.main
m = sys.modules["stitch_core.cli.main"]
m.parse_args(["diff", *sys.argv[1:3], "-o", "p.stp"])  # the parsers `stitch diff` builds
import stitch_core.cli.patches as v  # and the module that runs it
t.append(time.perf_counter())
from stitch_core.format.patch import PatchBuilder
g = torch.Generator().manual_seed(0)
x = torch.randn(4096, generator=g).bfloat16()
y = x.clone(); y[::7] = torch.randn(586, generator=g).bfloat16()
PatchBuilder(io.BytesIO()).add("warm", x, y)  # numba: each compiled function's first call
t.append(time.perf_counter())
from stitch_core.format.checkpoint import open_checkpoint
a, b = open_checkpoint(sys.argv[1]), open_checkpoint(sys.argv[2])
ta, tb = v._Tensors(a), v._Tensors(b)
A = {n: ta.get(n) for n in a.names()}; B = {n: tb.get(n) for n in b.names()}
t.append(time.perf_counter())
for n in A:
    len(torch.nonzero(A[n].view(torch.int16) != B[n].view(torch.int16)))
t.append(time.perf_counter())
pb = PatchBuilder(io.BytesIO())
for n in A:
    pb.add(n, A[n], B[n])
pb.finish()
t.append(time.perf_counter())
keys = ["import torch+safetensors", "import the stitch CLI (what `diff` loads)",
        "numba: first calls (cached code loaded)", "load both checkpoints",
        "compare+nonzero (the bare loop)", "PatchBuilder: fingerprint+compare+encode"]
print(json.dumps(dict(zip(keys, [t[i + 1] - t[i] for i in range(len(keys))]))))
"""


def shapes(layers: int, hidden: int = 576, mlp: int = 1536, heads: int = 9, kv: int = 3,
           vocab: int = 49152) -> dict[str, tuple[int, ...]]:
    hd = hidden // heads
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden),
                                       "model.norm.weight": (hidden,)}
    for i in range(layers):
        p = f"model.layers.{i}."
        out |= {p + "self_attn.q_proj.weight": (hidden, hidden),
                p + "self_attn.k_proj.weight": (kv * hd, hidden),
                p + "self_attn.v_proj.weight": (kv * hd, hidden),
                p + "self_attn.o_proj.weight": (hidden, hidden),
                p + "mlp.gate_proj.weight": (mlp, hidden),
                p + "mlp.up_proj.weight": (mlp, hidden),
                p + "mlp.down_proj.weight": (hidden, mlp),
                p + "input_layernorm.weight": (hidden,),
                p + "post_attention_layernorm.weight": (hidden,)}
    return out


def make_checkpoints(d: Path, layers: int, lr: float, seed: int = 0) -> list[Path]:
    """Three HF directories C, A, B: bf16 casts of fp32 masters one Adam-like step apart."""
    g = torch.Generator().manual_seed(seed)
    masters = {}
    for n, s in shapes(layers).items():
        t = torch.randn(s, generator=g)
        masters[n] = 1 + 0.01 * t if len(s) == 1 else 0.02 * t
    dirs = []
    for name in ("C", "A", "B"):
        out = d / name
        out.mkdir()
        save_file({k: v.bfloat16() for k, v in masters.items()}, str(out / "model.safetensors"))
        (out / "config.json").write_text(json.dumps({"model_type": "llama",
                                                     "num_hidden_layers": layers}))
        dirs.append(out)
        for v in masters.values():  # the next step: every element moves by lr * sign(noise)
            v.add_(torch.randn(v.shape, generator=g).sign_(), alpha=lr)
    return dirs


def timed(argv: list[str], env: dict[str, str]) -> tuple[float, str, str]:
    t0 = time.perf_counter()
    r = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT)
    dt = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed:\n{r.stderr}")
    return dt, r.stdout, r.stderr


def restore(saved: Path, live: Path) -> None:
    shutil.rmtree(live, ignore_errors=True)
    shutil.copytree(saved, live)


def settle() -> None:
    """Before each timed command, outside its timer: write back what the set-up left dirty (a
    restored board and state are ~2x the checkpoint), so that no command pays for the writeback
    of files an earlier step wrote; each pays for its own writes."""
    os.sync()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--lr", type=float, default=2e-7)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--md", type=Path, help="write the results table here")
    ap.add_argument("--tmp", type=Path, help="work directory (default: a temporary one)")
    ap.add_argument("--note", default="", help="a line for the results (e.g. the commit measured)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads of every command (OMP_NUM_THREADS; 0: torch's default)")
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="stitch-bench-publish-", dir=a.tmp))
    env = dict(os.environ, PYTHONPATH=str(ROOT), XDG_CACHE_HOME=str(work / "xdg"))
    if a.threads:
        env["OMP_NUM_THREADS"] = str(a.threads)
    py = sys.executable
    stitch = [py, "-m", "stitch_core.cli"]
    try:
        t0 = time.perf_counter()
        C, A, B = make_checkpoints(work, a.layers, a.lr)
        size = (B / "model.safetensors").stat().st_size
        print(f"checkpoints: {size / 1e6:.0f} MB each ({time.perf_counter() - t0:.1f} s)",
              file=sys.stderr)
        board, cache = work / "board", work / "cache"

        def pub(src: Path) -> list[str]:
            return [*stitch, "publish", str(board), str(src), "--run", RUN, "--cache-dir",
                    str(cache), "--json"]

        for src in (C, A):  # v0 a snapshot, v1 a patch; the state holds v1 (A)
            timed(pub(src), env)
        state = cache / RUN / "published"
        if not state.is_dir():
            raise SystemExit(f"no local state at {state}")
        saved_board, saved_cache = work / "saved-board", work / "saved-cache"
        shutil.copytree(board, saved_board)
        shutil.copytree(cache, saved_cache)
        patch = work / "p.stp"

        def bare() -> tuple[float, str, str]:
            settle()
            return timed([py, "-c", BARE, str(A / "model.safetensors"),
                          str(B / "model.safetensors")], env)

        def diff() -> tuple[float, str, str]:
            settle()
            return timed([*stitch, "diff", str(A), str(B), "-o", str(patch), "--force",
                          "--json"], env)

        def publish(keep_state: bool) -> tuple[float, str, str]:
            restore(saved_board, board)
            restore(saved_cache, cache)
            if not keep_state:
                shutil.rmtree(state)
            settle()
            r = timed(pub(B), env)
            out = json.loads(r[1])
            if out["version"] != 2 or out["kind"] != "patch":
                raise SystemExit(f"unexpected publish: {out}")
            rebuilt = "rebuilding" in r[2]
            if rebuilt == keep_state:
                raise SystemExit(f"publish (state kept: {keep_state}) said: {r[2]!r}")
            return r

        def phases() -> tuple[float, str, str]:
            return timed([py, "-c", PHASES, str(A), str(B)], env)

        cases = {"bare load+compare": bare, "stitch diff": diff,
                 "stitch publish, local state": lambda: publish(True),
                 "stitch publish, no state (rebuilt from the board)": lambda: publish(False)}
        times: dict[str, list[float]] = {k: [] for k in cases}
        outs: dict[str, str] = {}
        split: list[dict[str, float]] = []
        bare()  # warm the page cache and numba's cache once, untimed
        diff()
        for _ in range(a.reps):  # interleaved, so drift hits every case alike
            for k, fn in cases.items():
                dt, out, _ = fn()
                times[k].append(dt)
                outs[k] = out
            split.append(json.loads(phases()[1]))
        med = {k: statistics.median(v) for k, v in times.items()}
        phase = {k: statistics.median(s[k] for s in split) for k in split[0]}
        changed = json.loads(outs["stitch diff"])["changed_elements"]
        total = json.loads(outs["stitch diff"])["total_elements"]
        pb = json.loads(outs["stitch publish, local state"])["patch_bytes"]
        bare_s, diff_s = med["bare load+compare"], med["stitch diff"]
        lines = [
            "# `stitch publish` vs `stitch diff` vs a bare load+compare",
            "",
            f"`benchmarks/publish.py --layers {a.layers} --reps {a.reps}` on "
            f"{platform.node() or 'this host'} ({os.cpu_count()} CPUs, torch "
            f"{torch.__version__}, OMP_NUM_THREADS={env.get('OMP_NUM_THREADS', 'unset')} for "
            f"every command); {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. {a.note}",
            "",
            f"Model: SmolLM-135M shape, {total / 1e6:.1f}M params, {size / 1e6:.0f} MB bf16 "
            f"(one file in an HF directory); {changed:,} elements changed "
            f"({100 * changed / total:.2f}%), patch {pb:,} bytes.",
            "Whole processes (spawn to exit), median of "
            f"{a.reps}, interleaved; page cache warm.",
            "",
            "| command | median s | runs s | vs bare | vs `stitch diff` |",
            "|---|---:|---|---:|---:|",
        ]
        for k, v in med.items():
            runs = ", ".join(f"{x:.2f}" for x in times[k])
            lines.append(f"| {k} | {v:.2f} | {runs} | {v / bare_s:.2f}x | {v / diff_s:.2f}x |")
        lines += [
            "",
            f"Targets: `stitch diff` <= 1.5x bare (measured {diff_s / bare_s:.2f}x); "
            f"publish with local state <= 1.3x `stitch diff` (measured "
            f"{med['stitch publish, local state'] / diff_s:.2f}x).",
            "",
            "Where a `stitch diff`-like process spends its time (one more process per round, "
            "timers inside it, median of the rounds; the first calls of numba's functions load "
            "their cached machine code):",
            "",
            "| phase | median s |",
            "|---|---:|",
            *[f"| {k} | {v:.2f} |" for k, v in phase.items()],
        ]
        text = "\n".join(lines) + "\n"
        print(text)
        if a.md:
            a.md.parent.mkdir(parents=True, exist_ok=True)
            a.md.write_text(text)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
