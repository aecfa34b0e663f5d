"""The fault rig of the follower: one engine-shaped follower on real parts, each fault a scenario
(the rows of benchmarks/faults.py, run shorter by tests/test_fault_suite.py).

Every row builds a fresh rig on this machine: a real ``Publisher`` (stitch_trainer) writing a
LocalBoard directory and announcing on a real ``nats-server`` (``NatsServer``); that directory
served over HTTP by ``stitch_core.versions.board.serve`` in a thread (its ``BoardHandler``
subclassed to answer 5xx, answer slowly, or drop connections); and one engine-shaped follower: a
``Follower`` (HTTP board + NATS) driving a ``Coordinator`` over two in-process ``RankReplica``s of
the TP=2 toy engine (stitch_dev.toy_engine), with a ``VersionGate`` wired as
``stitch_core.node.EngineFollower`` wires it; an engine-step loop checks every admitted request.
The trainer publishes precomputed AdamW versions of the toy model (``views[k]`` after k steps),
so every version's true bits are known to the harness independently of the board. What each row
measures is said in benchmarks/faults.py.

``scenarios(views)`` maps each row's key to ``f(work, Truth(views), args)`` -> ``Row``; ``args``
carries ``reconcile``, ``rpc_timeout``, ``fault_window``, ``outage``, ``slow`` and ``settle``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from stitch_core.engine import rpc as rpc_
from stitch_core.engine.coordinator import Coordinator
from stitch_core.engine.replica import RankReplica
from stitch_core.format import fingerprint as fpr
from stitch_core.serve.gate import NotReadyError, VersionGate
from stitch_core.versions.board import LocalBoard
from stitch_core.versions.board.serve import BoardHandler, BoardServer, serve
from stitch_core.versions.follower import Follower
from stitch_core.versions.manifest import MAX_MANIFEST_BYTES, Manifest
from stitch_core.versions.materialize import pull
from stitch_core.versions.natsserver import NatsServer
from stitch_trainer.publisher import Publisher

from .toy_engine import HFToy, ToyEngine, served_view, train

ROOT = Path(__file__).resolve().parents[1]  # the checkout (the killed trainer's sys.path)
RUN = "faults"
N_VIEWS = 48


# ---------------------------------------------------------------- the trainer's versions

def make_views(n: int) -> list[dict[str, torch.Tensor]]:
    """The toy model's bf16 served view before training and after each of n - 1 AdamW steps."""
    torch.manual_seed(0)
    model = HFToy()
    views = [served_view(model)]
    for m in train(model, n - 1):
        views.append(served_view(m))
    return views


def engines_for(view: dict[str, torch.Tensor]) -> list[ToyEngine]:
    engines = [ToyEngine(r, 2) for r in range(2)]
    for e in engines:
        e.load_weights(iter(view.items()))
    return engines


def same_bits(a: list[ToyEngine], b: list[ToyEngine]) -> bool:
    for x, y in zip(a, b, strict=True):
        px, py = dict(x.named_parameters()), dict(y.named_parameters())
        if px.keys() != py.keys() or not all(
                torch.equal(px[k].data.view(torch.uint8), py[k].data.view(torch.uint8))
                for k in px):
            return False
    return True


class Truth:
    """What each published version must be, from the trainer's views (never from the board)."""

    def __init__(self, views: list[dict[str, torch.Tensor]]):
        self.views = views
        self.view_of: dict[int, int] = {}  # version -> index into views
        self._fps: dict[int, dict[str, int]] = {}
        self._engines: dict[int, list[ToyEngine]] = {}

    def published(self, version: int, index: int) -> None:
        self.view_of[version] = index

    def fps(self, v: int) -> dict[str, int] | None:
        if v not in self.view_of:
            return None
        if v not in self._fps:
            self._fps[v] = fpr.state_fingerprints(self.views[self.view_of[v]])
        return self._fps[v]

    def engines(self, v: int) -> list[ToyEngine]:
        if v not in self._engines:
            self._engines[v] = engines_for(self.views[self.view_of[v]])
        return self._engines[v]


# ---------------------------------------------------------------- the board over HTTP

class FaultyHandler(BoardHandler):
    """Counts requests; answers 503, answers late, per the server's `faults`; its connections can
    be dropped (`drop_all`) so that an outage also cuts keep-alive connections."""

    def setup(self) -> None:
        super().setup()
        with self.server.lock:
            self.server.conns.add(self.connection)

    def finish(self) -> None:
        with contextlib.suppress(Exception):
            super().finish()
        with self.server.lock:
            self.server.conns.discard(self.connection)

    def _serve(self, body: bool) -> None:
        srv = self.server
        srv.requests += 1
        mode = srv.faults.get("mode")
        if mode == "5xx":
            srv.failed += 1
            return self._status(503)
        if mode == "slow":
            time.sleep(srv.faults.get("delay", 1.0))
        return super()._serve(body)


