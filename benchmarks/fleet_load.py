#!/usr/bin/env python3
"""Fleet load: many followers of one run through one nats-server and one HTTP board, loopback.

    .venv/bin/python benchmarks/fleet_load.py [--followers 100] [--versions 10] [--json]

One trainer (a real ``Publisher``, in this process) publishes ``--versions`` AdamW versions of a
small model (``--params``, bf16 view) to a board directory and announces them on a real
``nats-server``. The board is served over HTTP by a separate process (this script's ``--_board``
mode: ``stitch_core.versions.board.serve`` with a handler that counts requests and body bytes,
read at ``/.stats``), so its CPU is its own. ``--followers`` ``Follower``s run in this process,
on one asyncio event loop, each with its own ``MemoryReplica`` (the weights in memory, every
tensor's fingerprint checked at every step), its own cache directory, HTTP client and NATS
connection, and the defaults of an engine: reconcile every 5 s, heartbeat every 2 s. They start
empty and load v0 (the snapshot) from the board before the measured versions.

Per version, after every follower holds it: announce -> current per follower (the follower's
own ``history``: the announcement's arrival to the end of its apply), board requests and body
bytes, nats-server and board-server CPU seconds (``/proc/<pid>/stat``), and this process's CPU.
At the end: every follower's ``applied`` list must be ``[0, 1, ..., N]`` (no version lost or
skipped) and every replica must be bit-identical to the trainer's view of the last version
(compared tensor by tensor, and its fingerprints recomputed).

All followers share this machine's two cores: announce -> current is mostly their queueing
behind each other for CPU (fetch, SHA-256, decode, apply), which a fleet of separate machines
does not have; the board's and NATS's costs per version are what scales.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's stitch_core, not a wheel in the venv

RUN = "fleet"
TICK = os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------- the board server process

def board_main(root: str, port: int, backlog: int | None, workers: int | None) -> None:
    from stitch_core.versions.board.serve import BoardHandler, BoardServer, serve

    if backlog:  # --board-backlog: the listen queue of the server's socket
        BoardServer.request_queue_size = backlog

    stats = {"requests": 0, "bytes": 0, "by_kind": {}}
    lock = threading.Lock()

    def kind(path: str) -> str:
        name = path.rsplit("/", 1)[-1]
        if name == "latest":
            return "latest"
        if name == "manifest.json":
            return "manifest"
        if name.endswith(".stp"):
            return "patch"
        return "snapshot" if name.endswith(".safetensors") else "other"

    class Counting(BoardHandler):
        def do_GET(self) -> None:
            if self.path == "/.stats":
                with lock:
                    body = json.dumps(stats).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return
            self._length = 0
            super().do_GET()
            k = kind(self.path)
            with lock:
                stats["requests"] += 1
                stats["bytes"] += self._length
                d = stats["by_kind"].setdefault(k, {"requests": 0, "bytes": 0})
                d["requests"] += 1
                d["bytes"] += self._length

        def send_header(self, keyword: str, value: str) -> None:
            if keyword.lower() == "content-length":
                self._length = int(value)
            super().send_header(keyword, value)

    kw = {"max_workers": workers} if workers else {}  # --board-workers
    server = serve(root, "127.0.0.1", port, handler=Counting, **kw)
    print(f"port {server.server_port} backlog {server.request_queue_size} workers "
          f"{getattr(server, 'max_workers', 0)}", flush=True)
    server.serve_forever()


# ---------------------------------------------------------------- helpers

def cpu_seconds(pid: int) -> float:
    """utime + stime of process `pid` (all its threads), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def overflows() -> int:
    """The kernel's count of connections dropped because a listen queue was full (TcpExt
    ListenOverflows, whole machine)."""
    lines = Path("/proc/net/netstat").read_text().splitlines()
    for names, values in zip(lines[::2], lines[1::2], strict=False):
        if names.startswith("TcpExt:"):
            d = dict(zip(names.split()[1:], values.split()[1:], strict=False))
            return int(d.get("ListenOverflows", 0))
    return 0


