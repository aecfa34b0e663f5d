#!/usr/bin/env python3
"""What an idle engine server costs the host: CPU seconds per second of its process tree while it
serves nothing, with and without SGLang's ``--sleep-on-idle``, next to vLLM.

Why it matters here: on a 2-core host (CI, a laptop, a small rollout box) a trainer, a `stitch
pull` or a second engine's start-up share the cores with every engine that is up. An SGLang
scheduler that polls its sockets in a busy loop takes a core per TP rank away from them;
``--sleep-on-idle`` makes it wait in a zmq poll that any request wakes (Stitch's control requests
travel on the same socket, so applies are not delayed). The test command and the demo start SGLang
with it (``stitch_dev.procs.sglang_cmd``).

Each row: a real server (``stitch_dev.engines``; a tiny Qwen2, the Stitch plugin loaded, no board:
it stays not ready), started, given 5 s to settle, then its process tree's user+system CPU time
sampled over ``--seconds``.

    .venv-sglang/bin/python benchmarks/engine_idle.py --engine sglang [--tp 1,2] [--json F]
    .venv-vllm/bin/python benchmarks/engine_idle.py --engine vllm
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from stitch_dev.engines import adapter  # noqa: E402
from stitch_dev.server import wait_started  # noqa: E402
from stitch_dev.tinymodel import build_tiny_model  # noqa: E402


def idle_cpu(engine: str, tp: int, sleep: bool | None, seconds: float, root: Path) -> dict:
    """Start one server (SGLang: with or without ``--sleep-on-idle``), let it settle, and
    sample its process tree's CPU time."""
    d = build_tiny_model(root / "model", arch="qwen2", max_position_embeddings=512)
    kw = {} if sleep is None else {"sleep_on_idle": sleep}
    server = adapter(engine).start(d, root / "server.log", tp=tp, run="idle", **kw)
    try:
        wait_started(server)
        time.sleep(5)
        top = psutil.Process(server.proc.pid)
        procs = [top, *top.children(recursive=True)]
        before = {p.pid: sum(p.cpu_times()[:2]) for p in procs}
        time.sleep(seconds)
        per = {}
        for p in procs:
            try:
                per[f"{p.name()}[{p.pid}]"] = (sum(p.cpu_times()[:2]) - before[p.pid]) / seconds
            except psutil.NoSuchProcess:
                continue
    finally:
        server.stop()
    flags = {None: "", False: "(defaults)", True: "--sleep-on-idle"}[sleep]
    return {"engine": engine, "tp": tp, "flags": flags, "cores": round(sum(per.values()), 3),
            "busiest": {k: round(v, 3) for k, v in sorted(per.items(), key=lambda kv: -kv[1])
                        if v >= 0.05}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", choices=("vllm", "sglang"), required=True)
    ap.add_argument("--tp", default="1,2", help="TP sizes, comma-separated")
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    variants = [False, True] if a.engine == "sglang" else [None]
    rows = []
    for tp in (int(t) for t in a.tp.split(",")):
        for sleep in variants:
            root = Path(tempfile.mkdtemp(prefix="stitch-idle-"))
            try:
                rows.append(idle_cpu(a.engine, tp, sleep, a.seconds, root))
            finally:
                shutil.rmtree(root, ignore_errors=True)
            r = rows[-1]
            print(f"{r['engine']} tp={r['tp']} {r['flags'] or '(defaults)'}: "
                  f"{r['cores']:.2f} cores idle {r['busiest']}", flush=True)
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