class HttpBoardServer:
    """The board directory served over HTTP in a thread; `stop()` refuses connections (the
    listening socket closed, live connections cut), `start()` serves again on the same port."""

    def __init__(self, root: Path):
        self.root = root
        self.port = 0
        self.faults: dict[str, Any] = {}
        self.requests = 0
        self.server: BoardServer | None = None
        self.thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        for _ in range(100):
            try:
                s = serve(self.root, "127.0.0.1", self.port, handler=FaultyHandler)
                break
            except OSError:  # the port is still held by the previous socket
                time.sleep(0.05)
        else:
            raise RuntimeError(f"cannot bind 127.0.0.1:{self.port}")
        s.faults, s.requests, s.failed = self.faults, 0, 0
        s.conns, s.lock = set(), threading.Lock()
        self.server, self.port = s, s.server_port
        self.thread = threading.Thread(target=s.serve_forever, daemon=True, name="board-http")
        self.thread.start()

    def stop(self) -> None:
        s, self.server = self.server, None
        if s is None:
            return
        s.shutdown()
        s.server_close()
        with s.lock:
            conns = list(s.conns)
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
        self.requests += s.requests
        assert self.thread is not None
        self.thread.join(5)


# ---------------------------------------------------------------- tampering with what is written

def patch_key(run: str, version: int) -> str:
    return f"{run}/versions/{version:06d}/patch.stp"


def manifest_key_of(run: str, version: int) -> str:
    return f"{run}/versions/{version:06d}/manifest.json"


class TamperingBoard(LocalBoard):
    """The trainer's board with a fault in its upload path for chosen versions: `bad[v]` turns
    the patch bytes of v into other bytes; with `consistent` the manifest is rewritten to list
    the bad bytes' size and SHA-256 (a writer that hashes what it uploads: the follower's fetch
    checks pass and the engine's own proofs must refuse it), else the manifest keeps the good
    hash (an object damaged on the board: the fetch check refuses it). `pad_manifest[v]`: the
    manifest of v is padded to that many bytes. The good bytes are kept (`restore`)."""

    def __init__(self, root: Path):
        super().__init__(root)
        self.bad: dict[int, Callable[[bytes], bytes]] = {}
        self.consistent = True
        self.pad_manifest: dict[int, int] = {}
        self.good: dict[str, bytes] = {}
        self.bad_ref: dict[int, tuple[int, str]] = {}

    @staticmethod
    def _version(key: str) -> int | None:
        parts = key.split("/")
        if len(parts) == 4 and parts[1] == "versions" and parts[2].isdigit():
            return int(parts[2])
        return None

    async def put(self, key: str, src: bytes | Path) -> None:
        v = self._version(key)
        name = key.rsplit("/", 1)[-1]
        if v is not None and (v in self.bad or v in self.pad_manifest):
            data = src.read_bytes() if isinstance(src, Path) else bytes(src)
            if name == "patch.stp" and v in self.bad:
                self.good[key] = data
                data = self.bad[v](data)
                self.bad_ref[v] = (len(data), hashlib.sha256(data).hexdigest())
            elif name == "manifest.json":
                self.good[key] = data
                m = Manifest.model_validate_json(data)
                if v in self.bad and self.consistent:
                    size, sha = self.bad_ref[v]
                    objs = [o.model_copy(update={"size": size, "sha256": sha})
                            if o.role == "patch" else o for o in m.objects]
                    data = m.model_copy(update={"objects": objs}).model_dump_json(
                        indent=1).encode()
                if v in self.pad_manifest:
                    data = data + b" " * max(0, self.pad_manifest[v] - len(data))
            return await super().put(key, data)
        return await super().put(key, src)

    def restore(self) -> None:
        """Put the good bytes back in place (an operator repairing the board)."""
        for key, data in self.good.items():
            dst = self.root / key
            tmp = dst.with_name(dst.name + ".restore")
            tmp.write_bytes(data)
            os.replace(tmp, dst)
        self.good.clear()


def bomb_patch(base: dict[str, torch.Tensor], version: int) -> bytes:
    """A patch of `RUN` v(version - 1) -> v`version` that adds a 32 MiB constant tensor coded in
    under 4 KB by an encoder without the format's cap on symbol probability (as in
    tests/test_patch.py::test_a_decompression_bomb_is_refused_before_decoding)."""
    from stitch_core.format import entropy, header
    from stitch_core.format.patch import PatchBuilder

    saved = entropy.MIN_COST_SHIFT, header.min_stream_bytes
    entropy.MIN_COST_SHIFT, header.min_stream_bytes = 40, (lambda k: 0)
    try:
        with tempfile.TemporaryDirectory() as d:
            path = Path(d) / "bomb.stp"
            fps = fpr.state_fingerprints(base)
            with open(path, "wb") as f:
                b = PatchBuilder(f, run=RUN, base_version=version - 1, target_version=version,
                                 view="bf16")
                for name in sorted(base):
                    b.add(name, base[name], base[name], fps[name])
                b.add("w", None, torch.zeros(4096, 4096, dtype=torch.bfloat16), None)
                b.finish()
            return path.read_bytes()
    finally:
        entropy.MIN_COST_SHIFT, header.min_stream_bytes = saved