def self_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _board_stats(url: str) -> dict:
    for attempt in range(5):
        try:
            with urllib.request.urlopen(f"{url}/.stats", timeout=10) as r:
                return json.loads(r.read())
        except OSError:
            if attempt == 4:
                raise
            time.sleep(0.5)
    raise AssertionError("unreachable")


async def board_stats(url: str) -> dict:
    """The board server's counters (off the event loop: the followers keep running)."""
    return await asyncio.to_thread(_board_stats, url)


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def make_model(params: float, seed: int = 0):
    import torch

    d = 512
    n = max(1, round(params / (d * d)))
    g = torch.Generator().manual_seed(seed)
    return {f"model.layers.{i}.weight": torch.nn.Parameter(torch.randn(d, d, generator=g) * 0.02)
            for i in range(n)}


# ---------------------------------------------------------------- the run

async def run(a: argparse.Namespace) -> dict:
    import torch

    from stitch_core.format import fingerprint as fpr
    from stitch_core.format.views import project
    from stitch_core.versions.follower import Follower
    from stitch_core.versions.memory_replica import MemoryReplica
    from stitch_core.versions.natsserver import NatsServer
    from stitch_trainer.publisher import Publisher

    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="stitch-fleet-"))
    board_dir = work / "board"
    board_dir.mkdir()
    params = make_model(a.params)
    opt = torch.optim.AdamW(list(params.values()), lr=a.lr, weight_decay=0.01)
    g = torch.Generator().manual_seed(1)
    n_params = sum(p.numel() for p in params.values())

    board = subprocess.Popen([sys.executable, __file__, "--_board", str(board_dir),
                              str(a.board_backlog or 0), str(a.board_workers or 0)],
                             stdout=subprocess.PIPE, text=True)
    assert board.stdout is not None
    first = board.stdout.readline().split()
    port, backlog, workers = int(first[1]), int(first[3]), int(first[5])
    url = f"http://127.0.0.1:{port}"
    overflows0 = overflows()
    ns = NatsServer(work / "js").start()
    assert ns.pid is not None
    followers: list[Follower] = []
    replicas: list[MemoryReplica] = []
    try:
        pub = Publisher(str(board_dir), RUN, "bf16", nats=ns.url)
        views = []

        def publish(step: int):
            with torch.no_grad():
                views.append(project({k: v.detach() for k, v in params.items()}, "bf16"))
            return pub.publish(step, {k: v.detach() for k, v in params.items()})

        m0 = await asyncio.to_thread(lambda: publish(0).result())
        t0 = time.perf_counter()
        for i in range(a.followers):
            r = MemoryReplica()
            f = Follower(url, RUN, r, nats=ns.url, cache_dir=work / "cache" / f"{i:03d}",
                         engine_id=f"f{i:03d}", cache_max_bytes=None)
            await f.start()
            followers.append(f)
            replicas.append(r)

        async def all_at(v: int, timeout: float) -> float | None:
            deadline = time.perf_counter() + timeout
            while time.perf_counter() < deadline:
                if all(f.version is not None and f.version >= v for f in followers):
                    return time.perf_counter()
                await asyncio.sleep(0.01)
            return None

        if await all_at(0, a.timeout) is None:
            raise RuntimeError("followers did not all load v0")
        start_s = time.perf_counter() - t0
        await asyncio.sleep(1.0)  # NATS subscriptions settle
        connected = sum(1 for f in followers if f.nats_connected)
        rows = []
        for step in range(1, a.versions + 1):
            for p in params.values():
                p.grad = torch.randn(p.shape, generator=g) * 1e-2
            opt.step()
            b0, n0, c0, s0 = await board_stats(url), cpu_seconds(ns.pid), cpu_seconds(board.pid), \
                self_cpu()
            tp = time.perf_counter()
            info = await asyncio.to_thread(publish, step)
            m = await asyncio.to_thread(info.result, 60)
            t_all = await all_at(m.version, a.timeout)
            await asyncio.sleep(0.2)  # let the last heartbeats and polls of this version land
            b1, n1, c1, s1 = await board_stats(url), cpu_seconds(ns.pid), cpu_seconds(board.pid), \
                self_cpu()
            lat, polled = [], 0
            for f in followers:
                h = next((h for h in f.history if h["version"] == m.version), None)
                if h is None:
                    continue
                if h.get("announced_at") is None:
                    polled += 1
                else:
                    lat.append(h["current_at"] - h["announced_at"])
            rows.append({
                "version": m.version, "patch_bytes": m.patch_bytes,
                "changed": m.changed_elements / m.total_elements,
                "reached": sum(1 for f in followers if f.version is not None
                               and f.version >= m.version),
                "all_current_s": None if t_all is None else t_all - tp,
                "p50_ms": 1e3 * pct(lat, 0.5), "p99_ms": 1e3 * pct(lat, 0.99),
                "max_ms": 1e3 * max(lat) if lat else float("nan"), "by_poll": polled,
                "board_requests": b1["requests"] - b0["requests"],
                "board_bytes": b1["bytes"] - b0["bytes"],
                "board_by_kind": {k: {x: v[x] - b0["by_kind"].get(k, {}).get(x, 0)
                                      for x in ("requests", "bytes")}
                                  for k, v in b1["by_kind"].items()},
                "nats_cpu_s": n1 - n0, "board_cpu_s": c1 - c0, "followers_cpu_s": s1 - s0})
            await asyncio.sleep(a.gap)
        final = views[-1]
        final_fps = fpr.state_fingerprints(final)
        want_applied = list(range(0, a.versions + 1))
        lost = sum(1 for f in followers if f.applied != want_applied)
        exact = 0
        for r in replicas:
            ok = r.tensors.keys() == final.keys() and all(
                torch.equal(r.tensors[k].view(torch.int16), final[k].view(torch.int16))
                for k in final) and fpr.state_fingerprints(r.tensors) == final_fps
            exact += ok
        all_lat = [h["current_at"] - h["announced_at"] for f in followers for h in f.history
                   if h["version"] >= 1 and h.get("announced_at") is not None]
        return {
            "followers": a.followers, "versions": a.versions, "params": n_params,
            "model_bytes": sum(t.numel() * t.element_size() for t in final.values()),
            "snapshot_bytes": m0.full_bytes, "start_s": start_s, "board_backlog": backlog,
            "board_workers": workers,
            "listen_overflows": overflows() - overflows0, "nats_connected": connected,
            "rows": rows, "followers_lost_versions": lost, "bit_exact": exact,
            "p50_ms": 1e3 * pct(all_lat, 0.5), "p99_ms": 1e3 * pct(all_lat, 0.99),
            "max_ms": 1e3 * max(all_lat) if all_lat else float("nan"),
            "by_poll": sum(r["by_poll"] for r in rows),
            "nats_cpu_per_version_s": statistics.mean(r["nats_cpu_s"] for r in rows),
            "board_cpu_per_version_s": statistics.mean(r["board_cpu_s"] for r in rows),
            "followers_cpu_per_version_s": statistics.mean(r["followers_cpu_s"] for r in rows),
            "board_bytes_per_version": statistics.mean(r["board_bytes"] for r in rows),
            "board_requests_per_version": statistics.mean(r["board_requests"] for r in rows),
            "patch_bytes_mean": statistics.mean(r["patch_bytes"] for r in rows),
        }
    finally:
        for f in followers:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(f.stop(), 10)
        with contextlib.suppress(Exception):
            await asyncio.to_thread(pub.close)
        ns.stop()
        board.terminate()
        board.wait(10)
        import shutil

        shutil.rmtree(work, ignore_errors=True)


