#!/usr/bin/env python3
"""Versions benchmark: publish overhead on the training step, and announcement-to-current latency.

Same run, side by side:
* publish(): the time it blocks the training loop vs the time to diff+encode that version's patch
  (`stitch_core.diff` on the same two views). Target: blocking <= 10% of encoding.
* a follower one version behind, subscribed over a real nats-server (reconcile timer set long so it
  cannot help): time from receiving the announcement to serving the version, vs its own fetch +
  apply time. Target: overhead (latency - fetch - apply) <= 50 ms on loopback.

    .venv/bin/python benchmarks/versions.py [--params 20e6] [--versions 10] [--board http|local]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from stitch_core import diff
from stitch_core.format import fingerprint as fpr
from stitch_core.format.views import project
from stitch_core.versions.follower import Follower
from stitch_core.versions.memory_replica import MemoryReplica
from stitch_core.versions.natsserver import NatsServer
from stitch_trainer.publisher import Publisher


def make_model(params: float) -> torch.nn.Module:
    d = 512
    vocab = 8000
    per_layer = 10 * d * d  # two d x d projections and a 4x MLP
    layers = max(1, int((params - 2 * vocab * d) // per_layer))
    blocks = []
    for _ in range(layers):
        blocks += [
            torch.nn.Linear(d, d, bias=False),
            torch.nn.Linear(d, d, bias=False),
            torch.nn.Linear(d, 4 * d, bias=False),
            torch.nn.Linear(4 * d, d, bias=False),
        ]
    m = torch.nn.ModuleDict(
        {
            "embed_tokens": torch.nn.Embedding(vocab, d),
            "layers": torch.nn.ModuleList(blocks),
            "norm": torch.nn.LayerNorm(d),
            "lm_head": torch.nn.Linear(d, vocab, bias=False),
        }
    )
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.02)
    return m


def fake_step(model: torch.nn.Module, opt: torch.optim.Optimizer, g: torch.Generator) -> None:
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g) * 1e-2 + 1e-3 * torch.randn(1, generator=g)
    opt.step()


async def follow(
    board_url: str,
    nats_url: str,
    cache: Path,
    ready: threading.Event,
    stop: asyncio.Event,
    out: dict,
) -> None:
    replica = MemoryReplica()
    f = Follower(
        board_url,
        "bench",
        replica,
        nats=nats_url,
        cache_dir=cache,
        reconcile_interval=3600,
        heartbeat_interval=3600,
    )
    await f.start()
    out["follower_obj"] = f
    ready.set()
    await stop.wait()
    out["history"] = f.history
    out["follower"] = f
    out["replica"] = replica
    await f.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--params", type=float, default=20e6)
    ap.add_argument("--versions", type=int, default=10)
    ap.add_argument("--lr", type=float, default=3e-6)
    ap.add_argument("--board", choices=["local", "http"], default="http")
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="stitch-bench-"))
    print(f"$ {' '.join([Path(sys.executable).name, *sys.argv])}")
    print(f"cpus={os.cpu_count()} torch={torch.__version__} board={a.board}\n")
    torch.manual_seed(0)
    model = make_model(a.params)
    n = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.01)
    g = torch.Generator().manual_seed(1)
    board_dir = work / "board"
    board_dir.mkdir()
    server = None
    board_url = str(board_dir)
    if a.board == "http":
        from stitch_core.versions.board.serve import serve

        server = serve(board_dir, "127.0.0.1", 0)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        board_url = f"http://127.0.0.1:{server.server_address[1]}"
    with NatsServer(store_dir=work / "js", port=None) as ns:
        pub = Publisher(str(board_dir), "bench", "bf16", nats=ns.url)
        pub.publish(0, model).result()  # v0: snapshot
        loop = asyncio.new_event_loop()
        ready, out = threading.Event(), {}
        stop = asyncio.Event()
        t = threading.Thread(
            target=lambda: loop.run_until_complete(
                follow(board_url, ns.url, work / "cache", ready, stop, out)
            ),
            daemon=True,
        )
        t.start()
        ready.wait(60)
        time.sleep(0.5)
        rows = []
        prev_view = project(dict(model.state_dict()), "bf16")
        prev_fps = fpr.state_fingerprints(prev_view)
        for step in range(1, a.versions + 1):
            fake_step(model, opt, g)
            info = pub.publish(step, model)
            m = info.result()
            f = None
            for _ in range(600):  # let the follower finish before measuring the baseline
                f = out.get("follower_obj")
                if f is not None and f.version is not None and f.version >= m.version:
                    break
                time.sleep(0.05)
            cur = project(dict(model.state_dict()), "bf16")
            t0 = time.perf_counter()
            diff(prev_view, cur, base_fingerprints=prev_fps)
            encode_s = time.perf_counter() - t0
            prev_view, prev_fps = cur, m.fingerprints
            rows.append(
                {
                    "version": m.version,
                    "blocked_s": info.blocked_seconds,
                    "encode_s": encode_s,
                    "patch_bytes": m.patch_bytes,
                    "changed": m.changed_elements / m.total_elements,
                }
            )
        loop.call_soon_threadsafe(stop.set)
        t.join(60)
        pub.close()
    if server:
        server.shutdown()
    hist = {h["version"]: h for h in out["history"]}
    print(f"model {n / 1e6:.1f}M params, AdamW lr={a.lr}, bf16 view, {a.versions} versions\n")
    print(
        "| version | changed % | patch bytes | publish() blocks ms | diff+encode ms | ratio | "
        "fetch ms | apply ms | announce→current ms | overhead ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    ratios, overheads = [], []
    for r in rows:
        h = hist.get(r["version"], {})
        lat = (h["current_at"] - h["announced_at"]) if h.get("announced_at") else float("nan")
        over = lat - h.get("fetch_s", 0) - h.get("apply_s", 0)
        ratios.append(r["blocked_s"] / r["encode_s"])
        overheads.append(over)
        print(
            f"| {r['version']} | {100 * r['changed']:.3f} | {r['patch_bytes']:,} | "
            f"{1e3 * r['blocked_s']:.1f} | {1e3 * r['encode_s']:.1f} | "
            f"{r['blocked_s'] / r['encode_s']:.2f} | {1e3 * h.get('fetch_s', float('nan')):.1f} | "
            f"{1e3 * h.get('apply_s', float('nan')):.1f} | {1e3 * lat:.1f} | {1e3 * over:.1f} |"
        )
    print(
        f"\nmedian publish-block / encode ratio: {statistics.median(ratios):.3f} (target <= 0.10)"
    )
    valid = [o for o in overheads if o == o]
    if valid:
        print(
            f"median announce→current overhead beyond fetch+apply: "
            f"{1e3 * statistics.median(valid):.1f} ms (target <= 50 ms)"
        )
    rep = out["replica"]
    ok = rep.fingerprints == prev_fps
    print(f"follower final version bitwise verified against the publisher: {ok}")
    if not ok:
        raise SystemExit("follower diverged")


if __name__ == "__main__":
    main()