# ---------------------------------------------------------------- the rig

@dataclass
class Row:
    fault: str
    seconds: float | None  # to the next good version; None: not reached
    unproven: int | None
    lost: int | str | None
    notes: str
    served: int = 0
    refused: int = 0
    engine: str = "toy TP=2 (in-process)"
    extra: dict = field(default_factory=dict)


class Rig:
    """Publisher + nats-server + HTTP board + (Follower -> Coordinator -> 2 toy ranks, gate)."""

    def __init__(self, name: str, work: Path, truth: Truth, args: argparse.Namespace, *,
                 snapshot_every: int = 0, nats: bool = True, rpc_fault: Callable | None = None):
        self.name, self.truth, self.args = name, truth, args
        self.dir = work / name
        self.dir.mkdir(parents=True)
        self.board_dir = self.dir / "board"
        self.board_dir.mkdir()
        self.board = TamperingBoard(self.board_dir)
        self.http = HttpBoardServer(self.board_dir)
        self.nats: NatsServer | None = NatsServer(self.dir / "js") if nats else None
        self.nats_port: int | None = None
        self.snapshot_every = snapshot_every
        self.pub: Publisher | None = None
        self.next_index = 0
        self.failed_publishes: list[tuple[int, str]] = []
        self.rpc_fault = rpc_fault
        self.engines: list[ToyEngine] = []
        self.coord: Coordinator | None = None
        self.gate: VersionGate | None = None
        self.follower: Follower | None = None
        self.steps_allowed = asyncio.Event()
        self.steps_allowed.set()
        self.served = self.refused = self.unproven = 0
        self.unproven_why: list[str] = []
        self.wrong_bits: set[int] = set()
        self.max_gap = 0.0
        self.errors: list[str] = []  # the follower's distinct last_error values, in order
        self._last_served: float | None = None
        self.on_board: dict[int, float] = {}  # version -> when `latest` first named it
        self._tasks: list[asyncio.Task] = []

    # ----- infrastructure

    async def _watch_latest(self) -> None:
        path = self.board_dir / RUN / "latest"
        while True:
            with contextlib.suppress(OSError, ValueError, KeyError):
                v = json.loads(path.read_bytes())["version"]
                self.on_board.setdefault(v, time.perf_counter())
            await asyncio.sleep(0.005)

    async def start_infra(self) -> None:
        self._tasks.append(asyncio.ensure_future(self._watch_latest()))
        if self.nats is not None:
            await asyncio.to_thread(self.nats.start)
            self.nats_port = self.nats.port
        await asyncio.to_thread(self.http.start)

    @property
    def nats_url(self) -> str | None:
        return f"nats://127.0.0.1:{self.nats_port}" if self.nats_port else None

    async def nats_stop(self) -> None:
        assert self.nats is not None
        await asyncio.to_thread(self.nats.stop)

    async def nats_start(self) -> None:
        self.nats = NatsServer(self.dir / "js", port=self.nats_port)
        await asyncio.to_thread(self.nats.start)
        self.nats_port = self.nats.port

    def new_publisher(self) -> None:
        self.pub = Publisher(self.board, RUN, "bf16", nats=self.nats_url,
                             snapshot_every=self.snapshot_every, spool_dir=self.dir / "spool")

    async def publish(self, wait: bool = True) -> int:
        """The trainer publishes the next view; its version (waits until it is on the board)."""
        assert self.pub is not None
        i = self.next_index
        self.next_index += 1
        info = await asyncio.to_thread(self.pub.publish, i, self.truth.views[i])
        self.truth.published(info.version, i)
        if wait:
            try:
                await asyncio.to_thread(info.result, 60)
            except Exception as e:  # noqa: BLE001 - recorded: the trainer saw this publish fail
                self.failed_publishes.append((info.version, f"{type(e).__name__}: {e}"))
        else:
            self._tasks.append(asyncio.ensure_future(self._watch(info)))
        return info.version

    async def _watch(self, info) -> None:
        try:
            await asyncio.to_thread(info.result, 120)
        except Exception as e:  # noqa: BLE001
            self.failed_publishes.append((info.version, f"{type(e).__name__}: {e}"))

    # ----- the engine side

    def _rpc(self, replicas: list[RankReplica]):
        async def rpc(req):
            req = rpc_.decode(rpc_.encode(req))  # as through an engine's RPC
            out = []
            for i, r in enumerate(replicas):
                what = self.rpc_fault(i, req) if self.rpc_fault else None
                if what == "hang":
                    await asyncio.sleep(3600)
                if what == "raise":
                    raise RuntimeError(f"rank {i}: injected failure in {type(req).__name__}")
                out.append(rpc_.decode(rpc_.encode(r.handle(req))))
            return out
        return rpc

    async def start_engine(self, version: int = 0, nats: bool = True) -> None:
        """Pull `version`, start the coordinator on 2 toy ranks loaded with it, the gate, the
        follower and the engine-step loop."""
        d = self.dir / f"pulled-{version}"
        await pull(LocalBoard(self.board_dir), RUN, version, d, self.dir / "pull-cache",
                   quiet=True)
        self.engines = engines_for(self.truth.views[self.truth.view_of[version]])
        replicas = [RankReplica(e, rank_info={"rank": i}) for i, e in enumerate(self.engines)]
        self.gate = gate = VersionGate(RUN, catch_up=self._catch_up)

        async def pause() -> None:
            self.steps_allowed.clear()

        async def resume() -> None:
            self.steps_allowed.set()

        self.coord = coord = Coordinator(self._rpc(replicas), run=RUN, gate=gate, pause=pause,
                                         resume=resume, loader_fallback=True,
                                         rpc_timeout=self.args.rpc_timeout)
        await coord.start(d)
        self.follower = Follower(
            self.http.url, RUN, coord, served=gate.served, nats=self.nats_url if nats else None,
            cache_dir=self.dir / "cache", reconcile_interval=self.args.reconcile,
            engine_id=self.name)
        await self.follower.start()
        self._tasks.append(asyncio.ensure_future(self._engine_steps()))

    async def _catch_up(self, version: int, timeout: float) -> bool:
        """The gate's catch-up port (as the node's): the follower's, once there is one."""
        f = self.follower
        return await f.wait_for(version, timeout) if f is not None else False

    def proven(self, v: int | None) -> str | None:
        """Why serving now would be serving an unproven state (None: it is proven)."""
        c = self.coord
        assert c is not None and self.gate is not None
        if c.check.get("ok") is not True:
            return f"check {c.check.get('kind')} not ok"
        if v is None or c.version != v:
            return f"gate v{v} but coordinator v{c.version}"
        want = self.truth.fps(v)
        if want is None:
            return f"v{v} was never published"
        if c.fps != want:
            return f"v{v}: coordinator fingerprints are not the publisher's"
        if not same_bits(self.engines, self.truth.engines(v)):
            return f"v{v}: rank bits differ from the publisher's view"
        return None

    async def _engine_steps(self) -> None:
        assert self.gate is not None
        while True:
            err = self.follower.last_error if self.follower is not None else None
            if err and err not in self.errors and len(self.errors) < 8:
                self.errors.append(err)
            try:  # admission, as the API server does it (steps held or not)
                t = await self.gate.admit()
            except NotReadyError:
                self.refused += 1
                await asyncio.sleep(0.005)
                continue
            # an admitted request runs only when engine steps run: frozen while the coordinator
            # holds them (a write, an undo, a load, no version proven)
            while not self.steps_allowed.is_set():
                await self.steps_allowed.wait()  # (looked at again: a new pause may have begun)
            now = time.perf_counter()
            if self._last_served is not None:
                self.max_gap = max(self.max_gap, now - self._last_served)
            self._last_served = now
            self.served += 1
            why = self.proven(self.gate.version)
            if why is not None:
                if "bits differ" in why and self.gate.version is not None:
                    self.wrong_bits.add(self.gate.version)
                self.unproven += 1
                if len(self.unproven_why) < 5:
                    self.unproven_why.append(why)
            self.gate.release(t)
            await asyncio.sleep(0.005)

    @property
    def held(self) -> int | None:
        return self.coord.version if self.coord is not None else None

    async def wait_held(self, version: int, timeout: float) -> float | None:
        """Wait until the coordinator holds `version` or newer, proven; the perf_counter time
        it was first seen there (None on timeout)."""
        deadline = time.perf_counter() + timeout
        while time.perf_counter() < deadline:
            v = self.held
            if v is not None and v >= version and self.proven(v) is None:
                return time.perf_counter()
            await asyncio.sleep(0.005)
        return None

    def reached_at(self, version: int) -> float | None:
        """When the follower's step to `version` or newer completed (its history)."""
        assert self.follower is not None
        for h in self.follower.history:
            if h["version"] >= version:
                return h["current_at"]
        return None

    async def settle(self, published_after: list[int], timeout: float | None = None
                     ) -> tuple[int, str]:
        """Wait (up to `timeout`, default --settle) for every version in `published_after`
        (published after the fault ended); (versions lost, a note)."""
        if published_after:
            await self.wait_held(max(published_after),
                                 self.args.settle if timeout is None else timeout)
        held = self.held
        missed = [v for v in published_after if held is None or v > held]
        lost = len(missed) + len(self.wrong_bits)
        note = ""
        if missed:
            note = f"stuck at v{held}: never reached v{missed[0]}..v{missed[-1]}"
            if self.follower is not None and self.follower.last_error:
                note += f" (follower: {short(self.follower.last_error)})"
        if self.wrong_bits:
            note += f"; wrong bits served at {sorted(self.wrong_bits)}"
        if self.coord is not None and held is not None:
            check = await self.coord.verify()
            if not check["ok"]:
                note += "; final full check failed"
        return lost, note

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(BaseException):
                await t
        if self.follower is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.follower.stop(), 10)
        if self.nats is not None and not self.nats.running and self.nats_port:
            with contextlib.suppress(Exception):
                await self.nats_start()
        if self.pub is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.to_thread(self.pub.close), 30)
        await asyncio.to_thread(self.http.stop)
        if self.nats is not None:
            await asyncio.to_thread(self.nats.stop)

    def row(self, fault: str, seconds: float | None, lost: int | str | None, notes: str,
            **extra) -> Row:
        gap = f"longest gap between served requests {self.max_gap:.2f} s"
        if self.refused:
            gap += f"; {self.refused} requests refused not_ready"
        why = f"; unproven: {self.unproven_why}" if self.unproven_why else ""
        return Row(fault, seconds, self.unproven, lost, f"{notes}; {gap}{why}".strip("; "),
                   served=self.served, refused=self.refused, extra=extra)