def report(r: dict, argv: list[str]) -> str:
    out = [f"$ {' '.join([Path(sys.executable).name, *argv])}",
           f"cpus={os.cpu_count()} load={os.getloadavg()[0]:.2f}; {r['followers']} followers in "
           f"one process (one event loop), {r['params'] / 1e6:.2f}M params "
           f"({r['model_bytes'] / 1e6:.1f} MB bf16 per copy), {r['versions']} versions; all "
           f"followers loaded the v0 snapshot in {r['start_s']:.1f} s; NATS connected: "
           f"{r['nats_connected']}/{r['followers']}; board listen backlog "
           f"{r['board_backlog']}, {r['board_workers'] or 'unbounded'} workers, connections "
           f"dropped on a full listen queue (machine-wide "
           f"TcpExtListenOverflows) {r['listen_overflows']}", "",
           "| version | changed % | patch bytes | all current s | announce→current p50 ms | "
           "p99 ms | max ms | by poll | board requests | board MB | nats-server CPU s | "
           "board CPU s | followers' CPU s |", "|" + "---|" * 13]
    for x in r["rows"]:
        out.append(
            f"| {x['version']} | {100 * x['changed']:.2f} | {x['patch_bytes']:,} | "
            f"{x['all_current_s']:.2f} | {x['p50_ms']:.0f} | {x['p99_ms']:.0f} | "
            f"{x['max_ms']:.0f} | {x['by_poll']} | {x['board_requests']} | "
            f"{x['board_bytes'] / 1e6:.1f} | {x['nats_cpu_s']:.3f} | {x['board_cpu_s']:.3f} | "
            f"{x['followers_cpu_s']:.2f} |")
    out += ["", "| measure | value |", "|---|---|",
            f"| versions lost (followers whose applied list is not 0..{r['versions']}) | "
            f"**{r['followers_lost_versions']}** |",
            f"| followers bit-exact with the trainer's last view | **{r['bit_exact']}/"
            f"{r['followers']}** |",
            f"| announce → current, all versions × followers: p50 / p99 / max | "
            f"{r['p50_ms']:.0f} / {r['p99_ms']:.0f} / {r['max_ms']:.0f} ms |",
            f"| steps reached by board polling (no announcement first) | {r['by_poll']} |",
            f"| board requests per version | {r['board_requests_per_version']:.0f} |",
            f"| board bytes per version (patch {r['patch_bytes_mean'] / 1e3:.0f} KB × "
            f"{r['followers']}) | {r['board_bytes_per_version'] / 1e6:.1f} MB |",
            f"| nats-server CPU per version | {r['nats_cpu_per_version_s']:.3f} s |",
            f"| board server CPU per version | {r['board_cpu_per_version_s']:.3f} s |",
            f"| followers' process CPU per version | {r['followers_cpu_per_version_s']:.2f} s |"]
    return "\n".join(out)


def main() -> None:
    if len(sys.argv) >= 5 and sys.argv[1] == "--_board":
        board_main(sys.argv[2], 0, int(sys.argv[3]) or None, int(sys.argv[4]) or None)
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--followers", type=int, default=100)
    ap.add_argument("--versions", type=int, default=10)
    ap.add_argument("--params", type=float, default=1e6)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--gap", type=float, default=1.0, help="seconds between versions")
    ap.add_argument("--timeout", type=float, default=180.0)
    ap.add_argument("--board-backlog", type=int, default=0,
                    help="listen backlog of the board server (0: the server's own)")
    ap.add_argument("--board-workers", type=int, default=0,
                    help="connections the board server serves at once (0: the server's own)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--md", default="", help="also write the report to this file")
    a = ap.parse_args()
    r = asyncio.run(run(a))
    text = report(r, sys.argv)
    print(json.dumps(r, indent=1) if a.json else text)
    if a.md:
        Path(a.md).write_text(text + "\n")
    if r["followers_lost_versions"] or r["bit_exact"] != r["followers"]:
        raise SystemExit("a follower lost a version or diverged")


if __name__ == "__main__":
    main()
