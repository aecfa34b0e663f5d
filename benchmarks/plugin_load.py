#!/usr/bin/env python3
"""What Stitch's vLLM plugin adds to the engine's own start, before any Stitch start-up work.

Stitch's start-up (`startup.py`, `startup_servers.py`) is the layout and the proof, run once the
engine is up. Before that the plugin already costs something inside the engine's own start: its
registration in every process (imports, the CPU weight keeper's wrappers) and, on the CPU, the
stamps of every packed copy the keeper registers while vLLM packs (each copy's sources hashed
once). Those seconds land in the engine's start, not in Stitch's reported start-up. This script
measures them: an in-process vLLM engine (``LLM(...)``, TP=1, CPU, bf16, the same settings as
`startup.py`) started in a fresh process each time, alternately **plain** (``VLLM_PLUGINS=none``,
no worker extension) and **with Stitch** (the plugin and the worker extension, as a follower
runs), `--reps` pairs, on one model built once; the median of each and their difference.

    .venv-vllm/bin/python benchmarks/plugin_load.py [--size q05b] [--reps 5] [--md FILE]
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from startup import EXT, SIZES  # noqa: E402 - the in-process benchmark's settings and shapes

ONE = """
import json, os, sys, time
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
from vllm import LLM
kw = {"worker_extension_cls": sys.argv[2]} if sys.argv[2] else {}
t = time.perf_counter()
llm = LLM(model=sys.argv[1], dtype="bfloat16", max_model_len=256, enforce_eager=True, seed=0,
          max_num_seqs=4, disable_log_stats=True, **kw)
print(json.dumps({"engine_s": time.perf_counter() - t}))
"""


REGISTER = """
import json, sys, time
import vllm.model_executor.layers.utils  # imported by the engine before the plugin runs
t = time.perf_counter()
import stitch_vllm.plugin
stitch_vllm.plugin.register()
print(json.dumps({"s": time.perf_counter() - t, "numba": "numba" in sys.modules}))
"""


def registration(cwd: Path) -> dict:
    """The plugin's registration alone in a fresh process (what vLLM runs in each of its
    processes: the API server, the engine core, every worker): seconds, and whether it imported
    numba (which only the processes that learn layouts, prove or decode need)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", REGISTER], env=env, cwd=cwd, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def start(model: Path, stitch: bool, cwd: Path) -> float:
    env = dict(os.environ, PYTHONPATH=str(ROOT))  # this tree's Stitch (compare trees: run each)
    if not stitch:
        env["VLLM_PLUGINS"] = "none"  # no entry-point plugin: not Stitch's either
    out = subprocess.run([sys.executable, "-c", ONE, str(model), EXT if stitch else ""],
                         env=env, cwd=cwd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])["engine_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="q05b", choices=sorted(SIZES))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--md", type=Path)
    a = ap.parse_args()
    import vllm

    from stitch_dev.tinymodel import REALISTIC, build_tiny_model

    work = Path(tempfile.mkdtemp(prefix="stitch-plugin-load-"))
    try:
        model = build_tiny_model(work / "model", seed=0, **(SIZES[a.size] or REALISTIC))
        start(model, True, work)  # warm-up: numba's cache, the page cache
        regs = [registration(work) for _ in range(5)]
        runs: dict[str, list[float]] = {"plain": [], "stitch": []}
        for i in range(a.reps):
            for kind in ("plain", "stitch") if i % 2 == 0 else ("stitch", "plain"):
                runs[kind].append(start(model, kind == "stitch", work))
                print(f"pair {i + 1} {kind}: {runs[kind][-1]:.2f} s", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in runs.items()}
    reg_runs = ", ".join(f"{r['s']:.3f}" for r in regs)
    now = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    md = "\n".join([
        f"# The vLLM plugin's cost inside the engine's own start ({a.size})", "",
        f"`benchmarks/plugin_load.py --size {a.size} --reps {a.reps}`; {now}; "
        f"{platform.machine()} {os.cpu_count()} CPUs, vLLM {vllm.__version__}, in-process engine "
        "started in a fresh process each time, plain and with Stitch alternating (after one "
        "warm-up start with Stitch).", "",
        "| engine start | runs s | median s |", "|---|---|---:|",
        *(f"| {k} | {', '.join(f'{x:.2f}' for x in v)} | {med[k]:.2f} |"
          for k, v in runs.items()),
        "", f"With Stitch minus plain, medians: **{med['stitch'] - med['plain']:+.2f} s** "
        f"({(med['stitch'] - med['plain']) / med['plain']:+.1%} of the plain start).", "",
        "The plugin's registration alone, a fresh process each (vLLM's layer utils imported "
        f"first), 5 runs: median {statistics.median(r['s'] for r in regs):.3f} s "
        f"({reg_runs}); imports numba: "
        f"{any(r['numba'] for r in regs)}."]) + "\n"
    print(md)
    if a.md:
        a.md.write_text(md)


if __name__ == "__main__":
    main()