def gist(err: str) -> str:
    """The reason inside a pydantic validation error (else `err`)."""
    if "Value error, " in err:
        return err.split("Value error, ", 1)[1].split(" [type=", 1)[0]
    return err


def short(s: str, n: int = 140) -> str:
    s = " ".join(str(s).split())
    return s if len(s) <= n else s[: n - 1] + "…"


async def started(rig: Rig, versions: int = 2) -> int:
    """Infrastructure up, v0 published, the engine following, `versions` more published and
    reached. The version held."""
    await rig.start_infra()
    rig.new_publisher()
    await rig.publish()
    await rig.start_engine(0)
    v = 0
    for _ in range(versions):
        v = await rig.publish()
    if await rig.wait_held(v, 20) is None:
        raise RuntimeError(f"{rig.name}: the follower did not reach v{v} before the fault")
    return v


def since(t: float | None, ref: float) -> float | None:
    return None if t is None else max(0.0, t - ref)


# ---------------------------------------------------------------- the faults

SNAPSHOT_EVERY = 6  # the trainer's snapshot_every in the rows that need a later snapshot


async def bad_patch(name: str, make: Callable[[Rig, int], Callable[[bytes], bytes]] | None,
                    work: Path, truth: Truth, args, *, pad: int | None = None,
                    what: str, repair: bool = False) -> Row:
    """v3's patch (or manifest) as the trainer's upload path writes it is bad, with a manifest
    consistent with the bad bytes (so the engine's own checks, not the fetch's hash, must refuse
    it). The trainer goes on publishing every second (patches from its true v3) up to its next
    snapshot (v6, snapshot_every=6): the reference is that snapshot's publish. With `repair`
    there is no snapshot: the good objects are put back after `--fault-window` s (the
    reference)."""
    rig = Rig(name, work, truth, args, snapshot_every=0 if repair else SNAPSHOT_EVERY)
    try:
        n = 3  # started() leaves the follower at v2
        bad = await asyncio.to_thread(make, rig, n) if make is not None else None
        have = await started(rig)
        assert have + 1 == n
        if bad is not None:
            rig.board.bad[n] = bad
        if pad is not None:
            rig.board.pad_manifest[n] = pad
        v = await rig.publish()
        if repair:
            await asyncio.sleep(1.0)
            target = await rig.publish()  # v4: a patch from the true v3
            await asyncio.sleep(args.fault_window)
            t_ref = time.perf_counter()
            await asyncio.to_thread(rig.board.restore)
            how = "the good objects put back on the board after the fault window"
        else:
            while v % SNAPSHOT_EVERY:
                await asyncio.sleep(1.0)
                t_ref = time.perf_counter()
                v = await rig.publish()
            target = v
            how = f"the trainer's next snapshot v{v} (published every second, snapshot_every=6)"
        held_during = rig.held
        t = await rig.wait_held(target, args.settle)
        after = [await rig.publish() for _ in range(2)]
        lost, note = await rig.settle(after, args.settle if t is not None else 3.0)
        assert rig.follower is not None
        if t is None and n in getattr(rig.follower, "avoid", {}):
            from stitch_core.versions import follower as follower_mod

            note += (f"; v{n} is on the follower's avoid list after "
                     f"{getattr(follower_mod, 'BAD_AFTER', '?')} failures: not tried again "
                     f"for AVOID_TTL = {getattr(follower_mod, 'AVOID_TTL', float('nan')):g} s")
        said = "; ".join(f'"{short(gist(e), 100)}"' for e in rig.errors[:2]) or "nothing"
        notes = (f"{what}; held v{held_during} meanwhile, follower said {said}; "
                 f"next good: {how}")
        return rig.row(name, since(t, t_ref), lost, "; ".join(x for x in (notes, note) if x))
    finally:
        await rig.close()


