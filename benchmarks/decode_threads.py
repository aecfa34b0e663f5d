#!/usr/bin/env python3
"""A whole apply through the Coordinator, its decode on 1 thread against N (STITCH_DECODE_THREADS).

At a Qwen2.5 shape (benchmarks/scale.py's SHAPES; weights with `squash.pretrained_tensor`'s
statistics) a trainer publishes v0 and `2 * --pairs` versions to a local board (fp32 masters, each
version one Adam-like step: every element moves by `--lr` times a unit-scale draw, so the bf16
view changes where the step crosses a rounding boundary). An in-process engine
(benchmarks/rank_write.py's vLLM-style fused module, one `RankReplica`, TP=1, the RPC called
directly) starts from v0 through the Coordinator and follows every version; versions alternate
between the thread counts (1, N, 1, N, ...) so both see the same kind of patch in the same run.

Per version: changed elements, batches (a patch over `--apply-memory`, the engine's
`STITCH_APPLY_MEMORY`, is gathered, decoded and written batch by batch inside the pause), the
whole apply (`total_s`: read the patch, check, decode, gather, write, prove), the pause, and
the rank's write. The decode is the difference between the apply and the write; only it uses the
threads. torch runs one thread throughout (the engine's compute is not being measured).

    .venv/bin/python benchmarks/decode_threads.py [--size 0.5b] [--threads 2] [--pairs 3] \\
        [--apply-memory 64MiB] [--md FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from rank_write import FusedEngine  # noqa: E402
from scale import SHAPES, t4_fast  # noqa: E402
from squash import pretrained_tensor  # noqa: E402

from stitch_core.engine.coordinator import Coordinator  # noqa: E402
from stitch_core.engine.decode import BatchDecoder  # noqa: E402
from stitch_core.engine.replica import RankReplica  # noqa: E402
from stitch_core.settings import parse_bytes  # noqa: E402
from stitch_core.versions.board import LocalBoard  # noqa: E402
from stitch_core.versions.follower import Follower  # noqa: E402
from stitch_core.versions.materialize import pull  # noqa: E402
from stitch_trainer.publisher import Publisher  # noqa: E402

RUN = "decode"


def publish(board: Path, size: str, lr: float, n: int, seed: int) -> int:
    """v0 and n versions of one run; returns the parameter count."""
    g = torch.Generator().manual_seed(seed)
    masters = {name: pretrained_tensor(name, s, g, t4_fast)
               for name, s in SHAPES[size].shapes().items()}
    with Publisher(str(board), RUN, "bf16") as pub:
        pub.publish(0, masters).result()
        for v in range(1, n + 1):
            for w in masters.values():
                w.sub_(torch.randn(w.shape, generator=g).clamp_(-3, 3), alpha=lr)
            pub.publish(v, masters).result()
        pub.flush()
    return sum(w.numel() for w in masters.values())


async def follow(work: Path, size: str, n: int, threads: list[int], apply_memory: int,
                 log) -> list[dict]:
    d = work / "v0"
    await pull(LocalBoard(work / "board"), RUN, 0, d, work / "cache", quiet=True)
    from safetensors.torch import load_file

    eng = FusedEngine(SHAPES[size])
    for f in sorted(d.glob("*.safetensors")):
        eng.load_weights(load_file(f).items())
    rep = RankReplica(eng)

    async def rpc(req):
        return [rep.handle(req)]

    coord = Coordinator(rpc, run=RUN, apply_memory=apply_memory)
    assert await coord.start(d) == 0
    f = Follower(LocalBoard(work / "board"), RUN, coord, served=coord.served,
                 cache_dir=work / "cache")
    rows = []
    for v in range(1, n + 1):
        t = threads[(v - 1) % len(threads)]
        coord.decoder = BatchDecoder(t)
        await f.catch_up(v)
        assert coord.version == v
        st = dict(coord.last_apply or {}, threads=coord.decoder.threads)
        rows.append(st)
        log(f"  v{v}: {t} thread(s), {st['changed']:,} changed, {st['batches']} batches, "
            f"apply {st['total_s']:.2f} s, pause {st['pause_s']:.2f} s, "
            f"write {st['write_rank_s']:.2f} s")
    assert (await coord.verify())["ok"]
    return rows


def report(rows: list[dict], a: argparse.Namespace, params: int, took: float,
           shown: list[str]) -> str:
    by: dict[int, list[dict]] = {}
    for r in rows:
        by.setdefault(r["threads"], []).append(r)
    med = {t: {k: statistics.median(r[k] for r in rs)
               for k in ("changed", "batches", "total_s", "pause_s", "write_rank_s")}
           for t, rs in by.items()}
    for m in med.values():
        m["decode_s"] = m["total_s"] - m["write_rank_s"]
    one = med.get(1)
    lines = [
        "# Parallel decode: a whole apply, decode on 1 thread against N", "",
        f"`benchmarks/decode_threads.py {' '.join(shown)}`; {platform.machine()}, "
        f"{os.cpu_count()} CPUs, torch {torch.__version__} (one torch thread); "
        f"{SHAPES[a.size]} ({params / 1e9:.2f}B params), lr {a.lr:g}, apply memory "
        f"{a.apply_memory}; total {took:.0f} s.", "",
        "| decode threads | versions | changed (median) | batches | apply s | pause s | "
        "rank write s | apply - write s | apply vs 1 thread | pause vs 1 thread |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for t in sorted(med):
        m = med[t]
        rel = (f"**{one['total_s'] / m['total_s']:.2f}x** faster" if one else "-")
        prel = (f"{one['pause_s'] / m['pause_s']:.2f}x" if one else "-")
        lines.append(f"| {t} | {len(by[t])} | {m['changed']:,.0f} | {m['batches']:.0f} | "
                     f"{m['total_s']:.2f} | {m['pause_s']:.2f} | {m['write_rank_s']:.2f} | "
                     f"{m['decode_s']:.2f} | {rel} | {prel} |")
    lines += ["", "Per version:", "", "| version | threads | changed | batches | apply s | "
              "pause s | gather s | rank write s |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['version']} | {r['threads']} | {r['changed']:,} | {r['batches']} | "
                     f"{r['total_s']:.2f} | {r['pause_s']:.2f} | {r['gather_s']:.2f} | "
                     f"{r['write_rank_s']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--size", default="0.5b", choices=sorted(SHAPES))
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--threads", type=int, default=2, help="N, against 1")
    ap.add_argument("--pairs", type=int, default=3, help="versions per thread count")
    ap.add_argument("--apply-memory", default="64MiB", help="the engine's STITCH_APPLY_MEMORY")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--md", type=Path, default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    log = lambda s: print(s, flush=True)  # noqa: E731
    threads = [1, a.threads]
    n = 2 * a.pairs
    with tempfile.TemporaryDirectory(prefix="stitch-decode-") as tmp:
        work = Path(tmp)
        log(f"publishing v0..v{n} at {a.size} ...")
        params = publish(work / "board", a.size, a.lr, n, a.seed)
        log("following ...")
        rows = asyncio.run(follow(work, a.size, n, threads, parse_bytes(a.apply_memory), log))
    text = report(rows, a, params, time.perf_counter() - t0,
                  sys.argv[1:] if argv is None else argv)
    print(text)
    if a.md:
        a.md.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
