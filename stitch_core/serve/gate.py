"""VersionGate: engine-agnostic admission control and version accounting for a serving engine.

Size: about 410 lines, one job: admission against the served version (`admit`, `release`,
`applying` with its drain, shared catch-up waits). The tickets in flight and the apply window are
one state that every admit and every apply reads.

What is served, the newest published version and the refused ones are not the gate's: it reads
them from the `stitch_core.versions.served.ServedVersion` it is built with (shared with the
follower, which records what it reads on the board, and the coordinator, which records what the
ranks are proven to hold), and is told of every change (a listener: waiters wake, metrics move).
The coordinator wraps each weight mutation in ``async with gate.applying(target) as h: ...;
h.commit()`` (the `stitch_core.engine.ports.ApplyGate` port). The HTTP side
(stitch_core.serve.asgi) asks the gate to `admit` each request with the version it wants (a
request that may wait asks the `CatchUp` port, `stitch_core.serve.ports`), and `release`s it when
the answer is complete, which yields the versions that may have produced its tokens:

* ``version_start``: the version serving at admission (during an apply, the outgoing one);
* ``version_end``: the version serving at completion, or, when an apply is in progress then, that
  apply's target. ``[start, end]`` is thus a conservative superset of the versions involved.

A request wanting a refused version (e.g. one whose signature is not trusted) gets a 409
``refused`` naming why, at once, instead of waiting for it.

Wrap only the weight mutation in `applying` (not downloads): requests finishing inside it report
the target as their end, and exact pins on the outgoing version are refused meanwhile.

Apply modes: ``immediate`` applies at once; exact-pinned requests in flight are then *violated*
(`violated`) and the HTTP side discards their output. ``drain`` first waits (at most
`drain_timeout` seconds) for exact-pinned requests on the outgoing version to finish, refusing new
ones meanwhile so an apply cannot starve; after the timeout it proceeds as ``immediate``.

All waiting is event-driven. Use the gate from the event loop it serves (a change of the served
version made from another thread only wakes the loop, through ``call_soon_threadsafe``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import threading
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Literal

from stitch_core.errors import StitchError
from stitch_core.serve import protocol
from stitch_core.serve.metrics import Metrics
from stitch_core.serve.ports import CatchUp, StatusSource
from stitch_core.settings import DRAIN_TIMEOUT
from stitch_core.versions.served import Commit, ServedVersion

log = logging.getLogger("stitch.gate")

Mode = Literal["immediate", "drain"]
MODES: tuple[str, ...] = ("immediate", "drain")


class NotReadyError(StitchError, RuntimeError):
    """A request the gate cannot serve: answer HTTP 409 with `body` and ``Retry-After``."""

    def __init__(self, body: dict, retry_after: int):
        super().__init__(body["error"]["message"])
        self.body = body
        self.retry_after = max(1, int(retry_after))

    @property
    def reason(self) -> str | None:
        return self.body["error"].get("reason")


@dataclass(eq=False)
class Ticket:
    """One admitted request. `start` is the version serving at admission."""

    exact: int | None
    minimum: int | None
    start: int | None
    gen: int
    id: int
    admitted: float = field(default_factory=time.monotonic)
    end: int | None = None
    released: bool = False
    moved: bool = False  # the serving version changed while it was in flight


class ApplyHandle(Commit):
    """Yielded by `VersionGate.applying`: call `commit()` once the engine serves `target`."""

    def __init__(self, target: int, outgoing: int | None):
        super().__init__(target)
        self.outgoing = outgoing
        self.drain_seconds = 0.0
        self.drain_timed_out = False


class VersionGate:
    """Admission control and version accounting of one engine serving `run` (see the module doc)."""

    def __init__(self, run: str, *, mode: Mode = "immediate", drain_timeout: float = DRAIN_TIMEOUT,
                 max_wait: float = protocol.DEFAULT_MAX_WAIT, metrics: Metrics | None = None,
                 served: ServedVersion | None = None, catch_up: CatchUp | None = None,
                 status_extra: StatusSource | None = None):
        """`served`: the owner of the served version (None: a new one); `catch_up`: asked by
        requests that may wait for a newer version (None: they wait for it to arrive);
        `status_extra`: more fields for the status page."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.run = run
        self.mode: str = mode
        self.drain_timeout = float(drain_timeout)
        self.max_wait = float(max_wait)
        self.metrics = metrics if metrics is not None else Metrics(run=run, enabled=False)
        if self.metrics.run is None:
            self.metrics.run = run
        self.served = served if served is not None else ServedVersion()
        self.catch_up = catch_up
        self.status_extra = status_extra
        self.last_apply_seconds: float | None = None
        self.last_apply_time: float | None = None  # wall clock of the last commit
        self.applies = 0
        self.drain_timeouts = 0
        self.not_ready_count = 0
        self._pending: int | None = None  # target of an apply entered (draining or mutating)
        self._mutating: int | None = None  # target of an apply past its drain
        self._draining = False
        self._lock = asyncio.Lock()
        self._changed = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self._ids = itertools.count(1)
        self._in_flight: set[Ticket] = set()
        self._pinned: dict[int, int] = {}  # exact version -> in-flight pinned requests
        self._catchup_task: asyncio.Task | None = None
        self._catchup_target: int | None = None
        self.served.listen(self._served_changed)

    # ----- state (the served version's, read from its owner) -----

    @property
    def version(self) -> int | None:
        return self.served.version

    @property
    def latest(self) -> int | None:
        return self.served.latest

    @property
    def refused(self) -> Mapping[int, str]:
        return self.served.refused

    @property
    def state(self) -> str:
        return protocol.engine_state(self._pending is not None, self.version, self.latest)

    @property
    def lag(self) -> int | None:
        return protocol.lag(self.version, self.latest)

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    def status(self) -> dict:
        out = {
            "run": self.run, "version": self.version, "latest": self.latest, "lag": self.lag,
            "state": self.state, "mode": self.mode, "applying_to": self._pending,
            "draining": self._draining, "in_flight": len(self._in_flight),
            "pinned_in_flight": sum(self._pinned.values()), "applies": self.applies,
            "last_apply_seconds": self.last_apply_seconds,
            "last_apply_time": self.last_apply_time, "not_ready_total": self.not_ready_count,
        }
        if self.status_extra is not None:
            try:
                out.update(self.status_extra())
            except Exception as e:  # a status page must not fail on an engine hook
                log.warning("status_extra failed: %s", e)
                out["status_extra_error"] = repr(e)
        return out

    def current_end(self) -> int | None:
        """The version_end a request completing now would report."""
        return self._mutating if self._mutating is not None else self.version

    # ----- engine side -----

    def _served_changed(self) -> None:
        self.metrics.set_version(self.version, self.latest)
        self._wake()

    def set_version(self, v: int) -> None:
        """Shorthand for ``served.set(v)`` (tests; a coordinator records in `served` itself)."""
        self.served.set(v)

    def set_latest(self, v: int) -> None:
        """Shorthand for ``served.saw_latest(v)``."""
        self.served.saw_latest(v)

    async def wait_version(self) -> int:
        """Wait (event-driven) until the engine holds a verified version; return it."""
        self._bind_loop()
        while self.version is None:
            await self._changed.wait()
        return self.version

    @contextlib.asynccontextmanager
    async def applying(self, target: int) -> AsyncIterator[ApplyHandle]:
        """``async with gate.applying(target) as h: <mutate weights>; h.commit()``.

        One apply at a time. Drain mode first waits (bounded) for exact-pinned requests on the
        outgoing version. On exit the served version becomes `target` iff `h.commit()` was
        called.
        """
        target = int(target)
        self._bind_loop()
        async with self._lock:
            h = ApplyHandle(target, self.version)
            self._pending = target
            self.served.saw_latest(target)  # it is published, since it is being applied
            self._wake()
            t0 = time.monotonic()
            t1: float | None = None
            try:
                if self.mode == "drain" and self.version is not None:
                    self._draining = True
                    try:
                        h.drain_timed_out = not await self._drain(self.version)
                    finally:
                        self._draining = False
                    h.drain_seconds = time.monotonic() - t0
                self._mutating = target
                self._wake()
                t1 = time.monotonic()
                yield h
            finally:
                seconds = time.monotonic() - (t1 if t1 is not None else t0)
                self._pending = self._mutating = None
                if h.committed:
                    self.applies += 1
                    self.last_apply_seconds = seconds
                    self.last_apply_time = time.time()
                    self.metrics.applied(target, seconds, h.patch_bytes)
                    self.served.set(target)  # its listener: metrics.set_version, wake
                self._wake()

    async def _drain(self, outgoing: int) -> bool:
        """Wait until no exact-pinned request on `outgoing` is in flight; False on timeout."""
        deadline = time.monotonic() + self.drain_timeout
        while self._pinned.get(outgoing, 0) > 0:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.drain_timeouts += 1
                log.warning("drain of version %s timed out after %.1fs with %d pinned request(s) "
                            "in flight; applying anyway", outgoing, self.drain_timeout,
                            self._pinned.get(outgoing, 0))
                return False
            ev = self._changed
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(ev.wait(), remaining)
        return True

    # ----- request side -----

    def _refuse(self, reason: protocol.Reason, wanted: int | None,
                retry_after: int | None = None) -> NotReadyError:
        message = None
        if reason == "refused" and wanted in self.refused:
            said = protocol.describe(reason, serving=self.version, wanted=wanted,
                                     latest=self.latest)
            message = f"{said}: {self.refused[wanted]}"
        body = protocol.not_ready_body(run=self.run, serving=self.version, wanted=wanted,
                                       latest=self.latest, reason=reason, message=message)
        if retry_after is None:
            retry_after = 1
            if reason == "behind" and self.last_apply_seconds:
                retry_after = min(30, math.ceil(self.last_apply_seconds))
        self.not_ready_count += 1
        self.metrics.not_ready()
        return NotReadyError(body, retry_after)

    def _check(self, exact: int | None, minimum: int | None
               ) -> tuple[Literal["ok", "wait", "refuse"], protocol.Reason | None]:
        v = self.version
        wanted = exact if exact is not None else minimum
        if wanted is not None and wanted in self.refused and (v is None or wanted > v):
            return "refuse", "refused"
        if v is None:
            return "wait", "not_ready"
        if exact is not None:
            if exact < v:
                return "refuse", "passed"
            if exact > v:
                return "wait", "behind"
            if self._pending is not None:  # pinned on the outgoing version of an apply
                return "refuse", ("draining" if self.mode == "drain" else "applying")
            return "ok", None
        if minimum is not None and minimum > v:
            return "wait", "behind"
        return "ok", None

    async def admit(self, exact: int | None = None, minimum: int | None = None,
                    wait: float = 0.0) -> Ticket:
        """Admit a request wanting exactly `exact`, or `minimum` or newer, or (neither) any
        version; wait up to `wait` seconds for the engine to get there (asking `catch_up`).

        Raises NotReadyError (count it as a 409) when it cannot be served.
        """
        if exact is not None and minimum is not None:
            raise ValueError("give exact or minimum, not both")
        self._bind_loop()
        wanted = exact if exact is not None else minimum
        wait = min(max(0.0, float(wait)), self.max_wait)
        deadline = time.monotonic() + wait
        asked = False
        while True:
            verdict, reason = self._check(exact, minimum)
            if verdict == "ok":
                return self._ticket(exact, minimum)
            remaining = deadline - time.monotonic()
            if verdict == "refuse" or remaining <= 0:
                assert reason is not None
                raise self._refuse(reason, wanted)
            ev = self._changed
            waiters: set[asyncio.Future] = {asyncio.ensure_future(ev.wait())}
            if wanted is not None and self.catch_up is not None:
                task = self._catchup_task
                if task is None or task.done():
                    task = None
                    if not asked:  # no catch-up running: ask once for ours
                        task = self._start_catchup(wanted, remaining)
                        asked = True
                if task is not None:  # a running one (ours or another request's): wake on its end
                    waiters.add(task)
            try:
                await asyncio.wait(waiters, timeout=remaining,
                                   return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waiters:
                    if w is not self._catchup_task:
                        w.cancel()

    def _start_catchup(self, wanted: int, timeout: float) -> asyncio.Task:
        """Run ``catch_up(wanted, timeout)`` as a task shared by waiters (one at a time)."""
        assert self.catch_up is not None
        catch_up = self.catch_up

        async def run() -> bool:
            try:
                return bool(await catch_up(wanted, timeout))
            except Exception as e:
                log.warning("catch_up(%s) failed: %s", wanted, e)
                return False
            finally:
                self._wake()

        self._catchup_task = asyncio.ensure_future(run())
        self._catchup_target = wanted
        return self._catchup_task

    def _ticket(self, exact: int | None, minimum: int | None) -> Ticket:
        t = Ticket(exact=exact, minimum=minimum, start=self.version, gen=self.served.gen,
                   id=next(self._ids))
        self._in_flight.add(t)
        if exact is not None:
            self._pinned[exact] = self._pinned.get(exact, 0) + 1
        return t

    def release(self, ticket: Ticket) -> tuple[int | None, int | None]:
        """The request is complete: (version_start, version_end). Idempotent."""
        if not ticket.released:
            ticket.released = True
            ticket.end = self.current_end()
            ticket.moved = ticket.gen != self.served.gen
            self._in_flight.discard(ticket)
            if ticket.exact is not None:
                n = self._pinned.get(ticket.exact, 0) - 1
                if n > 0:
                    self._pinned[ticket.exact] = n
                else:
                    self._pinned.pop(ticket.exact, None)
                self._wake()
        return ticket.start, ticket.end

    def violated(self, ticket: Ticket) -> bool:
        """An exact-pinned request whose tokens may come from another version."""
        if ticket.exact is None:
            return False
        if ticket.released:
            return ticket.moved or ticket.end != ticket.exact or ticket.start != ticket.exact
        return ticket.gen != self.served.gen or self._mutating is not None

    def version_changed(self, ticket: Ticket) -> NotReadyError:
        """The 409 for a violated exact-pinned request (reason ``version_changed``); counted."""
        return self._refuse("version_changed", ticket.exact)

    # ----- wake-ups -----

    def _bind_loop(self) -> None:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self._loop_thread = threading.get_ident()

    def _wake(self) -> None:
        loop = self._loop
        if loop is not None and threading.get_ident() != self._loop_thread:
            if not loop.is_closed():
                loop.call_soon_threadsafe(self._wake)
            return
        ev, self._changed = self._changed, asyncio.Event()
        ev.set()
