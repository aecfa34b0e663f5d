#!/usr/bin/env python3
"""Fleet across regions: one origin, three regions each with an nginx relay, 30+ followers.

    sudo .venv/bin/python benchmarks/fleet.py [--regions 3] [--per-region 10] [--versions 20]
                                              [--board http|nats] [--no-relay] [--readme]

The origin (a board directory served by ``stitch_core.versions.board.serve``, counting the
bytes it sends to each client address, and a ``nats-server`` with JetStream) runs in its own
network namespace. Each region reaches it over its own veth pair whose two ends carry ``tc
tbf`` rate limit (``--wan-mbit``) and, through a small TCP delay proxy of this script (this
kernel has no ``netem``), ``--rtt-ms`` of round trip per region: the WAN.
The trainer reaches the origin over a link without delay (it sits beside the origin). In each
region, in this (the root) namespace: an nginx relay (``stitch_core.versions.relay.NginxRelay``,
the config `stitch relay http` writes) whose upstream is the origin over that region's WAN link,
and ``--per-region`` followers (``Follower`` + ``MemoryReplica``: the weights in memory, every
fingerprint checked at every step; one process, one event loop, engine defaults: reconcile 5 s,
heartbeat 2 s) told ``STITCH_BOARD=http://relay,http://origin`` (the relay, falling back to the
origin) and the origin's NATS over the WAN for announcements. ``--board nats``: the trainer
publishes to a NATS board on the origin's nats-server (JetStream domain ``hub``, a leafnode
port), each region runs a nats-server that is a leafnode of it over the region's link, holding
JetStream mirrors of the board (``relay.region_config`` + ``relay.mirror_board``), and followers
are told ``nats://region/stitch,nats://origin/stitch``. ``--no-relay``: every follower reads the
origin over the WAN (the baseline).

Measured per version: WAN bytes (the veth counters of each region's link, everything that
crossed: HTTP to the relay, NATS announcements and heartbeats, TCP/IP overhead; and the origin's
board bytes per region: HTTP bodies, or NATS leaf + board-connection out_bytes from the
nats-server's /leafz and /connz), publish() -> every follower current, per region. A region
is cut off (``--cut-region``: its link set down) for ``--cut-versions`` versions and then
restored: its followers keep serving what they hold, the others go on; the time from restore
to that region being current is measured. Without ``ip netns`` (not root, no CAP_NET_ADMIN) the
script says so and runs on loopback with the delay proxies only (no rate limit, no cut-off, no
link counters; the origin's byte counts still hold).

Writes benchmarks/results/fleet.json and .md, a PNG (if matplotlib is installed) and, with
``--readme``, the table between the FLEET markers of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from stitch_dev.ports import free_port, wait_port  # noqa: E402

RUN = "fleet"
NS = f"stitch-origin-{os.getpid()}"
RESULTS = ROOT / "benchmarks" / "results"
BEGIN, END = "<!-- FLEET:BEGIN -->", "<!-- FLEET:END -->"


def sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=check, capture_output=True, text=True)


# ---------------------------------------------------------------- the origin board process

def board_main(root: str, host: str, port: int) -> None:
    """`stitch board serve` with a handler counting body bytes per client address and kind."""
    from stitch_core.versions.board.serve import BoardHandler, serve

    stats: dict = {}
    lock = threading.Lock()

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
            name = self.path.rsplit("/", 1)[-1]
            kind = "latest" if name == "latest" else "manifest" if name == "manifest.json" \
                else "patch" if name.endswith(".stp") else "other"
            with lock:
                d = stats.setdefault(self.client_address[0], {})
                k = d.setdefault(kind, {"requests": 0, "bytes": 0})
                k["requests"] += 1
                k["bytes"] += self._length

        def send_header(self, keyword: str, value: str) -> None:
            if keyword.lower() == "content-length":
                self._length = int(value)
            super().send_header(keyword, value)

    server = serve(root, host, port, handler=Counting)
    print(f"port {server.server_port}", flush=True)
    server.serve_forever()


def board_stats(url: str) -> dict:
    for attempt in range(5):
        try:
            with urllib.request.urlopen(f"{url}/.stats", timeout=10) as r:
                return json.loads(r.read())
        except OSError:
            if attempt == 4:
                raise
            time.sleep(0.3)
    raise AssertionError


# ---------------------------------------------------------------- the WAN delay

def proxy_main(delay_ms: float, specs: list[str]) -> None:
    """TCP proxies adding `delay_ms` one way in each direction (a pipeline: throughput is the
    link's, each byte arrives `delay_ms` late). `specs`: `listen_port:host:port`."""

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        q: asyncio.Queue = asyncio.Queue()

        async def send() -> None:
            while True:
                due, data = await q.get()
                if data is None:
                    break
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                writer.write(data)
                await writer.drain()

        task = asyncio.ensure_future(send())
        try:
            while data := await reader.read(1 << 16):
                q.put_nowait((time.monotonic() + delay_ms / 1e3, data))
        except OSError:
            pass
        q.put_nowait((0.0, None))
        with contextlib.suppress(Exception):
            await task
        with contextlib.suppress(Exception):
            writer.close()

    async def serve_one(lport: int, host: str, port: int) -> None:
        async def handle(r1: asyncio.StreamReader, w1: asyncio.StreamWriter) -> None:
            try:
                r2, w2 = await asyncio.open_connection(host, port)
            except OSError:
                w1.close()
                return
            await asyncio.gather(pipe(r1, w2), pipe(r2, w1), return_exceptions=True)

        server = await asyncio.start_server(handle, "127.0.0.1", lport, backlog=1024)
        await server.serve_forever()

    async def main() -> None:
        jobs = []
        for spec in specs:
            lport, host, port = spec.split(":")
            jobs.append(serve_one(int(lport), host, int(port)))
        print("ready", flush=True)
        await asyncio.gather(*jobs)

    asyncio.run(main())


# ---------------------------------------------------------------- the network

class Net:
    """The origin namespace and one veth pair per region (+ one for the trainer)."""

    def __init__(self, regions: int, rtts: list[float], mbit: float, use_netns: bool):
        self.regions, self.rtts, self.mbit = regions, rtts, mbit
        self.netns = use_netns
        self.links: list[str] = []

    def origin_ip(self, k: int) -> str:  # k: region, or `regions` for the trainer
        return f"10.88.{k}.1" if self.netns else "127.0.0.1"

    def up(self) -> None:
        if not self.netns:
            return
        sh("ip", "netns", "add", NS)
        sh("ip", "netns", "exec", NS, "ip", "link", "set", "lo", "up")
        for k in range(self.regions + 1):
            a, b = f"sr{os.getpid() % 10000}x{k}", f"so{os.getpid() % 10000}x{k}"
            sh("ip", "link", "add", a, "type", "veth", "peer", "name", b)
            sh("ip", "link", "set", b, "netns", NS)
            sh("ip", "addr", "add", f"10.88.{k}.2/24", "dev", a)
            sh("ip", "link", "set", a, "up")
            sh("ip", "netns", "exec", NS, "ip", "addr", "add", f"10.88.{k}.1/24", "dev", b)
            sh("ip", "netns", "exec", NS, "ip", "link", "set", b, "up")
            self.links.append(a)
            if k < self.regions:
                self.shape(k, loss=0.0, add=True)

    def _tbf(self) -> list[str]:
        return ["tbf", "rate", f"{self.mbit:g}mbit", "burst", "256kb", "latency", "200ms"]

    def shape(self, k: int, loss: float = 0.0, add: bool = False) -> None:
        """The region's link: a token-bucket rate limit on both ends (`tc tbf`); `loss` 100:
        the link is cut (set down on the region's side), 0: up again."""
        a, b = f"sr{os.getpid() % 10000}x{k}", f"so{os.getpid() % 10000}x{k}"
        if add:
            sh("tc", "qdisc", "add", "dev", a, "root", *self._tbf())
            sh("ip", "netns", "exec", NS, "tc", "qdisc", "add", "dev", b, "root", *self._tbf())
            return
        sh("ip", "link", "set", a, "down" if loss >= 100 else "up")
        if loss < 100:  # the connected route comes back with the link; wait for it
            for _ in range(100):
                if f"10.88.{k}.0/24" in sh("ip", "route").stdout:
                    break
                time.sleep(0.02)

    def rx_bytes(self, k: int) -> int:
        """Bytes region k received over its WAN link (origin -> region)."""
        if not self.netns:
            return 0
        return int(Path(f"/sys/class/net/{self.links[k]}/statistics/rx_bytes").read_text())

    def tx_bytes(self, k: int) -> int:
        if not self.netns:
            return 0
        return int(Path(f"/sys/class/net/{self.links[k]}/statistics/tx_bytes").read_text())

    def exec_prefix(self) -> list[str]:
        return ["ip", "netns", "exec", NS] if self.netns else []

    def down(self) -> None:
        if not self.netns:
            return
        for a in self.links:
            sh("ip", "link", "del", a, check=False)
        sh("ip", "netns", "del", NS, check=False)


def netns_works() -> bool:
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
        return False
    name = f"stitch-probe-{os.getpid()}"
    ok = sh("ip", "netns", "add", name, check=False).returncode == 0
    if ok:
        sh("ip", "netns", "del", name, check=False)
    return ok


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


# ---------------------------------------------------------------- the run

async def run(a: argparse.Namespace) -> dict:
    import torch
    from fleet_load import make_model

    from stitch_core.versions.follower import Follower
    from stitch_core.versions.memory_replica import MemoryReplica
    from stitch_core.versions.natsserver import NatsServer, find_nats_server
    from stitch_core.versions.relay import NginxRelay, hub_config, mirror_board, region_config
    from stitch_trainer.publisher import Publisher

    torch.set_num_threads(1)
    rtts = [float(x) for x in a.rtt_ms.split(",")]
    rtts = (rtts * a.regions)[:a.regions]
    net = Net(a.regions, rtts, a.wan_mbit, a.netns)
    work = Path(tempfile.mkdtemp(prefix="stitch-fleet-regions-"))
    board_dir = work / "board"
    board_dir.mkdir()
    procs: list[subprocess.Popen] = []
    relays: list[NginxRelay] = []
    followers: list[list[Follower]] = []
    pub = None
    try:
        net.up()
        host = "0.0.0.0" if a.netns else "127.0.0.1"
        bport = 8000 if a.netns else free_port()
        board = subprocess.Popen([*net.exec_prefix(), sys.executable, __file__, "--_board",
                                  str(board_dir), host, str(bport)], stdout=subprocess.PIPE,
                                 text=True)
        procs.append(board)
        assert board.stdout is not None
        board.stdout.readline()
        nport = 4222 if a.netns else free_port()
        (work / "js").mkdir()
        lport = 7422 if a.netns else free_port()
        mport = 8222 if a.netns else free_port()
        conf = work / "origin.conf"
        conf.write_text(hub_config(lport, domain="hub"))
        cfg = ["-c", str(conf)] if a.board == "nats" else []
        nats = subprocess.Popen([*net.exec_prefix(), find_nats_server(), *cfg, "-js",
                                 "-sd", str(work / "js"), "-a", host, "-p", str(nport),
                                 "-m", str(mport)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(nats)
        trainer_ip = net.origin_ip(a.regions)
        wait_port(trainer_ip, nport)
        wait_port(trainer_ip, bport)
        stats_url = f"http://{trainer_ip}:{bport}"
        mon_url = f"http://{trainer_ip}:{mport}"

        def origin_bytes() -> dict[str, int]:
            """Board bytes the origin sent, per client address: HTTP bodies of the board
            server, or (NATS board) the out_bytes of its leaf connections and of the
            followers' board connections (not their announcement connections)."""
            out: dict[str, int] = {}
            if a.board == "http":
                for ip, kinds in board_stats(stats_url).items():
                    out[ip] = sum(v["bytes"] for v in kinds.values())
                return out
            for path, key in (("leafz", "leafs"), ("connz?limit=4096", "connections")):
                with urllib.request.urlopen(f"{mon_url}/{path}", timeout=10) as r:
                    for c in json.loads(r.read()).get(key) or []:
                        if key == "leafs" or c.get("name") == "stitch-board":
                            out[c["ip"]] = out.get(c["ip"], 0) + c["out_bytes"]
            return out
        # each region reaches the origin through its WAN link and a delay proxy (RTT/2 each
        # way): the relay's upstream and the followers' NATS (announcements, heartbeats)
        wan_http, wan_nats, wan_leaf = [], [], []
        for k in range(a.regions):
            hp, np_, lp = free_port(), free_port(), free_port()
            px = subprocess.Popen([sys.executable, __file__, "--_proxy", str(rtts[k] / 2),
                                   f"{hp}:{net.origin_ip(k)}:{bport}",
                                   f"{np_}:{net.origin_ip(k)}:{nport}",
                                   f"{lp}:{net.origin_ip(k)}:{lport}"],
                                  stdout=subprocess.PIPE, text=True)
            procs.append(px)
            assert px.stdout is not None
            px.stdout.readline()
            wan_http.append(f"http://127.0.0.1:{hp}")
            wan_nats.append(f"nats://127.0.0.1:{np_}")
            wan_leaf.append(f"nats-leaf://127.0.0.1:{lp}")
        for k in range(a.regions):
            if a.board == "http":
                r = NginxRelay(wan_http[k], free_port(), work / f"relay{k}")
            else:  # a region nats-server, leafnode of the origin's, JetStream domain r<k>
                (work / f"region{k}.conf").write_text(region_config(wan_leaf[k],
                                                                    domain=f"r{k}"))
                r = NatsServer(work / f"region{k}", config=work / f"region{k}.conf")
            relays.append(r.start())

        params = make_model(a.params)
        opt = torch.optim.AdamW(list(params.values()), lr=a.lr, weight_decay=0.01)
        g = torch.Generator().manual_seed(1)
        origin_board = str(board_dir) if a.board == "http" else \
            f"nats://{trainer_ip}:{nport}/stitch"
        pub = Publisher(origin_board, RUN, "bf16", nats=f"nats://{trainer_ip}:{nport}")

        def publish(step: int):
            return pub.publish(step, {k: v.detach() for k, v in params.items()})

        m0 = await asyncio.to_thread(lambda: publish(0).result(60))
        if a.board == "nats" and not a.no_relay:
            for r in relays:
                await mirror_board(r.url, "stitch", origin_domain="hub", timeout=60)
        for k in range(a.regions):
            fs = []
            for i in range(a.per_region):
                if a.board == "http":
                    board = wan_http[k] if a.no_relay else f"{relays[k].url},{wan_http[k]}"
                else:
                    board = f"{wan_nats[k]}/stitch" if a.no_relay else \
                        f"{relays[k].url}/stitch,{wan_nats[k]}/stitch"
                f = Follower(board, RUN,
                             MemoryReplica(), nats=wan_nats[k],
                             cache_dir=work / "cache" / f"{k}-{i}", engine_id=f"r{k}f{i:02d}",
                             region=f"region{k}", cache_max_bytes=None)
                await f.start()
                fs.append(f)
            followers.append(fs)
        everyone = [f for fs in followers for f in fs]

        async def current(fs: list[Follower], v: int, timeout: float) -> float | None:
            deadline = time.perf_counter() + timeout
            while time.perf_counter() < deadline:
                if all(f.version is not None and f.version >= v for f in fs):
                    return time.perf_counter()
                await asyncio.sleep(0.005)
            return None

        if await current(everyone, 0, a.timeout) is None:
            raise RuntimeError("followers did not all load v0")
        await asyncio.sleep(1.5)  # subscriptions settle
        rows = []
        cut_from = a.versions - a.cut_versions - 2 if a.cut_versions else None
        cut, restored_at, catch_up = False, None, None
        for step in range(1, a.versions + 1):
            if cut_from is not None and step == cut_from and a.netns:
                net.shape(a.cut_region, loss=100.0)
                cut = True
            if cut and step == cut_from + a.cut_versions:
                net.shape(a.cut_region, loss=0.0)
                cut, restored_at = False, time.perf_counter()
            for p in params.values():
                p.grad = torch.randn(p.shape, generator=g) * 1e-2
            opt.step()
            rx0 = [net.rx_bytes(k) for k in range(a.regions)]
            tx0 = [net.tx_bytes(k) for k in range(a.regions)]
            s0 = await asyncio.to_thread(origin_bytes)
            tp = time.perf_counter()
            info = await asyncio.to_thread(publish, step)
            m = await asyncio.to_thread(info.result, 60)
            live = [k for k in range(a.regions) if not (cut and k == a.cut_region)]
            per_region = {}
            for k in live:
                t = await current(followers[k], m.version, a.timeout)
                per_region[k] = None if t is None else t - tp
            if restored_at is not None and catch_up is None and a.cut_region in live:
                catch_up = (tp + per_region[a.cut_region] - restored_at) \
                    if per_region[a.cut_region] is not None else None
            await asyncio.sleep(a.gap)
            s1 = await asyncio.to_thread(origin_bytes)
            rx = [net.rx_bytes(k) - rx0[k] for k in range(a.regions)]
            tx = [net.tx_bytes(k) - tx0[k] for k in range(a.regions)]
            http = []
            for k in range(a.regions):
                ip = net.origin_ip(k).rsplit(".", 1)[0] + ".2" if a.netns else "127.0.0.1"
                http.append(s1.get(ip, 0) - s0.get(ip, 0))
            lat = [h["current_at"] - h["announced_at"] for f in everyone for h in f.history
                   if h["version"] == m.version and h.get("announced_at") is not None]
            rows.append({
                "version": m.version, "patch_bytes": m.patch_bytes,
                "changed": m.changed_elements / m.total_elements,
                "cut": [a.cut_region] if a.cut_region not in live else [],
                "all_current_s": None if any(v is None for v in per_region.values())
                else max(per_region.values()),
                "per_region_s": per_region, "wan_rx_bytes": rx, "wan_tx_bytes": tx,
                "origin_http_bytes": http,
                "announce_current_p50_ms": 1e3 * pct(lat, 0.5),
            })
        # the cut region must have caught up by the end
        t_end = await current(everyone, a.versions, a.timeout)
        lost = sum(1 for f in everyone if f.applied != list(range(a.versions + 1)))
        skipped = sum(1 for f in everyone if f.applied[-1:] != [a.versions])
        fetches = [r.upstream_fetches() if isinstance(r, NginxRelay) else {} for r in relays]
        normal = [r for r in rows if not r["cut"] and r["version"] not in
                  (range(cut_from, cut_from + a.cut_versions + 2) if cut_from else ())]
        all_s = [r["all_current_s"] for r in normal if r["all_current_s"] is not None]
        return {
            "regions": a.regions, "per_region": a.per_region, "followers": len(everyone),
            "versions": a.versions, "params": sum(p.numel() for p in params.values()),
            "snapshot_bytes": m0.full_bytes, "netns": a.netns, "rtt_ms": rtts,
            "wan_mbit": a.wan_mbit, "relays": not a.no_relay, "board": a.board, "rows": rows,
            "relay_log": fetches,
            "cut_region": a.cut_region if cut_from else None,
            "cut_versions": list(range(cut_from, cut_from + a.cut_versions)) if cut_from else [],
            "catch_up_after_restore_s": catch_up,
            "all_current_at_end": t_end is not None,
            "followers_not_at_every_version": lost, "followers_not_at_last": skipped,
            "publish_all_current_p50_s": pct(all_s, 0.5),
            "publish_all_current_p99_s": pct(all_s, 0.99),
            "patch_bytes_mean": statistics.mean(r["patch_bytes"] for r in normal),
            "wan_rx_per_version_mean": [statistics.mean(r["wan_rx_bytes"][k] for r in normal)
                                        for k in range(a.regions)],
            "origin_http_per_version_mean": [
                statistics.mean(r["origin_http_bytes"][k] for r in normal)
                for k in range(a.regions)],
            "normal_versions": [r["version"] for r in normal],
        }
    finally:
        for fs in followers:
            for f in fs:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(f.stop(), 10)
        if pub is not None:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(pub.close)
        for r in relays:
            r.stop()
        for p in procs:
            p.terminate()
            with contextlib.suppress(Exception):
                p.wait(10)
        net.down()
        shutil.rmtree(work, ignore_errors=True)


def arithmetic(bits_per_changed: float, changed: float) -> list[str]:
    """1T parameters over a 10 Gb/s link, at the codec's measured figures."""
    n = 1e12
    per_version = n * changed * bits_per_changed / 8
    full = n * 2
    link = 10e9 / 8
    return [
        f"| 1T params, bf16 full copy | {full / 1e12:.1f} TB | {full / link / 60:.0f} min |",
        f"| 1T params, one patch ({100 * changed:.2f}% changed × {bits_per_changed:.2f} "
        f"bits/changed) | {per_version / 1e9:.1f} GB | {per_version / link:.1f} s |",
    ]


def report(r: dict, argv: list[str]) -> str:
    rtt = "/".join(f"{x:g}" for x in r["rtt_ms"])
    mode = (f"origin in its own network namespace, one veth per region with `tc tbf` at "
            f"{r['wan_mbit']:g} Mbit/s, RTT {rtt} ms added by a delay proxy (this kernel has no "
            f"netem)" if r["netns"] else
            f"LOOPBACK (ip netns not available here), RTT {rtt} ms added by a delay proxy, no "
            f"rate limit, no cut-off")
    out = [f"$ {' '.join([Path(sys.executable).name, *argv])}",
           f"cpus={os.cpu_count()} load={os.getloadavg()[0]:.2f}; {r['regions']} regions × "
           f"{r['per_region']} followers = {r['followers']}, {r['params'] / 1e6:.2f}M params, "
           f"{r['versions']} versions; {mode}", "",
           "| version | changed % | patch bytes | cut | publish → all current s | "
           + " | ".join(f"region {k} s" for k in range(r["regions"])) + " | "
           + " | ".join(f"WAN→region {k} bytes" for k in range(r["regions"])) + " | "
           + " | ".join(f"origin board→{k} bytes" for k in range(r["regions"])) + " |",
           "|" + "---|" * (5 + 3 * r["regions"])]
    for x in r["rows"]:
        per = [x["per_region_s"].get(k, x["per_region_s"].get(str(k))) for k in
               range(r["regions"])]
        out.append(
            f"| {x['version']} | {100 * x['changed']:.2f} | {x['patch_bytes']:,} | "
            f"{','.join(map(str, x['cut'])) or ''} | "
            f"{'-' if x['all_current_s'] is None else format(x['all_current_s'], '.2f')} | "
            + " | ".join("cut" if v is None else f"{v:.2f}" for v in per) + " | "
            + " | ".join(f"{b:,}" for b in x["wan_rx_bytes"]) + " | "
            + " | ".join(f"{b:,}" for b in x["origin_http_bytes"]) + " |")
    return "\n".join(out)


def wan_mode(r: dict) -> str:
    rtt = "/".join(f"{x:g}" for x in r["rtt_ms"])
    if r["netns"]:
        return (f"origin in a network namespace, a veth per region: `tc tbf` "
                f"{r['wan_mbit']:g} Mbit/s, RTT {rtt} ms (delay proxy; no netem in this kernel)")
    return f"loopback, RTT {rtt} ms (delay proxy), no rate limit"


def summary(r: dict) -> str:
    pb = r["patch_bytes_mean"]
    wan = r["wan_rx_per_version_mean"]
    http = r["origin_http_per_version_mean"]
    lines = [
        "| measure | value |", "|---|---|",
        f"| fleet | {r.get('board', 'http').upper()} board; {r['regions']} regions × "
        f"{r['per_region']} followers (one process"
        f"{'' if r['relays'] else '; NO relays: every follower reads the origin'}), "
        f"{r['params'] / 1e6:.2f}M params, {r['versions']} versions |",
        f"| WAN | {wan_mode(r)} |",
        f"| mean patch (object bytes per version) | {pb / 1e3:.1f} KB |",
        ("| origin HTTP body bytes per version, per region (relay ← origin) | "
         if r.get("board", "http") == "http" else
         "| origin NATS board bytes per version, per region (leaf connection, or the followers' "
         "board connections without relays) | ")
        + " / ".join(f"{b / 1e3:.1f} KB" for b in http)
        + f" = {sum(http) / pb:.2f} × patch in all (followers × patch would be "
          f"{r['followers']}×) |",
        "| all WAN bytes per version, per region (link counters: HTTP + NATS + TCP) | "
        + " / ".join(f"{b / 1e3:.1f} KB" for b in wan) + " |",
        f"| publish → every follower current, p50 / p99 (versions without a cut) | "
        f"{r['publish_all_current_p50_s']:.2f} / {r['publish_all_current_p99_s']:.2f} s |",
    ]
    if r["cut_region"] is not None:
        c = r["catch_up_after_restore_s"]
        lines.append(
            f"| region {r['cut_region']} cut off for versions "
            f"{r['cut_versions'][0]}-{r['cut_versions'][-1]}, then restored | others went on; "
            f"its followers kept serving their version; current "
            f"{'not measured' if c is None else format(c, '.2f') + ' s after the restore'} |")
    lines.append(f"| followers that missed a version / not at the last at the end | "
                 f"{r['followers_not_at_every_version']} / {r['followers_not_at_last']} |")
    return "\n".join(lines)


def write_readme(block: str) -> None:
    """The table between the FLEET markers of docs/benchmarks.md (where result tables live)."""
    p = ROOT / "docs" / "benchmarks.md"
    s = p.read_text()
    if BEGIN not in s or END not in s:
        sys.exit(f"{p} has no {BEGIN} ... {END} markers: not written")
    head, rest = s.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    p.write_text(f"{head}{BEGIN}\n{block}\n{END}{tail}")


def plot(r: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    vs = [x["version"] for x in r["rows"]]
    for k in range(r["regions"]):
        ax1.plot(vs, [x["wan_rx_bytes"][k] / 1e3 for x in r["rows"]], marker="o",
                 label=f"region {k} WAN rx")
    ax1.plot(vs, [x["patch_bytes"] / 1e3 for x in r["rows"]], "k--", label="patch")
    ax1.set_xlabel("version")
    ax1.set_ylabel("KB")
    ax1.legend()
    for k in range(r["regions"]):
        ys = [x["per_region_s"].get(k, x["per_region_s"].get(str(k))) for x in r["rows"]]
        ax2.plot(vs, [float("nan") if y is None else y for y in ys], marker="o",
                 label=f"region {k}")
    ax2.set_xlabel("version")
    ax2.set_ylabel("publish → region current, s")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    return True


def main() -> None:
    if len(sys.argv) >= 4 and sys.argv[1] == "--_proxy":
        proxy_main(float(sys.argv[2]), sys.argv[3:])
        return
    if len(sys.argv) >= 5 and sys.argv[1] == "--_board":
        board_main(sys.argv[2], sys.argv[3], int(sys.argv[4]))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--regions", type=int, default=3)
    ap.add_argument("--per-region", type=int, default=10)
    ap.add_argument("--versions", type=int, default=20)
    ap.add_argument("--params", type=float, default=1e6)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--gap", type=float, default=1.0, help="seconds between versions")
    ap.add_argument("--rtt-ms", default="40,90,160", help="round trip per region (comma list)")
    ap.add_argument("--wan-mbit", type=float, default=200.0)
    ap.add_argument("--cut-region", type=int, default=2)
    ap.add_argument("--cut-versions", type=int, default=3, help="0: no cut")
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--no-netns", action="store_true", help="loopback, no delay")
    ap.add_argument("--no-relay", action="store_true",
                    help="baseline: followers read the origin over the WAN directly")
    ap.add_argument("--board", choices=["http", "nats"], default="http",
                    help="http: a board directory served over HTTP, nginx relays; nats: a NATS "
                         "board, region nats-servers as leafnodes with JetStream mirrors")
    ap.add_argument("--out", default="fleet", help="results/<out>.json/.md/.png")
    ap.add_argument("--readme", action="store_true", help="write the table into docs/benchmarks.md")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    a.netns = not a.no_netns and netns_works()
    if not a.netns:
        print("ip netns is not available (needs root): running on loopback WITHOUT WAN delay",
              file=sys.stderr)
    r = asyncio.run(run(a))
    text = report(r, sys.argv) + "\n\n" + summary(r)
    print(json.dumps(r, indent=1) if a.json else text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{a.out}.json").write_text(json.dumps(r, indent=1) + "\n")
    (RESULTS / f"{a.out}.md").write_text(text + "\n")
    plotted = plot(r, RESULTS / f"{a.out}.png")
    if a.readme:
        write_readme(summary(r) + ("\n\n![fleet](../benchmarks/results/fleet.png)" if plotted
                                   else ""))


if __name__ == "__main__":
    main()
