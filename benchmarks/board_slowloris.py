"""Board server under slow loris: latency of legitimate followers with and without attackers.

    .venv/bin/python benchmarks/board_slowloris.py [--followers 100] [--seconds 10] [--md FILE]

A board directory (a `latest` and four 256 KiB objects) is served by a separate process:
`stitch board serve`'s server (`new`, its defaults), or a copy of the thread-per-connection
server it replaced (`old`, kept in this file only, as a baseline: a bounded pool of handler
threads, a 10 s timeout per read). In this process, `--followers` clients (one httpx client and
connection each) repeat: GET `latest`, GET one of the objects, sleep 50-150 ms. Under attack,
8 slow loris connections each send a request line and then one header line every 5 s, never
ending the head, and reconnect when the server closes them. Per scenario: requests answered,
p50/p99/max latency of each request (from sending it to its last byte), failures (errors, or no
answer within 20 s) and the server process's CPU time per answer. Followers and attackers share
this process and the machine's cores with the server: absolute numbers are small-machine
numbers, the comparison is the point.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's stitch_core, not a wheel in the venv

RUN = "bench"
OBJECTS = [f"{RUN}/versions/000001/obj-{i}.bin" for i in range(4)]
DRIP_EVERY = 5.0  # seconds between a loris's header lines (the review's attack)
TIMEOUT = 20.0


# ---------------------------------------------------------------- the servers (own process)

def old_server(root: str, workers: int):
    """The thread-per-connection server `stitch board serve` ran before (connection handling
    copied as it was; answers through the current handler's helpers, which did not change)."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from stitch_core.versions.board.serve import BoardHandler as New

    class Server(ThreadingHTTPServer):
        daemon_threads = True
        request_queue_size = 1024

        def __init__(self, addr, handler, root):
            self.root, self.verbose = root, False
            self._slots = threading.BoundedSemaphore(workers)
            super().__init__(addr, handler)

        def process_request(self, request, client_address):
            self._slots.acquire()
            try:
                super().process_request(request, client_address)
            except BaseException:
                self._slots.release()
                raise

        def process_request_thread(self, request, client_address):
            try:
                super().process_request_thread(request, client_address)
            finally:
                self._slots.release()

        def handle_error(self, request, client_address):
            pass

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        timeout = 10
        disable_nagle_algorithm = True
        _resolve, _status, _serve = New._resolve, New._status, New._serve

        def do_GET(self):
            self._serve(body=True)

        def send_file(self, f, offset, count):
            self.connection.sendfile(f, offset=offset, count=count)

        def log_message(self, *args):
            pass

    return Server(("127.0.0.1", 0), Handler, Path(root).resolve())


def server_main(kind: str, root: str, workers: int) -> None:
    if kind == "old":
        server = old_server(root, workers)
    else:
        from stitch_core.versions.board.serve import serve

        server = serve(root, "127.0.0.1", 0)
    print(server.server_port, flush=True)
    server.serve_forever()


# ---------------------------------------------------------------- clients (this process)

async def loris(port: int, stop: asyncio.Event, closed: list[int]) -> None:
    """One slow loris: a request head dribbled forever, reconnecting when it is closed."""
    while not stop.is_set():
        try:
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(f"GET /{RUN}/latest HTTP/1.1\r\nHost: board\r\n".encode())
            while not stop.is_set():
                await w.drain()
                with contextlib.suppress(asyncio.TimeoutError):
                    if await asyncio.wait_for(r.read(1), DRIP_EVERY) == b"":
                        break  # closed by the server
                w.write(b"X-Drip: 1\r\n")
            closed[0] += 1
            w.close()
        except OSError:
            await asyncio.sleep(0.1)


async def follower(url: str, until: float, lat: list[float], fails: list[str]) -> None:
    import httpx

    async with httpx.AsyncClient(timeout=TIMEOUT) as c:
        while time.monotonic() < until:
            for key in (f"{RUN}/latest", random.choice(OBJECTS)):
                t0 = time.monotonic()
                try:
                    r = await c.get(f"{url}/{key}")
                    if r.status_code == 200:
                        lat.append(time.monotonic() - t0)
                    else:
                        fails.append(f"HTTP {r.status_code}")
                except Exception as e:  # noqa: BLE001 - counted, not fatal
                    fails.append(type(e).__name__)
            await asyncio.sleep(random.uniform(0.05, 0.15))


async def scenario(port: int, followers: int, seconds: float, attack: bool) -> dict:
    stop, closed = asyncio.Event(), [0]
    lorises = [asyncio.create_task(loris(port, stop, closed)) for _ in range(8 if attack else 0)]
    await asyncio.sleep(1.0 if attack else 0)  # the attackers are in before the followers
    lat: list[float] = []
    fails: list[str] = []
    t0 = time.monotonic()
    until = t0 + seconds
    await asyncio.gather(*(follower(f"http://127.0.0.1:{port}", until, lat, fails)
                           for _ in range(followers)))
    took = time.monotonic() - t0
    stop.set()
    for t in lorises:
        t.cancel()
    await asyncio.gather(*lorises, return_exceptions=True)
    lat.sort()

    def q(p: float) -> float:
        return lat[min(len(lat) - 1, round(p * (len(lat) - 1)))] * 1000 if lat else float("nan")

    return {"answered": len(lat), "per_s": len(lat) / took, "p50": q(0.5), "p99": q(0.99),
            "max": q(1.0), "fails": len(fails), "loris_closed": closed[0]}


def cpu_seconds(pid: int) -> float:
    """utime + stime of process `pid` (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run(kind: str, workers: int, root: Path, a: argparse.Namespace, attack: bool) -> dict:
    p = subprocess.Popen([sys.executable, __file__, "--serve", kind, "--root", str(root),
                          "--workers", str(workers)], stdout=subprocess.PIPE, text=True)
    try:
        port = int(p.stdout.readline())
        c0 = cpu_seconds(p.pid)
        r = asyncio.run(scenario(port, a.followers, a.seconds, attack))
        r["cpu_ms"] = (cpu_seconds(p.pid) - c0) * 1000 / max(r["answered"], 1)
        return r
    finally:
        p.kill()
        p.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--followers", type=int, default=100)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--md", help="write the table here too")
    ap.add_argument("--serve", choices=["new", "old"], help=argparse.SUPPRESS)
    ap.add_argument("--root", help=argparse.SUPPRESS)
    ap.add_argument("--workers", type=int, default=256, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.serve:
        return server_main(a.serve, a.root, a.workers)
    root = Path(tempfile.mkdtemp(prefix="stitch-loris-"))
    for key in OBJECTS:
        (root / key).parent.mkdir(parents=True, exist_ok=True)
        (root / key).write_bytes(os.urandom(256 << 10))
    (root / RUN / "latest").write_text(f'{{"run": "{RUN}", "version": 1}}')
    rows = []
    for label, kind, workers in [("new (defaults)", "new", 0),
                                 ("old, 256 workers (its default)", "old", 256),
                                 ("old, 8 workers", "old", 8)]:
        for attack in (False, True):
            r = run(kind, workers, root, a, attack)
            rows.append((label, "8 slow loris" if attack else "idle", r))
            print(label, "attacked" if attack else "idle", r, flush=True)
    lines = [
        f"Board server, {a.followers} followers (GET latest + a 256 KiB object, then 50-150 ms "
        f"pause; {a.seconds:g} s) with and without 8 slow loris connections (a header line every "
        f"{DRIP_EVERY:g} s, reconnecting when closed). `benchmarks/board_slowloris.py`; "
        f"cpus={os.cpu_count()} (shared with other work), load {os.getloadavg()[0]:.1f} at the "
        f"end; server in its own process, followers and attackers in one.",
        "",
        "| server | attack | answered | req/s | p50 ms | p99 ms | max ms | failed | loris "
        "closed by server | server CPU ms / answer |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label, attack, r in rows:
        lines.append(f"| {label} | {attack} | {r['answered']} | {r['per_s']:.0f} | "
                     f"{r['p50']:.1f} | {r['p99']:.1f} | {r['max']:.0f} | {r['fails']} | "
                     f"{r['loris_closed']} | {r['cpu_ms']:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if a.md:
        Path(a.md).write_text(text)


if __name__ == "__main__":
    main()
