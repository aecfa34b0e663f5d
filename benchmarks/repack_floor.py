#!/usr/bin/env python3
"""The floor of a vLLM CPU re-pack: oneDNN's own packing of every linear layer of a model.

On hosts where vLLM's CPU backend packs its linear layers (oneDNN handles,
``vllm._custom_ops.create_onednn_mm``; AMX and AVX-512 hosts), a packed copy is opaque, so an
in-place apply re-packs every layer it touched (`stitch_vllm.cpu.repack_dirty`), and at RL
learning rates that is every layer. This times, in one process and the same run:

* **oneDNN pack**: ``create_onednn_mm(weight.t(), 32)`` for every linear weight of the model,
  exactly what vLLM's ``dispatch_cpu_unquantized_gemm`` calls at load and what a re-pack calls
  again, on 1 and on all torch threads;
* **bare copy**: ``clone()`` of the same weights (the memory system's rate for the same bytes).

Compare with the "re-pack" column of `benchmarks/engine_apply.py` at the same size: if the
re-pack runs at about the oneDNN pack's rate, what is left of the vLLM pause on such hosts is
oneDNN's packing, not Stitch. Weights are random bf16 at Qwen2.5 shapes (fused qkv and gate_up,
untied lm_head at 0.5B), min of --reps runs.

    .venv-vllm/bin/python benchmarks/repack_floor.py [--sizes q05b] [--reps 3] [--md FILE]
"""

from __future__ import annotations

import argparse
import os
import platform
from pathlib import Path

import torch
from bench_timing import best

# hidden, layers, heads, kv heads, intermediate, vocab, tied lm_head
SIZES = {
    "q05b": (896, 24, 14, 2, 4864, 151936, False),
    "q15b": (1536, 28, 12, 2, 8960, 151936, True),
}


def linear_shapes(size: str) -> list[tuple[int, int]]:
    """(out, in) of every linear weight vLLM packs: qkv, o, gate_up, down per layer; lm_head."""
    h, layers, heads, kv, inter, vocab, tied = SIZES[size]
    d = h // heads
    per_layer = [((heads + 2 * kv) * d, h), (h, heads * d), (2 * inter, h), (h, inter)]
    return per_layer * layers + ([] if tied else [(vocab, h)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="q05b")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--md", type=Path)
    args = ap.parse_args()
    from vllm import _custom_ops as ops

    if not ops._supports_onednn:
        raise SystemExit("this vLLM build has no oneDNN GEMM: nothing is packed here")
    threads = torch.get_num_threads()
    cpu = platform.processor() or platform.machine()
    lines = [f"# oneDNN packing of every linear layer vs a bare copy ({cpu}, "
             f"{os.cpu_count()} CPUs, torch {torch.__version__})", "",
             "| model | linear layers | GB (bf16) | oneDNN pack, 1 thread | oneDNN pack, "
             f"{threads} threads | bare copy, {threads} threads | pack / copy |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for size in args.sizes.split(","):
        g = torch.Generator().manual_seed(0)
        ws = [torch.randn(n, k, generator=g).to(torch.bfloat16) for n, k in linear_shapes(size)]
        gb = sum(w.numel() * 2 for w in ws) / 1e9
        def pack(ws=ws):
            return [ops.create_onednn_mm(w.t(), 32) for w in ws]

        def copy_all(ws=ws):
            return [w.clone() for w in ws]

        torch.set_num_threads(1)
        one = best(pack, args.reps)
        torch.set_num_threads(threads)
        many = best(pack, args.reps)
        copy = best(copy_all, args.reps)
        lines.append(f"| {size} | {len(ws)} | {gb:.2f} | {one * 1e3:.0f} ms ({gb / one:.1f} GB/s) "
                     f"| {many * 1e3:.0f} ms ({gb / many:.1f} GB/s) | {copy * 1e3:.0f} ms "
                     f"({gb / copy:.1f} GB/s) | {many / copy:.1f}x |")
        del ws
    text = "\n".join(lines) + "\n"
    print(text)
    if args.md:
        args.md.write_text(text)


if __name__ == "__main__":
    main()
