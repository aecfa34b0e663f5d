"""The gateway's view of a fleet: the engines its heartbeats describe, which of them can serve a
request now, and in what order to try them. No I/O (stitch_core.serve.gateway feeds it).

An engine is *routable* while its last heartbeat is younger than `ttl` seconds, names a URL,
holds a version (state not ``not_ready``) and its follower is not ``dead``. Heartbeats come in
already admitted (stitch_core.serve.admission): one entry per heartbeat subject, ordered by
arrival (a live one replaces the entry; one read back from the stream at start-up only if it is
newer by stream sequence than what is there), never by the time the sender claims. The table
holds at most `max_engines` entries (the least recently heard one is evicted). Among the routable
engines that can serve a request's version headers (`protocol.satisfies`), the order is: same
region first (when the gateway has one), then least loaded (requests the gateway has in flight
there plus the other requests the engine's last heartbeat counted), then the newest version,
then the id.

The gateway's side only (which engine a request goes to); which HTTP routes of one engine are
version-controlled is `stitch_core.serve.route_table`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from dataclasses import dataclass, field

import httpx
from pydantic import BaseModel

from stitch_core.serve import protocol
from stitch_core.serve.admission import Admitted
from stitch_core.versions.manifest import Heartbeat

log = logging.getLogger("stitch.gateway")

DEFAULT_TTL = 10.0  # seconds without a heartbeat before an engine is dropped (5 of its beats)
DEFAULT_MAX_ENGINES = 1024  # table entries (heartbeat subjects) at most


class EngineRow(BaseModel):
    """One engine as the gateway sees it (its status JSON and `stitch status`)."""

    id: str
    url: str | None
    region: str | None
    version: int | None
    latest: int | None
    state: str
    health: str
    load: int | None  # requests in flight the engine's last heartbeat counted
    in_flight: int  # requests this gateway has in flight there now
    routable: bool
    last_seen_seconds: float
    requests_total: int
    refused_total: int  # 409s it answered this gateway
    errors_total: int  # connections that failed


class GatewayStatus(BaseModel):
    """`GET /stitch/gateway`."""

    id: str
    run: str
    region: str | None
    ttl: float
    nats_connected: bool
    engines: list[EngineRow]
    routable: int
    versions: list[int]
    in_flight: int
    requests_total: int
    retries_total: int
    waited_total: int
    refused_total: int  # the gateway's own 409 / 503 answers
    timeouts_total: int = 0  # engines that sent no response head within --upstream-timeout
    heartbeats_rejected_total: int = 0  # heartbeats refused at admission
    engines_evicted_total: int = 0  # table entries evicted to stay within max_engines
    max_engines: int = DEFAULT_MAX_ENGINES
    api_key_required: bool = False  # /stitch/gateway and /metrics want a Bearer key


@dataclass(eq=False)
class Engine:
    """An engine of the table: its last heartbeat and this gateway's counters for it."""

    hb: Heartbeat
    key: str  # the last token of the heartbeat subject it speaks for
    base: httpx.URL | None  # its admitted URL
    seen: float  # time.monotonic() of the last heartbeat
    beat: int = 0  # the table's count of heartbeats when its last one arrived (orders them)
    seq: int | None = None  # stream sequence of its last heartbeat; None: it came live
    in_flight: int = 0
    others: int = 0  # heartbeat load less what this gateway had in flight there then
    requests: int = 0
    refused: int = 0
    errors: int = 0

    @property
    def id(self) -> str:
        return self.hb.id

    @property
    def load(self) -> int:
        return self.in_flight + self.others


