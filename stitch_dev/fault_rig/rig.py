"""The fault rig itself: ``Rig`` (a publisher, a nats-server, the HTTP board, and one
engine-shaped follower: ``Follower`` -> ``Coordinator`` -> 2 toy ranks, with a ``VersionGate``
and an engine-step loop that checks every admitted request) and the ``Row`` a fault reports."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from stitch_core.engine import rpc as rpc_
from stitch_core.engine.coordinator import Coordinator
from stitch_core.engine.replica import RankReplica
from stitch_core.serve.gate import NotReadyError, VersionGate
from stitch_core.versions.board import LocalBoard
from stitch_core.versions.follower import Follower
from stitch_core.versions.materialize import pull
from stitch_core.versions.natsserver import NatsServer
from stitch_trainer.publisher import Publisher

from ..toy_engine import ToyEngine
from .http_board import HttpBoardServer
from .tamper import TamperingBoard
from .truth import RUN, Truth, engines_for, same_bits


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
