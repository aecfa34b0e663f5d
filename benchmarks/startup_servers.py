#!/usr/bin/env python3
"""Stitch's start-up in a real vLLM or SGLang server, against the same server without Stitch.

`startup.py` times Stitch's set-up inside an in-process vLLM engine. This one starts the servers
users run (``vllm.entrypoints.openai.api_server`` / ``sglang.launch_server``, as the engine test
suites start them: CPU, TP=1, bf16, small KV pool), each a fresh process, timed from spawn:

* **plain**: the server without Stitch (vLLM: no worker extension, no middleware and
  ``VLLM_PLUGINS=none``, so not even the CPU weight keeper loads; SGLang: ``STITCH_SGLANG=0``),
  until ``/health`` answers 200 (SGLang: after its own warm-up request);
* **first start**: a follower of a run whose v0 is that checkpoint (published with
  ``stitch publish`` to a local board; every server starts from v0 as `pull` writes it), with
  an empty ``STITCH_CACHE_DIR``, until it serves v0 (status ``serving``, v0; SGLang: and
  healthy): the layout is learned through the loaders;
* **restart**: the same follower command again on the same cache: the layout is read from it.

For both follower starts the table gives the wall time and Stitch's own start-up as the engine
reports it (``/stitch/status`` ``fingerprint_check.seconds``: layout, per-rank sums, derived-copy
check and the comparison with the manifest; ``layout_s``: the slowest rank's layout). "/ plain"
divides Stitch's own seconds by the plain server's start. Rounds run plain, first, restart in
turn, `--reps` rounds; the first round after a venv is built also compiles numba's kernels
into its cache.

    .venv-vllm/bin/python benchmarks/startup_servers.py --engine vllm [--size q05b] [--reps 2]
    .venv-sglang/bin/python benchmarks/startup_servers.py --engine sglang [--size q05b]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
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

from startup import SIZES  # noqa: E402 - the same model shapes as the in-process benchmark

from stitch_core.engine.layout import read_safetensors_shapes  # noqa: E402
from stitch_dev.engines import SglangServer, VllmServer  # noqa: E402
from stitch_dev.tinymodel import REALISTIC, build_tiny_model  # noqa: E402

RUN = "startup"


def start(engine: str, kind: str, model: Path, work: Path, n: int) -> dict:
    """One server start of `kind` (plain | first | restart); seconds and Stitch's status."""
    log = work / f"{engine}-{kind}-{n}.log"
    cache = work / f"cache-{n}"
    if kind == "first":
        shutil.rmtree(cache, ignore_errors=True)
    t0 = time.monotonic()
    if kind == "plain":
        server = (VllmServer(model, log, plain=True) if engine == "vllm"
                  else SglangServer(model, log, plain=True))
    else:
        kw = {"board": str(work / "board"), "run": RUN, "cache_dir": str(cache)}
        server = (VllmServer(model, log, **kw) if engine == "vllm"
                  else SglangServer(model, log, **kw))
    try:
        if kind == "plain":
            server.wait_healthy(900)
            return {"kind": kind, "wall_s": time.monotonic() - t0}
        st = server.wait_version(0, timeout=900)
        if engine == "sglang":
            server.wait_healthy(900)
        wall = time.monotonic() - t0
        check = st["fingerprint_check"]
        if check.get("kind") != "full" or "layout_s" not in check:
            raise RuntimeError(f"not a start-up proof: {check}")
        return {"kind": kind, "wall_s": wall, "stitch_s": check["seconds"],
                "layout_s": check["layout_s"], "cached": check["layout_cached"],
                "templated": check.get("layout_templated", 0)}
    finally:
        server.stop()


def render(engine: str, size: str, params: int, rounds: list[dict], version: str) -> str:
    now = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    out = [f"# Stitch's start-up in a {engine} server ({size}, {params / 1e6:.0f}M params)", "",
           f"`benchmarks/startup_servers.py --engine {engine} --size {size}`; {now}; "
           f"{platform.machine()} {os.cpu_count()} CPUs, {engine} {version}, TP=1, bf16, "
           "servers as the engine test suites start them.", "",
           "| round | plain start s | first start: wall s | Stitch's own s (layout s) "
           "| / plain | restart: wall s | Stitch's own s (layout s) | / plain | layers templated |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for i, r in enumerate(rounds):
        p, f, a = r["plain"], r["first"], r["restart"]
        assert a["cached"] and not f["cached"], r
        out.append(
            f"| {i + 1}{' (first in this venv)' if i == 0 else ''} | {p['wall_s']:.1f} | "
            f"{f['wall_s']:.1f} | {f['stitch_s']:.2f} ({f['layout_s']:.2f}) | "
            f"{f['stitch_s'] / p['wall_s']:.3f}x | {a['wall_s']:.1f} | "
            f"{a['stitch_s']:.2f} ({a['layout_s']:.3f}) | {a['stitch_s'] / p['wall_s']:.3f}x | "
            f"{f['templated']} |")
    if len(rounds) > 1:
        steady = rounds[1:]
        med = {k: statistics.median(r[k]["stitch_s"] / r["plain"]["wall_s"] for r in steady)
               for k in ("first", "restart")}
        out += ["", f"Median after the first round: first start {med['first']:.3f}x, restart "
                f"{med['restart']:.3f}x the plain server's start."]
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engine", choices=("vllm", "sglang"), required=True)
    ap.add_argument("--size", default="q05b", choices=sorted(SIZES))
    ap.add_argument("--reps", type=int, default=2, help="rounds of plain, first, restart")
    ap.add_argument("--md", type=Path)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    mod = __import__(a.engine)
    work = Path(tempfile.mkdtemp(prefix="stitch-startup-servers-"))
    try:
        cfg = SIZES[a.size] or REALISTIC
        model = build_tiny_model(work / "model", seed=0, **cfg)
        params = sum(math.prod(shp) for shp, _ in read_safetensors_shapes(model).values())
        stitch = Path(sys.executable).with_name("stitch")
        subprocess.run([str(stitch), "publish", str(work / "board"), str(model), "--run", RUN,
                        "--config-dir", str(model)], check=True, stdout=subprocess.DEVNULL)
        # the engines start from v0 as a follower's host gets it (`pull`): the follower knows
        # the version it loaded, and its start-up is the proof of it
        from stitch_core.versions.board import LocalBoard
        from stitch_core.versions.materialize import pull

        v0 = work / "v0"
        asyncio.run(pull(LocalBoard(work / "board"), RUN, 0, v0, work / "pull-cache", quiet=True))
        shutil.rmtree(model)
        rounds = []
        for n in range(a.reps):
            r = {}
            for kind in ("plain", "first", "restart"):
                r[kind] = start(a.engine, kind, v0, work, n)
                print(f"round {n + 1} {kind}: {json.dumps(r[kind])}", flush=True)
            rounds.append(r)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    md = render(a.engine, a.size, params, rounds, getattr(mod, "__version__", "?"))
    print(md)
    if a.md:
        a.md.write_text(md)
    if a.json:
        a.json.write_text(json.dumps({"engine": a.engine, "size": a.size, "rounds": rounds}))


if __name__ == "__main__":
    main()