@dataclass(eq=False)
class EngineTable:
    """The engines of one run, from their heartbeats; waiters are woken on every heartbeat."""

    run: str
    region: str | None = None
    ttl: float = DEFAULT_TTL
    max_engines: int = DEFAULT_MAX_ENGINES
    engines: dict[str, Engine] = field(default_factory=dict)  # by subject token
    evicted: int = 0

    def __post_init__(self) -> None:
        self._changed = asyncio.Event()
        self._beats = itertools.count(1)

    def observe(self, a: Admitted, age: float = 0.0, seq: int | None = None) -> None:
        """An admitted heartbeat: live (`seq` None), or read back from the stream at start-up
        (`seq`: its stream sequence; `age`: seconds since the server stored it), which counts
        only if nothing newer of that subject is known."""
        if a.hb.run != self.run:
            return
        e = self.engines.get(a.key)
        if seq is not None and e is not None and (e.seq is None or e.seq >= seq):
            return  # already heard live, or a newer stored one
        seen = time.monotonic() - max(0.0, age)
        if e is None:
            while len(self.engines) >= max(1, self.max_engines):
                self._evict()
            e = self.engines[a.key] = Engine(a.hb, a.key, a.base, seen)
        e.hb, e.base, e.seen, e.seq, e.beat = a.hb, a.base, seen, seq, next(self._beats)
        e.others = max(0, (a.hb.load or 0) - e.in_flight)
        self._changed.set()
        self._changed = asyncio.Event()

    def _evict(self) -> None:
        old = min(self.engines.values(), key=lambda e: e.seen)
        del self.engines[old.key]
        self.evicted += 1
        if self.evicted & (self.evicted - 1) == 0 or self.evicted % 1000 == 0:
            log.warning("gateway: %d engines in the table (--max-engines): evicted %s (%s), "
                        "the least recently heard (%d evicted so far)", self.max_engines,
                        old.id, old.key, self.evicted)

    def fresh(self, e: Engine, now: float | None = None) -> bool:
        return (now if now is not None else time.monotonic()) - e.seen <= self.ttl

    def routable(self, e: Engine, now: float | None = None) -> bool:
        hb = e.hb
        return (self.fresh(e, now) and e.base is not None and hb.version is not None
                and hb.state != "not_ready" and hb.health != "dead")

    def prune(self) -> None:
        """Forget engines silent for more than 10 TTLs (shown as not routable until then),
        requests in flight there or not (those finish on the entry they hold)."""
        now = time.monotonic()
        for k in [k for k, e in self.engines.items() if now - e.seen > 10 * self.ttl]:
            del self.engines[k]

    def live(self) -> list[Engine]:
        now = time.monotonic()
        return [e for e in self.engines.values() if self.routable(e, now)]

    def candidates(self, req: protocol.VersionRequest,
                   tried: dict[str, int] | None = None) -> list[Engine]:
        """Routable engines that can serve `req` now, best first. `tried`: engine key -> its
        `beat` when it refused or failed; such an engine counts again once a newer heartbeat
        came."""
        tried = tried or {}
        ok = [e for e in self.live() if protocol.satisfies(e.hb.version, req.exact, req.minimum)
              and e.beat > tried.get(e.key, -1)]
        return sorted(ok, key=lambda e: (
            self.region is not None and e.hb.region != self.region, e.load,
            -(e.hb.version or 0), e.id))

    async def wait_candidates(self, req: protocol.VersionRequest, deadline: float,
                              tried: dict[str, int] | None = None) -> list[Engine]:
        """`candidates`, waiting (until the monotonic `deadline`) for heartbeats that give some."""
        while True:
            changed = self._changed
            found = self.candidates(req, tried)
            left = deadline - time.monotonic()
            if found or left <= 0:
                return found
            # an engine may also go stale meanwhile: recheck at least once a second
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), min(left, 1.0))

    def passed(self, req: protocol.VersionRequest) -> bool:
        """An exact version older than every routable engine serves: engines never go back, so
        waiting cannot help (refused at once, as an engine does)."""
        versions = [e.hb.version for e in self.live()]
        return req.exact is not None and bool(versions) and all(
            v is not None and v > req.exact for v in versions)

    def refusal(self, req: protocol.VersionRequest) -> tuple[int, dict]:
        """The gateway's own answer when no engine can serve `req`: 503 ``not_ready`` while no
        engine is routable, else 409 (``passed`` for an exact version older than every engine
        serves, ``behind`` otherwise) in the engines' body shape."""
        live = self.live()
        versions = [e.hb.version for e in live if e.hb.version is not None]
        latests = [v for e in live for v in (e.hb.latest, e.hb.version) if v is not None]
        serving = max(versions, default=None)
        latest = max(latests, default=None)
        if not live:
            return 503, protocol.not_ready_body(
                run=self.run, serving=None, wanted=req.wanted, latest=None, reason="not_ready",
                message=f"no engine of run {self.run} is serving (none with a fresh heartbeat)")
        passed = self.passed(req)
        reason: protocol.Reason = "passed" if passed else "behind"
        message = (f"no engine of run {self.run} serves version {req.wanted} "
                   f"({'older than' if passed else 'beyond'} every engine: serving "
                   f"{sorted(set(versions))})")
        return 409, protocol.not_ready_body(run=self.run, serving=serving, wanted=req.wanted,
                                            latest=latest, reason=reason, message=message)

    def rows(self) -> list[EngineRow]:
        now = time.monotonic()
        return [EngineRow(
            id=e.id, url=e.hb.url, region=e.hb.region, version=e.hb.version,
            latest=e.hb.latest, state=e.hb.state, health=e.hb.health, load=e.hb.load,
            in_flight=e.in_flight, routable=self.routable(e, now),
            last_seen_seconds=round(now - e.seen, 3), requests_total=e.requests,
            refused_total=e.refused, errors_total=e.errors)
            for e in sorted(self.engines.values(), key=lambda e: e.id)]


