#!/usr/bin/env python3
"""Whole-tensor fingerprint speed on the CPU, ns per element, beside two baselines.

* ``fingerprint``: ``stitch_core.format.fingerprint.fingerprint`` (one thread; the start-up proof
  runs it per tensor on the engine's threads);
* ``torch path``: ``fingerprint_torch``, the device-agnostic reference (int64 torch ops);
* ``bare sum``: ``numpy.sum`` of the tensor's unsigned integer view into uint64, a pass that only
  reads every element once: what any whole-tensor check costs at least.

Random normal values, best of --reps. Run it from two trees (a worktree of an older commit) back
to back to compare kernels; absolute times on shared machines are noise, ratios are not.

    .venv/bin/python benchmarks/fingerprint.py [--elements 67108864] [--reps 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from bench_timing import best  # noqa: E402

from stitch_core.format import dtypes  # noqa: E402
from stitch_core.format import fingerprint as fpr  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp8": torch.float8_e4m3fn}
UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32}


def best_ns(fn, n: int, reps: int) -> float:
    """ns per element of the best of `reps` calls, after one untimed call (compiles)."""
    fn()
    return best(fn, reps) * 1e9 / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--elements", type=int, default=64 << 20)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    torch.manual_seed(0)
    rows = []
    seed = fpr.seed_of("w")
    for name, dt in DTYPES.items():
        t = torch.randn(a.elements).to(dt)
        flat = dtypes.int_view(t)
        u = flat.numpy().view(UINT[t.element_size()])
        assert fpr.fingerprint("w", t) == fpr.fingerprint_torch(flat, t.element_size(), seed)
        fp = best_ns(lambda t=t: fpr.fingerprint("w", t), a.elements, a.reps)
        tp = best_ns(lambda f=flat, t=t: fpr.fingerprint_torch(f, t.element_size(), seed),
                     a.elements, max(1, a.reps // 2))
        bare = best_ns(lambda u=u: np.sum(u, dtype=np.uint64), a.elements, a.reps)
        rows.append({"dtype": name, "fingerprint_ns": fp, "torch_path_ns": tp, "bare_sum_ns": bare})
    if a.json:
        print(json.dumps({"elements": a.elements, "machine": platform.machine(), "rows": rows}))
        return
    print(f"`benchmarks/fingerprint.py`, {a.elements} elements, best of {a.reps}, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.machine()}\n")
    print("| dtype | fingerprint ns/el | torch path ns/el | bare sum ns/el | fingerprint / bare |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['dtype']} | {r['fingerprint_ns']:.3f} | {r['torch_path_ns']:.2f} | "
              f"{r['bare_sum_ns']:.3f} | {r['fingerprint_ns'] / r['bare_sum_ns']:.2f}x |")


if __name__ == "__main__":
    main()
