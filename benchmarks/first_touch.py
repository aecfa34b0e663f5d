#!/usr/bin/env python3
"""What first touching fresh memory costs on this host, while memory is free and past it.

Allocates 1 GB tensors one after another (kept) and fills each (`fill_`, torch's threads), timing
each fill: the page faults and the zeroing of fresh pages, plus whatever the kernel must do to
find the pages. Before each, MemFree and Cached from /proc/meminfo. Stops at `--gb`, or when
MemAvailable would fall under 1.5 GB (it never pushes the host into swapping or the OOM killer).

Why: an engine's Stitch start-up learns its layout in fresh buffers (an index pool and a shadow
of the largest parameter groups: ~2 GB at Qwen2.5-1.5B's shapes), and inside a 1.5B engine on
the 24 GB VM these benchmarks run on a 932 MB first touch cost 1.7-2.4 s against 0.26 s in a
fresh process (benchmarks/results/startup.md). This script measures first touch without an
engine, as memory fills up.

    .venv/bin/python benchmarks/first_touch.py [--gb 14] [--md FILE]
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from pathlib import Path

import torch


def meminfo() -> dict[str, int]:
    with open("/proc/meminfo") as f:
        return {ln.split(":")[0]: int(ln.split()[1]) // 1024 for ln in f}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gb", type=int, default=14)
    ap.add_argument("--md", type=Path)
    a = ap.parse_args()
    start = meminfo()
    lines = [
        "# First touch of fresh memory (`benchmarks/first_touch.py`)",
        "",
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.node()}, "
        f"{os.cpu_count()} CPUs, {start['MemTotal'] / 1024:.1f} GiB RAM, torch "
        f"{torch.__version__} ({torch.get_num_threads()} threads). At the start: MemFree "
        f"{start['MemFree']} MB, Cached {start['Cached']} MB.",
        "",
        "| GB allocated before | MemFree MB | Cached MB | first touch of 1 GB, s |",
        "|---:|---:|---:|---:|",
    ]
    kept = []
    for i in range(a.gb):
        m = meminfo()
        if m["MemAvailable"] < 1536 + 1024:
            lines.append(f"| {i} | {m['MemFree']} | {m['Cached']} | stopped: MemAvailable "
                         f"{m['MemAvailable']} MB |")
            break
        t = torch.empty(1 << 28, dtype=torch.int32)
        t0 = time.perf_counter()
        t.fill_(1)
        dt = time.perf_counter() - t0
        kept.append(t)
        lines.append(f"| {i} | {m['MemFree']} | {m['Cached']} | {dt:.3f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if a.md:
        a.md.write_text(text)


if __name__ == "__main__":
    main()
