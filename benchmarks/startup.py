#!/usr/bin/env python3
"""Stitch's start-up against the engine's own, first start and restart (layout cache).

One in-process vLLM engine (TP=1, CPU, bf16) per size. Timed: the engine's own start (``LLM(...)``
to ready), then Stitch's start-up work on its rank ("whole": layout, sums and the check that
every derived copy is current), twice, as ``RankReplica.setup`` does it at a
start (the layout, then the full per-tensor sums the start-up proof compares with the manifest):

* **first start**: an empty layout cache: the layout is learned through the model's loaders and
  written to the cache;
* **restart**: a new replica on the same engine with the same cache (what an engine restarted on
  the same model and code meets): the layout is read from the cache.

The sums are the proof and are paid at every start (they read every weight once). The engine's
start is timed with Stitch's plugin loaded (as a follower runs), which adds its registration and
the packed copies' stamps to it: `plugin_load.py` measures that part against a plain engine.
Models: random weights of Qwen2 shapes (``stitch_dev.tinymodel``): ``50x`` (23M),
``realistic`` (83M, Llama, tied), ``q05b`` (Qwen2.5-0.5B's shapes, 0.63B with an untied
lm_head; ~4 GB of RAM), ``q15b`` (Qwen2.5-1.5B's shapes, 1.54B, tied; ~10 GB of RAM, not in
the default sizes).

    .venv-vllm/bin/python benchmarks/startup.py [--sizes realistic,q05b] [--md FILE]
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
EXT = "stitch_vllm.worker.StitchWorkerExtension"

SIZES = {
    "50x": {"arch": "qwen2", "hidden_size": 512, "num_layers": 6, "num_heads": 8,
            "num_kv_heads": 4, "intermediate_size": 1536, "vocab_size": 4000},
    "realistic": None,  # stitch_dev.tinymodel.REALISTIC
    "q05b": {"arch": "qwen2", "hidden_size": 896, "num_layers": 24, "num_heads": 14,
             "num_kv_heads": 2, "intermediate_size": 4864, "vocab_size": 151936,
             "max_position_embeddings": 256},
    "q15b": {"arch": "qwen2", "hidden_size": 1536, "num_layers": 28, "num_heads": 12,
             "num_kv_heads": 2, "intermediate_size": 8960, "vocab_size": 151936,
             "max_position_embeddings": 256, "tie_word_embeddings": True},
}


def _setups(worker, shapes, cache_dir: str) -> list[dict]:
    """Two set-ups on this rank: cold cache, then a new replica reading the cache."""
    from stitch_core.engine.layout_cache import LayoutCache, code_identity
    from stitch_core.engine.replica import RankReplica

    model = worker.model_runner.get_model()
    out = []
    for _ in range(2):
        cache = LayoutCache(cache_dir, {"engine": "vllm", **code_identity(model)})
        rep = RankReplica(model, layout_cache=cache, not_state=("kv_cache",))  # as the plugin
        t = time.perf_counter()
        r = rep.setup(shapes)
        out.append({"cached": r.cached, "layout_s": r.learn_s, "sums_s": r.sums_s,
                    "total_s": time.perf_counter() - t,
                    "templated": getattr(r, "templated", 0)})
    return out


def measure(size: str, work: Path) -> dict:
    from vllm import LLM

    from stitch_core.engine.layout import read_safetensors_shapes
    from stitch_core.format import dtypes
    from stitch_dev.tinymodel import REALISTIC, build_tiny_model

    cfg = SIZES[size] or REALISTIC
    d = build_tiny_model(work / size, seed=0, **cfg)
    shapes = {n: (tuple(s), dtypes.info(t).name)
              for n, (s, t) in read_safetensors_shapes(d).items()}
    params = sum(math.prod(s) for s, _ in shapes.values())
    t = time.perf_counter()
    llm = LLM(model=str(d), dtype="bfloat16", max_model_len=256, enforce_eager=True, seed=0,
              max_num_seqs=4, worker_extension_cls=EXT, disable_log_stats=True)
    engine_s = time.perf_counter() - t
    try:
        first, again = llm.collective_rpc(_setups, args=(shapes, str(work / f"{size}-layouts")))[0]
    finally:
        import contextlib
        import gc

        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        with contextlib.suppress(Exception):
            llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        cleanup_dist_env_and_memory()
    return {"size": size, "params": params, "engine_s": engine_s, "first": first,
            "restart": again}


def render(rows: list[dict]) -> str:
    import vllm

    now = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    lines = ["# Stitch start-up vs the engine's own start (layout cache)", "",
             f"`benchmarks/startup.py` (read its docstring); {now}; "
             f"{platform.machine()} {os.cpu_count()} CPUs, vLLM {vllm.__version__}, in-process "
             "engine, TP=1, bf16. Shared 2-core box: compare within a row.", "",
             "| model | params | engine start s | first start: layout s + sums s | first start, "
             "whole s | / engine | restart: layout (cached) s + sums s | restart, whole s | "
             "/ engine | layout: cached / learned | layers templated |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        f, a, e = r["first"], r["restart"], r["engine_s"]
        assert a["cached"] and not f["cached"], r
        lines.append(
            f"| {r['size']} | {r['params'] / 1e6:.0f}M | {e:.1f} | {f['layout_s']:.2f} + "
            f"{f['sums_s']:.2f} | {f['total_s']:.2f} | {f['total_s'] / e:.2f}x | "
            f"{a['layout_s']:.3f} + {a['sums_s']:.2f} | {a['total_s']:.2f} | "
            f"{a['total_s'] / e:.3f}x | "
            f"{a['layout_s'] / f['layout_s']:.3f} | {f.get('templated', 0)} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="50x,realistic,q05b")
    ap.add_argument("--md", type=Path, default=None)
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="stitch-startup-"))
    try:
        rows = [measure(s, work) for s in a.sizes.split(",")]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    md = render(rows)
    print(md)
    if a.md:
        a.md.write_text(md)


if __name__ == "__main__":
    main()
