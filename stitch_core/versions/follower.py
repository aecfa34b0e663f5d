"""Follower: keeps a replica at the newest version of a run, engine-agnostic.

Size: about 460 lines, one job: the follow loop (hear of a version, plan, fetch, hand steps in
order to the apply target) and the state it reports. Its failure accounting (the avoid list),
cache pruning and health are read and written by that same loop; apart, they would scatter one
state machine.

It learns about versions from NATS announcements (a wake-up, never required) and from `latest` on
the board, polled every `reconcile_interval` seconds, so a lost message delays nothing beyond that
timer. It plans the cheapest path (a chain of patches, or the nearest snapshot), fetches each object
once into a node-local cache, verifies sizes and SHA-256, and hands steps *in order* to its
apply target (`stitch_core.versions.ports.ApplyTarget`), which owns atomicity (an engine keeps
serving its last good version when it raises). State is reported honestly: `not_ready` until a
version is held, `catching_up` while behind, `applying` during a step, `serving` when current.

What is held, the newest published version and the refused ones live in a
`stitch_core.versions.served.ServedVersion`: the follower records there what it reads on the
board (`saw_latest`, `refuse`, `accept`). In an engine it is shared with the coordinator (which
records what the ranks are proven to hold) and the gate (which admits requests from it); alone
(`MemoryReplica`, `stitch follow`) the follower has its own and records each step it applied.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Literal

from stitch_core.settings import RECONCILE_INTERVAL
from stitch_core.versions.board import Board, open_board
from stitch_core.versions.board.base import NotFoundError
from stitch_core.versions.cache import DEFAULT_MAX_BYTES, CacheUse, prune
from stitch_core.versions.manifest import Announcement, Heartbeat, check_run
from stitch_core.versions.materialize import default_cache_dir
from stitch_core.versions.ports import ApplyTarget
from stitch_core.versions.served import ServedVersion
from stitch_core.versions.state import engine_state, lag
from stitch_core.versions.store import (
    RefusedVersionError,
    Step,
    VersionError,
    fetch_object,
    fetch_patch,
    plan,
    read_latest,
    read_manifest,
)
from stitch_core.versions.tasks import cancel_all
from stitch_core.versions.trust import TrustSet

log = logging.getLogger("stitch.follower")
BAD_AFTER = 2  # a version whose patch fails this many times (bad bytes, missing) is routed around
AVOID_TTL = 300.0  # seconds before a routed-around patch is tried again (it may be repaired)
HINT_SLACK = 1024  # an announcement this far beyond the newest known version is suspicious
MAX_HINTS = 4096  # announced versions remembered (for announce -> current timings), at most
Health = Literal["ok", "degraded", "dead"]


class Follower:
    """Keeps an apply target at the newest version of `run` on a board (see the module doc)."""

    def __init__(self, board: str | Board, run: str, apply: ApplyTarget, *,
                 version: int | None = None, served: ServedVersion | None = None,
                 nats: str | None = None,
                 cache_dir: str | os.PathLike | None = None,
                 reconcile_interval: float = RECONCILE_INTERVAL,
                 heartbeat_interval: float = 2.0, engine_id: str | None = None,
                 url: str | None = None, region: str | None = None, max_chain: int = 64,
                 on_dead: Callable[[BaseException], None] | None = None,
                 trust: TrustSet | None = None,
                 cache_max_bytes: int | None = DEFAULT_MAX_BYTES,
                 load: Callable[[], int | None] | None = None):
        """`served`: shared with an apply target that proves what it holds and records it there
        (an engine's coordinator); None: the follower's own, starting at `version`, set after
        each step applied."""
        if served is not None and version is not None:
            raise ValueError("give `served` (shared with the apply target) or `version`, not both")
        self.run = check_run(run)
        self.board = open_board(board) if isinstance(board, str) else board
        self._apply = apply
        self._records_steps = served is None
        self.served = served if served is not None else ServedVersion(version)
        self.nats_url = nats
        self.cache = Path(cache_dir) if cache_dir else default_cache_dir()
        # the cache keeps what is in use and the newest snapshot + what leads from it, within
        # `cache_max_bytes` (None: no cap); see stitch_core.versions.cache
        self.cache_max_bytes = cache_max_bytes
        self._cache_use = CacheUse(self.cache, self.run)
        self._keep_from: int | None = None  # the newest snapshot version reached
        self._over_cap_logged = False
        self.reconcile_interval = reconcile_interval
        self.heartbeat_interval = heartbeat_interval
        self.id = engine_id or f"{socket.gethostname()}-{os.getpid()}"
        self.url, self.region, self.max_chain = url, region, max_chain
        self.on_dead = on_dead  # told once if the follow loop ends (it never should)
        # with keys: only versions (and `latest` pointers) signed by one of them are believed
        self.trust = trust if trust else None
        # requests in flight in the engine (its VersionGate owns the count), for heartbeats
        self.load = load
        self._failures: dict[int, int] = {}  # version -> failed fetches/applies of its patch
        self.avoid: dict[int, float] = {}  # versions routed around -> since (monotonic)
        self.avoid_spans: dict[tuple[int, int], float] = {}  # (base, version) of failed spans
        self.error_since: float | None = None  # wall time of the first error of a failing run
        self.dead: str | None = None  # why the follow loop ended
        self.applying = False
        self.last_error: str | None = None
        self.last_apply_seconds: float | None = None
        self.patch_bytes_total = 0
        self.applied: list[int] = []  # versions in the order they were reached
        self.history: list[dict] = []  # per step: version, kind, fetch_s, apply_s, times
        self._announced_at: dict[int, float] = {}  # hinted versions -> when (for timings)
        self._odd_hints: set[int] = set()  # announcements far beyond the board, logged once
        self._wake = asyncio.Event()
        self._beat = asyncio.Event()  # set on every state change: heartbeat now
        self._changed = asyncio.Condition()
        self._tasks: list[asyncio.Task] = []
        self._stopping = False
        self._nc = self._js = self._sub = None
        self._lock = asyncio.Lock()

    # -------------------------------------------------------------- state

    @property
    def version(self) -> int | None:
        """The version the apply target holds now (None: nothing proven)."""
        return self.served.version

    @property
    def latest(self) -> int | None:
        """The newest published version seen."""
        return self.served.latest

    @property
    def refused(self) -> Mapping[int, str]:
        """Refused versions -> why."""
        return self.served.refused

    def recheck(self) -> None:
        """What the target holds changed outside a step (e.g. a failed full check left it
        holding nothing provable): forget our own record, if we keep one, and re-plan now."""
        if self._records_steps:
            self.served.clear()
        self._wake.set()

    @property
    def state(self) -> str:
        return engine_state(self.applying, self.version, self.latest)

    @property
    def lag(self) -> int | None:
        return lag(self.version, self.latest)

    @property
    def nats_connected(self) -> bool | None:
        """None without NATS; else whether the announcement subscription is up."""
        if not self.nats_url:
            return None
        return self._sub is not None and self._nc is not None and self._nc.is_connected

    @property
    def health(self) -> Health:
        """`dead` (the follow loop ended), `degraded` (the last reconcile failed, or NATS is
        configured but down: the board is still polled) or `ok`."""
        if self.dead is not None:
            return "dead"
        if self.last_error is not None or self.nats_connected is False:
            return "degraded"
        return "ok"

    def status(self) -> dict:
        return {"id": self.id, "run": self.run, "version": self.version, "latest": self.latest,
                "state": self.state, "lag": self.lag, "health": self.health,
                "last_error": self.dead or self.last_error, "error_since": self.error_since,
                "nats_connected": self.nats_connected,
                "last_apply_seconds": self.last_apply_seconds,
                "patch_bytes_total": self.patch_bytes_total,
                "trusted_keys": self.trust.ids if self.trust else None,
                "avoiding": sorted(self.avoid),
                "avoiding_spans": [list(sp) for sp in sorted(self.avoid_spans)],
                "refused": self.served.last_refusal()}

    def _refuse(self, version: int, err: RefusedVersionError) -> None:
        """`version` is not accepted by the trust set: recorded and logged once; nothing
        applied."""
        if self.served.refuse(version, str(err)):
            log.error("follower %s: refusing %s v%d: %s; still at v%s", self.id, self.run,
                      version, err, self.version)

    # -------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Start following: the board's reconcile loop at once, NATS (announcements and
        heartbeats) in the background, retried until it is up. Never fails for NATS: the board
        is the truth and is polled either way."""
        loop = asyncio.create_task(self._loop())
        loop.add_done_callback(self._loop_ended)
        self._tasks.append(loop)
        if self.nats_url:
            self._tasks.append(asyncio.create_task(self._nats()))

    async def _nats(self, backoff: float = 1.0, cap: float = 30.0) -> None:
        from stitch_core.versions.announce import subscribe_versions
        from stitch_core.versions.nats_conn import connect
        from stitch_core.versions.streams import ensure_streams

        while not self._stopping:
            try:
                self._nc = await connect(self.nats_url, name=f"stitch-follower-{self.id}")
                self._js = self._nc.jetstream()
                await ensure_streams(self._js, self.run)
                self._sub = await subscribe_versions(self._js, self.run, self._on_announcement)
                break
            except Exception as e:  # unreachable, refused, no JetStream yet: poll meanwhile
                log.warning("follower %s: NATS %s unavailable (%s); polling the board, retrying "
                            "in %.0f s", self.id, self.nats_url, e, backoff)
                if self._nc is not None:
                    with contextlib.suppress(Exception):
                        await self._nc.close()
                self._nc = self._js = self._sub = None
                await asyncio.sleep(backoff)
                backoff = min(cap, backoff * 2)
        if self._stopping:
            return
        log.info("follower %s: following %s announcements on NATS %s", self.id, self.run,
                 self.nats_url)
        self._wake.set()  # something may have been announced while NATS was down
        await self._heartbeats()

    def _loop_ended(self, task: asyncio.Task) -> None:
        if task.cancelled() or self._stopping:
            return  # stop()
        err = task.exception() or RuntimeError("follow loop returned")
        self.dead = f"follow loop ended: {type(err).__name__}: {err}"
        log.error("follower %s: %s; the engine cannot follow any more", self.id, self.dead)
        self._beat.set()
        if self.on_dead is not None:
            self.on_dead(err)

    async def stop(self) -> None:
        self._stopping = True  # the loops check it too: a swallowed cancel ends them anyway
        await cancel_all(self._tasks)
        self._cache_use.close()
        if self._sub is not None:  # before draining, or the ordered consumer tries to recreate
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._sub.unsubscribe(), 5.0)
        if self._nc is not None:  # bounded: a connection stuck reconnecting must not hang stop
            try:
                await asyncio.wait_for(self._nc.drain(), 5.0)
            except Exception:  # noqa: BLE001 - timed out or already broken: just close
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self._nc.close(), 5.0)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.board.close(), 5.0)

    async def __aenter__(self) -> Follower:
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    async def _on_announcement(self, ann: Announcement) -> None:
        """An announcement is a hint, never the truth: it wakes the loop, which reads the
        board's own `latest` (and its manifest) before believing any version. A forged, replayed,
        out-of-order or huge announcement so moves nothing and costs one read of `latest`."""
        if ann.run != self.run:
            return
        known = self.latest if self.latest is not None else -1
        if ann.version > known + HINT_SLACK and ann.version not in self._odd_hints:
            if len(self._odd_hints) < MAX_HINTS:  # logged once each, bounded
                self._odd_hints.add(ann.version)
                log.warning("follower %s: announcement of %s v%d, far beyond the board's v%s: "
                            "ignored unless the board says so", self.id, self.run, ann.version,
                            self.latest)
        elif len(self._announced_at) < MAX_HINTS:
            self._announced_at.setdefault(ann.version, time.perf_counter())
        self._wake.set()

    async def _loop(self) -> None:
        while not self._stopping:
            # cleared before the read, never after it: a hint (or wait_for) that arrives while
            # sync() runs sets it again and is not lost (lost, the loop slept a whole
            # reconcile interval with a newer version announced)
            self._wake.clear()
            try:
                await self.sync()  # woken (a hint) or a timer tick: what the board says
            except Exception as e:  # keep following; the next tick retries
                if not (self.last_error or "").endswith(str(e)):  # keep "vN rejected: ..."
                    self.last_error = str(e)
                if self.error_since is None:
                    self.error_since = time.time()
                if not isinstance(e, RefusedVersionError):  # refusals are logged once (_refuse)
                    log.warning("follower %s: %s", self.id, e)
            else:  # the board was read and everything on it applied: healthy again
                self.last_error = self.error_since = None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.reconcile_interval)

    async def _heartbeats(self) -> None:
        from stitch_core.versions.announce import publish_heartbeat

        while not self._stopping:
            with contextlib.suppress(Exception):
                await publish_heartbeat(self._js, Heartbeat(
                    id=self.id, run=self.run, url=self.url, version=self.version,
                    latest=self.latest, state=self.state, lag=self.lag, region=self.region,
                    health=self.health, error=self.dead or self.last_error,
                    load=self.load() if self.load is not None else None, time=time.time()))
            self._beat.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._beat.wait(), self.heartbeat_interval)

    # -------------------------------------------------------------- catching up

    async def sync(self) -> int | None:
        """Reconcile once: read the board's `latest` and the manifest it points to (a version is
        believed only once its manifest is read back), catch up to it. The version now held."""
        try:
            latest = await read_latest(self.board, self.run, self.trust)
        except RefusedVersionError as e:  # an unsigned or foreign-signed pointer: believe nothing
            self._refuse(e.version, e)
            raise
        if latest is not None and (self.latest is None or latest.version > self.latest):
            try:
                m = await read_manifest(self.board, self.run, latest.version, self.trust)
            except RefusedVersionError as e:
                self._refuse(e.version, e)
                raise
            self.served.accept(m.version)  # a good version replaced a refused one, if any
            self.served.saw_latest(m.version)
        if self.latest is not None and (self.version is None or self.latest > self.version):
            await self.catch_up(self.latest)
        return self.version

    async def catch_up(self, target: int) -> None:
        self.served.saw_latest(target)
        async with self._lock:
            if self.version is not None and self.version >= target:
                return
            now_m = time.monotonic()
            for v in [v for v, t in self.avoid.items() if now_m - t > AVOID_TTL]:
                del self.avoid[v]  # try it again: an operator may have repaired it
                self._failures.pop(v, None)
            for sp in [sp for sp, t in self.avoid_spans.items() if now_m - t > AVOID_TTL]:
                del self.avoid_spans[sp]
            try:
                steps = await plan(self.board, self.run, self.version, target, self.max_chain,
                                   trust=self.trust, avoid=frozenset(self.avoid),
                                   avoid_spans=frozenset(self.avoid_spans))
            except VersionError:
                if not self.avoid:
                    raise
                # no way around the bad patch: try it again (an operator may have repaired it)
                steps = await plan(self.board, self.run, self.version, target, self.max_chain,
                                   trust=self.trust, avoid_spans=frozenset(self.avoid_spans))
            for step in steps:
                t_fetch = time.perf_counter()
                try:
                    step = await self._fetch(step)
                except Exception as e:
                    self._failed(step, e)
                    raise
                path = step.files[0]
                self.applying = True
                self._beat.set()
                t0 = time.perf_counter()
                try:
                    await self._apply(step, path)
                except Exception as e:
                    self.last_error = f"v{step.version} rejected: {e}"
                    log.error("follower %s: %s; still at v%s", self.id, self.last_error,
                              self.version)
                    for p in step.patch_parts:
                        p.unlink(missing_ok=True)  # refetch next time
                    self._failed(step, e)
                    raise
                finally:
                    self.applying = False
                t1 = time.perf_counter()
                self.last_apply_seconds = t1 - t0
                self.history.append({
                    "version": step.version, "kind": step.label, "base": step.base,
                    "bytes": step.bytes, "fetch_s": t0 - t_fetch,
                    "apply_s": t1 - t0, "announced_at": self._announced_at.pop(step.version, None),
                    "current_at": t1})
                self.patch_bytes_total += step.bytes if step.kind == "patch" else 0
                if self._records_steps:
                    self.served.set(step.version)
                elif self.version != step.version:
                    self.last_error = (f"v{step.version}: applied, but the target holds "
                                       f"v{self.version}")
                    raise VersionError(self.last_error)
                self.applied.append(step.version)
                self.last_error = None
                self._beat.set()
                async with self._changed:
                    self._changed.notify_all()
                log.info("follower %s: now at %s v%d (%s from %s, %d bytes)", self.id, self.run,
                         step.version, step.label, step.base, step.bytes)
                await self._prune_cache(step)  # after waiters are told: off the serving path

    async def _prune_cache(self, step: Step) -> None:
        """`step` is applied: hold its version as the current one, prune the cache (a failed
        prune is logged, never an error of the step)."""
        if step.manifest.kind == "snapshot":
            self._keep_from = step.version
        try:
            await asyncio.to_thread(self._cache_use.done, step.version)
            r = await asyncio.to_thread(prune, self.cache, self.run, current=step.version,
                                        keep_from=self._keep_from,
                                        max_bytes=self.cache_max_bytes)
        except Exception as e:  # noqa: BLE001 - a full disk, a foreign file: keep following
            log.warning("follower %s: pruning cache %s failed: %s", self.id, self.cache, e)
            return
        if r.removed:
            log.info("follower %s: cache: removed %d version directories (%d bytes)", self.id,
                     len(r.removed), r.freed)
        if r.over_cap and not self._over_cap_logged:
            log.warning("follower %s: cache %s still holds %d bytes after pruning, over its "
                        "cap of %d: the rest is in use", self.id, self.cache, r.total,
                        r.max_bytes)
        self._over_cap_logged = r.over_cap

    def _failed(self, step: Step, err: BaseException) -> None:
        """Count a failure of `step` that is the object's fault (missing, bytes that do not
        match, a patch the target refuses); at BAD_AFTER the version is routed around."""
        if step.kind != "patch" or not isinstance(err, NotFoundError | VersionError | ValueError):
            return  # an outage, a rank that failed or hung: not the object's fault
        if step.span is not None:  # the chain it squashes is the way around: no second try
            self.avoid_spans[(step.span.base, step.span.version)] = time.monotonic()
            log.warning("follower %s: the span %s v%d->v%d failed (%s); taking the chain",
                        self.id, self.run, step.span.base, step.span.version, err)
            return
        n = self._failures[step.version] = self._failures.get(step.version, 0) + 1
        if n >= BAD_AFTER and step.version not in self.avoid:
            self.avoid[step.version] = time.monotonic()
            log.warning("follower %s: the patch of %s v%d failed %d times (%s); routing around "
                        "it through a later snapshot", self.id, self.run, step.version, n, err)

    async def _fetch(self, step: Step) -> Step:
        await asyncio.to_thread(self._cache_use.begin, step.version)  # in use until applied
        m = step.manifest
        if step.kind == "patch":
            return step.fetched(await fetch_patch(self.board, m, self.cache))
        paths = [await fetch_object(self.board, m, ref, self.cache)
                 for ref in m.objects if ref.role != "patch"]
        return step.fetched([paths[0].parent])

    async def wait_for(self, version: int, timeout: float) -> bool:
        """Wait up to `timeout` s until the held version is >= `version` (waking the loop)."""
        if self.version is not None and self.version >= version:
            return True
        self._wake.set()
        async with self._changed:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait_for(
                    lambda: self.version is not None and self.version >= version), timeout)
        return self.version is not None and self.version >= version