def corrupt(data: bytes) -> bytes:
    b = bytearray(data)
    b[20] ^= 0x40  # in the first chunk payload (the preamble is 16 bytes)
    return bytes(b)


def truncate(data: bytes) -> bytes:
    return data[: len(data) // 2]


async def rank_fault(name: str, kind: str, work: Path, truth: Truth, args) -> Row:
    """Rank 1 raises / hangs on the write of vN (once), or ("lost") fails its write and answers
    nothing for 2 s (the undo cannot be proven). Reference: the fault (the write)."""
    state = {"armed": False, "at": None, "until": 0.0}

    def fault(rank: int, req) -> str | None:
        if rank != 1:
            return None
        if kind == "lost" and time.perf_counter() < state["until"]:
            return "raise"
        if state["armed"] and isinstance(req, rpc_.Write):
            state["armed"] = False
            state["at"] = time.perf_counter()
            if kind == "lost":
                state["until"] = state["at"] + 2.0
                return "raise"
            return kind
        return None

    rig = Rig(name, work, truth, args, rpc_fault=fault)
    try:
        await started(rig)
        state["armed"] = True
        n = await rig.publish()
        t = await rig.wait_held(n, args.settle)
        ref = state["at"] if state["at"] is not None else time.perf_counter()
        if kind == "lost":
            ref = state["until"]  # from the rank's return
        after = [await rig.publish() for _ in range(2)]
        lost, note = await rig.settle(after)
        how = {"raise": "rank 1 raised in its write: undone on every rank, previous version "
                        "proven, applied on the next tick",
               "hang": f"rank 1 never answered its write: RPC timeout {args.rpc_timeout:g} s, "
                       "undone, proven, applied on the next tick",
               "lost": "rank 1 failed its write and answered nothing for 2 s: undo unprovable "
                       "-> not_ready, snapshot reloaded and chain replayed once it was back"}[kind]
        return rig.row(name, since(t, ref), lost, "; ".join(x for x in (how, note) if x))
    finally:
        await rig.close()


async def nats_restart(name: str, work: Path, truth: Truth, args, *, down: float,
                       at_start: bool = False) -> Row:
    """The nats-server is stopped for `down` s (same port and store directory when it comes
    back) while the trainer publishes every second; `at_start`: it is down when the follower
    starts. Reference: each publish during the outage (median) and the restart."""
    rig = Rig(name, work, truth, args)
    try:
        if at_start:
            await rig.start_infra()
            rig.new_publisher()
            await rig.publish()
            await rig.nats_stop()
            await rig.start_engine(0)
        else:
            await started(rig)
            await rig.nats_stop()
        t_down = time.perf_counter()
        during: list[tuple[int, float]] = []
        while time.perf_counter() - t_down < down:
            t0 = time.perf_counter()
            v = await rig.publish(wait=False)
            during.append((v, t0))
            await asyncio.sleep(1.0)
        await rig.nats_start()
        t_up = time.perf_counter()
        lat, board_lat = [], []
        for v, t0 in during:
            t = await rig.wait_held(v, args.settle)
            at = rig.reached_at(v)
            if t is not None and at is not None:
                lat.append(at - t0)
                if v in rig.on_board:
                    board_lat.append(at - rig.on_board[v])
        # after NATS is back: when does the follower hear announcements again?
        heard = None
        after: list[int] = []
        assert rig.follower is not None
        while time.perf_counter() - t_up < 15.0:
            await asyncio.sleep(1.0)
            v_after = await rig.publish()
            after.append(v_after)
            await rig.wait_held(v_after, args.settle)
            h = next((h for h in rig.follower.history if h["version"] == v_after), None)
            if h is not None and h.get("announced_at") is not None:
                heard = (v_after, h["announced_at"] - t_up, h["current_at"] - h["announced_at"])
                break
        lost, note = await rig.settle(after)
        failed = [v for v, _ in rig.failed_publishes]
        notes = (f"{len(during)} versions published during the {down:g} s outage, reached by "
                 f"board polling in median {statistics.median(lat):.2f} s after publish() "
                 f"({statistics.median(board_lat):.2f} s after they landed on the board)"
                 if lat and board_lat else "no version reached during the outage")
        if heard:
            notes += (f"; announcements heard again {heard[1]:.1f} s after NATS was back (v"
                      f"{heard[0]}: announce -> current {1e3 * heard[2]:.0f} ms)")
        else:
            notes += "; no announcement heard within 15 s after NATS was back (board polling only)"
        if failed:
            notes += (f"; trainer: {len(failed)} of {len(during)} publishes reported failed "
                      f"though on the board ({short(rig.failed_publishes[0][1], 60)})")
        secs = statistics.median(lat) if lat else None
        return rig.row(name, secs, lost, "; ".join(x for x in (notes, note) if x))
    finally:
        await rig.close()


async def board_outage(name: str, mode: str, work: Path, truth: Truth, args) -> Row:
    """The HTTP board answers 503 / refuses connections / answers every request `--slow` s
    late, for `--outage` s, while the trainer publishes. Reference: the outage's end."""
    rig = Rig(name, work, truth, args)
    try:
        have = await started(rig)
        if mode == "refused":
            await asyncio.to_thread(rig.http.stop)
        else:
            rig.http.faults.update(mode=mode, delay=args.slow)
        t0 = time.perf_counter()
        published = []
        while time.perf_counter() - t0 < args.outage:
            published.append(await rig.publish())
            await asyncio.sleep(1.0)
        held_during = rig.held
        err = rig.follower.last_error if rig.follower else None
        if mode == "refused":
            await asyncio.to_thread(rig.http.start)
        else:
            rig.http.faults.clear()
        t_end = time.perf_counter()
        t = await rig.wait_held(published[-1], args.settle)
        after = [await rig.publish() for _ in range(2)]
        lost, note = await rig.settle(after)
        moved = (held_during or 0) - have
        notes = (f"{len(published)} versions published during the {args.outage:g} s outage; the "
                 f"follower moved {moved} version(s) meanwhile and served v{held_during}"
                 + (f" (follower: \"{short(err, 90)}\")" if err else ""))
        return rig.row(name, since(t, t_end), lost, "; ".join(x for x in (notes, note) if x))
    finally:
        await rig.close()


async def persistent_bad(name: str, work: Path, truth: Truth, args) -> Row:
    """vN's patch object is damaged on the board for good (the manifest keeps the true hash);
    the trainer goes on and publishes a snapshot (snapshot_every) a few versions later.
    Reference: the snapshot's publish."""
    every = 6
    rig = Rig(name, work, truth, args, snapshot_every=every)
    try:
        have = await started(rig)
        n = have + 1
        rig.board.consistent = False
        rig.board.bad[n] = corrupt
        v = await rig.publish()
        while v % every:
            await asyncio.sleep(1.0)
            t_snap = time.perf_counter()
            v = await rig.publish()
        t = await rig.wait_held(v, args.settle)
        after = [await rig.publish() for _ in range(2)]
        lost, note = await rig.settle(after)
        m = await asyncio.to_thread(lambda: Manifest.model_validate_json(
            (rig.board_dir / manifest_key_of(RUN, v)).read_bytes()))
        has_patch = m.patch is not None
        carries = f" that also carries its patch from v{v - 1}" if has_patch else ""
        notes = (f"v{n}'s patch damaged on the board (SHA-256 mismatch on every fetch); v{v} is "
                 f"a snapshot{carries}")
        return rig.row(name, since(t, t_snap), lost, "; ".join(x for x in (notes, note) if x))
    finally:
        await rig.close()


TRAINER = """
import os, signal, sys, time
sys.path.insert(0, {root!r})
import torch
from stitch_core.versions.board import LocalBoard
from stitch_trainer.publisher import Publisher
board_dir, nats, views_file, first, last, kill_at = sys.argv[1:7]
first, last, kill_at = int(first), int(last), int(kill_at)
views = torch.load(views_file)

class Board(LocalBoard):
    async def move_latest(self, run, expected, latest):
        if latest.version == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)  # objects and manifest are up, latest is not
        return await super().move_latest(run, expected, latest)

pub = Publisher(Board(board_dir), {run!r}, "bf16", nats=nats or None)
for i in range(first, last + 1):
    info = pub.publish(i, views[i])
    m = info.result()
    print(f"published {{m.version}} {{i}} {{m.kind}} {{time.time()}}", flush=True)
pub.close()
"""


async def trainer_killed(name: str, work: Path, truth: Truth, args) -> Row:
    """A trainer process is SIGKILLed while publishing vN (objects and manifest uploaded,
    `latest` not moved); a new trainer process starts on the same board and publishes on.
    Reference: the restarted trainer's first publish."""
    rig = Rig(name, work, truth, args)
    script = rig.dir / "trainer.py"
    script.write_text(TRAINER.format(root=str(ROOT), run=RUN))
    views_file = rig.dir / "views.pt"
    torch.save(truth.views, views_file)

    async def trainer(first: int, last: int, kill_at: int) -> tuple[int, list[list[str]]]:
        p = await asyncio.create_subprocess_exec(
            sys.executable, str(script), str(rig.board_dir), rig.nats_url or "", str(views_file),
            str(first), str(last), str(kill_at), stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL)
        lines = []
        assert p.stdout is not None
        async for line in p.stdout:
            parts = line.decode().split()
            lines.append(parts)
            truth.published(int(parts[1]), int(parts[2]))
        return await p.wait(), lines

    try:
        await rig.start_infra()
        rc, _ = await trainer(0, 0, -1)  # v0
        await rig.start_engine(0)
        killed_at = 4
        rc, lines = await trainer(1, 6, killed_at)  # v1..v3 land, SIGKILL inside v4
        await rig.wait_held(killed_at - 1, args.settle)
        held_before = rig.held
        rc2, lines2 = await trainer(killed_at + 1, killed_at + 3, -1)  # the restarted trainer
        new = [int(x[1]) for x in lines2]
        seconds = None
        if new:
            await rig.wait_held(max(new), args.settle)
            at = rig.reached_at(new[0])  # perf_counter of the follower's step
            if at is not None:  # from the restarted trainer's first publish (wall clock)
                seconds = max(0.0, time.time() - (time.perf_counter() - at) - float(lines2[0][4]))
        lost, note = await rig.settle(new)
        kinds = ", ".join(f"v{x[1]} {x[3]}" for x in lines2)
        left = sorted(p.name for p in (rig.board_dir / RUN / "versions" /
                                       f"{killed_at:06d}").glob("*"))
        notes = (f"trainer exit {rc} (SIGKILL inside v{killed_at}'s publish, after "
                 f"{'+'.join(left) or 'nothing'}, before latest); follower held v{held_before}; "
                 f"restarted trainer (exit {rc2}) published {kinds} (v{killed_at} skipped: it "
                 "holds objects)")
        return rig.row(name, seconds, lost, "; ".join(x for x in (notes, note) if x))
    finally:
        await rig.close()


def scenarios(views: list[dict[str, torch.Tensor]]) -> dict[str, Callable[..., Awaitable[Row]]]:
    foreign: dict[int, bytes] = {}
    shadow: dict[int, bytes] = {}

    def from_shadow(run: str, store: dict[int, bytes], offset: int):
        """Patches of the same views published by a run named `run` (the foreign run, or this
        run published ahead: the trainer is deterministic)."""
        def make(rig: Rig, n: int) -> Callable[[bytes], bytes]:
            k = n + offset
            if k not in store:
                d = rig.dir / f"shadow-{run}"
                with Publisher(str(d), run, "bf16") as p:
                    for i in range(k + 1):
                        p.publish(i, views[i]).result()
                store.update({v: (d / patch_key(run, v)).read_bytes() for v in range(1, k + 1)})
            return lambda good: store[k]
        return make

    def bomb(rig: Rig, n: int) -> Callable[[bytes], bytes]:
        data = bomb_patch(views[n - 1], n)
        return lambda good: data

    return {
        "corrupt": lambda w, t, a: bad_patch(
            "corrupt patch", lambda r, n: corrupt, w, t, a,
            what="one bit flipped in a chunk payload, manifest hash of the bad bytes"),
        "repaired": lambda w, t, a: bad_patch(
            "corrupt patch, repaired on the board (no later snapshot)", lambda r, n: corrupt,
            w, t, a, repair=True,
            what="as above; no snapshot follows, the board is repaired"),
        "truncated": lambda w, t, a: bad_patch(
            "truncated patch", lambda r, n: truncate, w, t, a,
            what="patch cut at half its length, manifest hash of the cut bytes"),
        "foreign": lambda w, t, a: bad_patch(
            "foreign patch (another run)", from_shadow("other-run", foreign, 0), w, t, a,
            what="the same step's patch of run other-run"),
        "out-of-order": lambda w, t, a: bad_patch(
            "out-of-order patch", from_shadow(RUN, shadow, 1), w, t, a,
            what="vN's slot holds v(N+1)'s patch (base vN)"),
        "oversized": lambda w, t, a: bad_patch(
            "oversized manifest", None, w, t, a, pad=MAX_MANIFEST_BYTES + 1,
            what=f"manifest padded to {MAX_MANIFEST_BYTES + 1:,} bytes (limit "
                 f"MAX_MANIFEST_BYTES)"),
        "bomb": lambda w, t, a: bad_patch(
            "decompression bomb", bomb, w, t, a,
            what="a 32 MiB constant tensor coded in < 4 KB by an uncapped encoder"),
        "rank-raise": lambda w, t, a: rank_fault("TP=2 rank raises mid-write", "raise", w, t, a),
        "rank-hang": lambda w, t, a: rank_fault("TP=2 rank hangs mid-write", "hang", w, t, a),
        "rank-lost": lambda w, t, a: rank_fault(
            "TP=2 rank lost mid-write (undo unprovable)", "lost", w, t, a),
        "nats-restart": lambda w, t, a: nats_restart("NATS restart", w, t, a, down=1.0),
        "nats-down-start": lambda w, t, a: nats_restart(
            "NATS down at follower start", w, t, a, down=6.0, at_start=True),
        "nats-down-mid": lambda w, t, a: nats_restart("NATS down mid-run", w, t, a, down=6.0),
        "board-5xx": lambda w, t, a: board_outage("board HTTP 503", "5xx", w, t, a),
        "board-refused": lambda w, t, a: board_outage(
            "board connection refused", "refused", w, t, a),
        "board-slow": lambda w, t, a: board_outage("board slow", "slow", w, t, a),
        "persistent-bad": lambda w, t, a: persistent_bad(
            "persistently bad object + later snapshot", w, t, a),
        "trainer-killed": lambda w, t, a: trainer_killed(
            "trainer SIGKILLed mid-publish + restart", w, t, a),
    }