def _label(v: str) -> str:
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def metrics_text(st: GatewayStatus) -> str:
    """Prometheus text exposition (format 0.0.4) of a gateway's status."""
    run = f'run="{_label(st.run)}"'
    out: list[str] = []

    def metric(name: str, kind: str, doc: str, samples: list[tuple[str, float]]) -> None:
        out.extend((f"# HELP {name} {doc}", f"# TYPE {name} {kind}"))
        out.extend(f"{name}{{{labels}}} {value:g}" for labels, value in samples)

    metric("stitch_gateway_engines", "gauge", "Engines the gateway routes to now",
           [(run, st.routable)])
    metric("stitch_gateway_in_flight", "gauge", "Requests in flight through the gateway",
           [(run, st.in_flight)])
    metric("stitch_gateway_requests_total", "counter", "Requests the gateway answered",
           [(run, st.requests_total)])
    metric("stitch_gateway_retries_total", "counter",
           "Requests sent to another engine after a 409 or a failed connection",
           [(run, st.retries_total)])
    metric("stitch_gateway_waited_total", "counter",
           "Requests that waited (X-Stitch-Wait) for an engine serving their version",
           [(run, st.waited_total)])
    metric("stitch_gateway_refused_total", "counter",
           "Requests the gateway itself answered 409 / 503 (no engine could serve them)",
           [(run, st.refused_total)])
    metric("stitch_gateway_timeouts_total", "counter",
           "Engines that sent no response head within the upstream timeout",
           [(run, st.timeouts_total)])
    metric("stitch_gateway_heartbeats_rejected_total", "counter",
           "Engine heartbeats refused at admission (wrong subject, URL, clock, malformed)",
           [(run, st.heartbeats_rejected_total)])
    metric("stitch_gateway_engines_evicted_total", "counter",
           "Engines evicted from the table to stay within --max-engines",
           [(run, st.engines_evicted_total)])
    per = [(r, f'{run},engine="{_label(r.id)}"') for r in st.engines]
    metric("stitch_gateway_engine_up", "gauge", "1 while the engine is routable, else 0",
           [(lb, 1 if r.routable else 0) for r, lb in per])
    metric("stitch_gateway_engine_version", "gauge", "Version the engine's heartbeat serves",
           [(lb, r.version) for r, lb in per if r.version is not None])
    metric("stitch_gateway_engine_in_flight", "gauge",
           "Requests the gateway has in flight at the engine", [(lb, r.in_flight) for r, lb in per])
    metric("stitch_gateway_engine_requests_total", "counter",
           "Requests the gateway sent to the engine", [(lb, r.requests_total) for r, lb in per])
    metric("stitch_gateway_engine_refused_total", "counter",
           "409s the engine answered the gateway", [(lb, r.refused_total) for r, lb in per])
    metric("stitch_gateway_engine_errors_total", "counter",
           "Connections to the engine that failed", [(lb, r.errors_total) for r, lb in per])
    return "\n".join(out) + "\n"
