"""Following a run inside an engine's server process, for any engine.

Size: about 470 lines, one job: an engine's server following a run, as the engine plugins
see it: `EngineFollower` (gate, coordinator and follower wired together) and
`FollowerMiddleware` (the ASGI side that starts and owns it: its routes, guards and lifespan).
Both are the plugins' import path (pinned in tests/test_architecture.py), and the middleware's
routes are the follower's own.

`EngineFollower` ties together, for one engine, each built with its collaborators:

* a `stitch_core.serve.gate.VersionGate`, consulted by `FollowerMiddleware` (a
  `stitch_core.serve.asgi.StitchASGI`) for the version protocol ([docs/protocol.md]); built
  first (requests get 409 while the engine starts), with `catch_up` and `status_extra` below as
  its ports and a `stitch_core.versions.served.ServedVersion` (what is served, the newest
  published version, the refused ones) that the other two share;
* a `stitch_core.engine.coordinator.Coordinator` whose RPC reaches a
  `stitch_core.engine.replica.RankReplica` on every TP rank; it learns the layouts, proves the
  loaded weights against the snapshot's manifest (`stitch-manifest.json`, written by `stitch
  pull`) and then applies every version through the gate, recording what the ranks hold;
* a `stitch_core.versions.follower.Follower` (NATS announcements + a reconcile timer on the board)
  feeding the coordinator versions in order, recording what it reads on the board.

An engine plugin (stitch_vllm, stitch_sglang) subclasses both: how to reach the ranks, how to hold
engine steps, what to tell the engine after an apply, and where its engine handle lives.
Configuration is the environment (`Settings`, defined in `stitch_core.settings` with every other
STITCH_* variable, re-exported here). Requests get 409 until the engine holds a proven
version; it never serves silently.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import hashlib
import json
import logging
import math
import secrets
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stitch_core.engine import rpc
from stitch_core.failpoints import enabled as failpoints_enabled
from stitch_core.serve import protocol
from stitch_core.serve.asgi import StitchASGI
from stitch_core.serve.asgi_types import ASGIApp, Scope, send_json
from stitch_core.serve.route_table import Route
from stitch_core.settings import Settings, SettingsError

if TYPE_CHECKING:
    from stitch_core.engine.coordinator import Coordinator
    from stitch_core.serve.gate import VersionGate
    from stitch_core.versions.follower import Follower

log = logging.getLogger("stitch.engine")

__all__ = ["Settings", "SettingsError", "EngineFollower", "FollowerMiddleware", "current"]


class EngineFollower:
    """Coordinator + Follower + VersionGate for one engine (one API server process).

    An engine adapter subclasses it and implements `rpc` (reach `RankReplica.dispatch` on every
    TP rank; one reply per rank), and optionally `pause`/`resume` (hold engine steps) and
    `after_apply(version)` (runs while steps are held: reset caches, set the engine's version).
    """

    engine_name = "engine"

    def __init__(self, settings: Settings, model_dir: str | Path):
        self.settings = settings
        self.model_dir = str(model_dir)
        self.gate: VersionGate | None = None  # built by `start`
        self.coord: Coordinator | None = None
        self.follower: Follower | None = None
        self.error: str | None = None
        self._tasks: list[asyncio.Task] = []

    async def rpc(self, req: rpc.Request) -> list[rpc.Reply]:
        """Send `req` to `RankReplica.handle` on every rank; the replies in rank order."""
        raise NotImplementedError

    async def pause(self) -> None:
        """Hold engine steps (requests in flight stay, frozen)."""

    async def resume(self) -> None:
        """Release what `pause` held."""

    async def after_apply(self, version: int) -> None:
        """The engine now holds `version` (steps still held)."""

    async def start(self) -> None:
        """Create the gate at once (requests get 409 meanwhile), then prove and follow."""
        from stitch_core.engine.proof import read_pulled_manifest
        from stitch_core.serve.gate import VersionGate
        from stitch_core.serve.metrics import Metrics, default_registry

        s = self.settings
        m = read_pulled_manifest(self.model_dir)
        run = s.run or (m.run if m is not None else None)
        if run is None:
            raise SettingsError("STITCH_RUN is not set and the model directory has no "
                             "stitch-manifest.json (start from `stitch pull` output)")
        self.gate = VersionGate(run, mode=s.apply_mode, drain_timeout=s.drain_timeout,
                                max_wait=s.max_wait, metrics=Metrics(default_registry(), run=run),
                                catch_up=self.catch_up, status_extra=self.status_extra)
        self._tasks.append(asyncio.create_task(self._run(run, self.gate)))

    async def catch_up(self, version: int, timeout: float) -> bool:
        """The gate's catch-up port: the follower gets to `version` within `timeout` seconds
        if it can (False while there is no follower yet, or none at all)."""
        f = self.follower
        return await f.wait_for(version, timeout) if f is not None else False

    async def _run(self, run: str, gate: VersionGate) -> None:
        from stitch_core.engine.coordinator import Coordinator
        from stitch_core.versions.follower import Follower
        from stitch_core.versions.trust import TrustSet

        s = self.settings
        try:
            trust = TrustSet.parse(s.trust)
            if not trust:
                log.warning("stitch: STITCH_TRUST is not set: this engine trusts the board (any "
                            "version written to %s is applied unsigned); see docs/security.md",
                            s.board or self.model_dir)
            else:
                log.info("stitch: accepting only versions of %s signed by key(s) %s", run,
                         ", ".join(trust.ids))
            self.coord = coord = Coordinator(
                self.rpc, run=run, gate=gate,
                pause=self.pause if s.pause_steps else None,
                resume=self.resume if s.pause_steps else None, after_apply=self.after_apply,
                loader_fallback=s.loader_fallback, rpc_timeout=s.rpc_timeout,
                load_timeout=s.load_timeout, apply_memory=s.apply_memory,
                stage_memory=s.stage_memory,
                decode_threads=s.decode_threads)
            version = await coord.start(self.model_dir, trust=trust or None)
        except Exception as e:
            self.error = f"start-up check failed: {e}"
            log.exception("stitch: %s; not serving", self.error)
            return
        if s.board is None:
            log.warning("stitch: STITCH_BOARD is not set; serving %s v%s without following", run,
                        version)
            return

        # the coordinator is the apply target: a failed apply is undone and proven there, or
        # leaves the served version cleared (the follower, which reads it from the same
        # ServedVersion, then reloads a snapshot through the verified path)
        try:
            self.follower = Follower(
                s.board, run, coord, served=gate.served, nats=s.nats_url,
                cache_dir=s.cache_dir, cache_max_bytes=s.cache_max_bytes,
                reconcile_interval=s.reconcile_interval,
                engine_id=s.engine_id, url=s.engine_url, region=s.region,
                on_dead=self._follower_died, trust=trust or None, load=lambda: gate.in_flight)
            await self.follower.start()
        except Exception as e:  # e.g. a malformed board URL: not following means not serving
            self.error = f"cannot follow {run}: {type(e).__name__}: {e}"
            coord.stop_serving(self.error)
            return
        if s.verify_interval > 0:
            self._tasks.append(asyncio.create_task(self._verify_every(s.verify_interval)))
        self._tasks.append(asyncio.create_task(self._report_health()))

    async def _report_health(self, interval: float = 1.0) -> None:
        """Health into the metrics (stitch_follower_health, stitch_serving, ...) every second."""
        while True:
            f, gate = self.follower, self.gate
            if f is not None and gate is not None:
                with contextlib.suppress(Exception):
                    gate.metrics.set_health(f.health, gate.version is not None,
                                            f.nats_connected)
            await asyncio.sleep(interval)

    def _follower_died(self, err: BaseException) -> None:
        """The follow loop ended: an engine that no longer follows its run stops serving."""
        self.error = f"follower died: {type(err).__name__}: {err}"
        if self.coord is not None:
            self.coord.stop_serving(self.error)

    async def _verify_every(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            with contextlib.suppress(Exception):
                check = await self.verify()
                if not check["ok"] and self.follower is not None:
                    self.follower.recheck()

    def status_extra(self) -> dict[str, Any]:
        out: dict[str, Any] = {"engine": self.engine_name, "model_dir": self.model_dir}
        if self.coord is not None:
            out.update(self.coord.status())
        if self.follower is not None:
            f = self.follower.status()
            out["follower"] = {k: f[k] for k in ("id", "health", "last_error", "error_since",
                                                 "nats_connected", "latest", "trusted_keys",
                                                 "refused")}
        if self.error:
            out["error"] = self.error
        return out

    async def verify(self) -> dict[str, Any]:
        if self.coord is None:
            return {"ok": None, "error": self.error or "starting"}
        return await self.coord.verify()

    async def stop(self) -> None:
        from stitch_core.versions.tasks import cancel_all

        await cancel_all(self._tasks)
        if self.follower is not None:
            with contextlib.suppress(Exception):
                await self.follower.stop()


VERIFY_PATH = "/stitch/verify"
ARM_PATH = "/stitch/debug/arm"  # only with STITCH_FAILPOINTS=1 (tests, chaos drills)
ARM_BODY_MAX = 4096
UNAUTHORIZED = {"error": "Unauthorized"}  # the 401 body of vLLM's and SGLang's key checks

Check = Callable[[Scope], bool]
Guard = Callable[[ASGIApp], ASGIApp]


def _authorization(scope: Scope) -> str:
    for k, v in scope.get("headers", []):
        if k.lower() == b"authorization":
            return v.decode("latin-1")
    return ""


def bearer_check(keys: Iterable[str | None]) -> Check | None:
    """A check of ``Authorization: Bearer <key>`` against `keys` (constant time, as the engines
    compare); None when no key is configured (open)."""
    digests = [hashlib.sha256(k.encode()).digest() for k in keys if k]
    if not digests:
        return None

    def check(scope: Scope) -> bool:
        scheme, _, token = _authorization(scope).partition(" ")
        if scheme.lower() != "bearer":
            return False
        got = hashlib.sha256(token.encode("latin-1", "replace")).digest()
        ok = False
        for d in digests:
            ok |= secrets.compare_digest(got, d)
        return ok

    return check


async def unauthorized(scope: Scope, send: Any) -> None:
    """The engines' own 401 (a WebSocket handshake: closed, policy violation)."""
    if scope.get("type") == "websocket":
        await send({"type": "websocket.close", "code": 1008, "reason": "Unauthorized"})
        return
    await send_json(send, 401, UNAUTHORIZED, [(b"www-authenticate", b"Bearer")])


def check_guard(check: Check) -> Guard:
    """A guard (`StitchASGI.set_guard`) answering 401 where `check` fails."""
    def guard(inner: ASGIApp) -> ASGIApp:
        async def guarded(scope: Scope, receive: Any, send: Any) -> None:
            if check(scope):
                await inner(scope, receive, send)
            else:
                await unauthorized(scope, send)
        return guarded
    return guard


def instance_guard(auth: Any) -> Guard:
    """A guard that is the engine's own authentication middleware: a shallow copy of the
    instance in the engine's stack, with Stitch's handler as its inner app (the engine's rules,
    its 401s)."""
    def guard(inner: ASGIApp) -> ASGIApp:
        c = copy.copy(auth)
        c.app = inner
        return c
    return guard


class FollowerMiddleware(StitchASGI):
    """The version protocol, plus the engine follower's start (ASGI lifespan) and stop.

    Subclasses implement `make_follower(app)`; one follower per process (`current()`). Adds
    `POST /stitch/verify` (recompute every rank's fingerprints now): it takes the engine's API key
    when one is configured (401 without), runs one at a time (429 while one runs) and at most once
    every `verify_cooldown` seconds, or the last verify's duration if longer, after the previous
    one ended (429 with Retry-After). With STITCH_FAILPOINTS=1 (tests, chaos drills) it also adds
    `POST /stitch/debug/arm` (`arm`).

    At start-up (`configure`) subclasses may replace the routes under version control with those
    found in the engine's route table (`discover_routes`) and put the engine's authentication in
    front of admission (`setup_auth`: `set_guard`, `control_check`).
    """

    def __init__(self, app: Any, **kw: Any):
        # every setting parsed here, when the server builds its middleware: a bad value refuses
        # the start-up (SettingsError names it) instead of surfacing later
        self.settings = Settings.from_env()
        kw.setdefault("max_body", self.settings.max_body_bytes)
        super().__init__(app, _current_gate, **kw)
        self.verify_cooldown = self.settings.verify_cooldown
        self.control_check: Check | None = None  # None: /stitch/verify is open
        self._verifying = False
        self._verify_after = 0.0  # monotonic time the next verify may start
        self._verify_took = 0.0
        self.failpoints = failpoints_enabled()  # POST /stitch/debug/arm exists

    def make_follower(self, app: Any) -> EngineFollower | None:
        raise NotImplementedError

    def discover_routes(self, app: Any) -> list[Route] | None:
        """The version-controlled routes of the engine's `app` (None: keep those configured)."""
        return None

    def setup_auth(self, app: Any) -> None:
        """Set `control_check` and the admission guard from the engine's configured API keys."""

    def below(self, match: Callable[[Any], bool]) -> Any | None:
        """The first middleware below this one (following `.app`) that `match`es, if any."""
        node: Any = self.app
        for _ in range(64):
            if node is None:
                return None
            if match(node):
                return node
            node = getattr(node, "app", None)
        return None

    def configure(self, app: Any) -> None:
        """Routes and authentication from the engine's app (each failure logged; an unreadable
        key configuration refuses /stitch/verify)."""
        try:
            found = self.discover_routes(app)
            if found:
                self.set_routes(found)
                log.info("stitch: version control on %s", ", ".join(
                    f"{'/'.join(sorted(r.methods))} {r.path}" for r in self.routes))
        except Exception:
            log.exception("stitch: cannot classify the engine's routes; keeping %s",
                          sorted(self.paths))
        try:
            self.setup_auth(app)
        except Exception:
            log.exception("stitch: cannot read the engine's API keys; %s is refused",
                          VERIFY_PATH)
            self.control_check = lambda scope: False

    async def lifespan(self, scope, receive, send) -> None:
        async def recv():
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                await self.startup(scope.get("app"))
            elif msg["type"] == "lifespan.shutdown":
                await self.shutdown()
            return msg

        await self.app(scope, recv, send)

    async def startup(self, app: Any) -> None:
        global _CURRENT, _REFUSING
        self.configure(app)
        if _CURRENT is not None:
            return
        try:
            ef = self.make_follower(app)
            if ef is None:
                raise RuntimeError("no engine handle on the app")
            await ef.start()
            _CURRENT = ef
        except Exception:
            # never serve unproven weights silently: every gated request gets 409 not_ready
            from stitch_core.serve.gate import VersionGate

            _REFUSING = VersionGate(_run_or_unknown())
            log.exception("stitch: could not start the follower; requests get 409")

    async def shutdown(self) -> None:
        global _CURRENT, _REFUSING
        _REFUSING = None
        if _CURRENT is not None:
            await _CURRENT.stop()
            _CURRENT = None

    async def http(self, scope, receive, send) -> None:
        if scope.get("path") == VERIFY_PATH and scope.get("method") == "POST":
            await self.verify(scope, send)
            return
        if self.failpoints and scope.get("path") == ARM_PATH and scope.get("method") == "POST":
            await self.arm(scope, receive, send)
            return
        await super().http(scope, receive, send)

    async def arm(self, scope: Scope, receive: Any, send: Any) -> None:
        """`POST /stitch/debug/arm`, only when the server runs with STITCH_FAILPOINTS=1 (else the
        path is the engine's: 404): arm a failpoint on the engine's ranks
        (`stitch_core.engine.failpoints`; the JSON body holds the fields of `rpc.Arm`). Takes the
        key /stitch/verify takes. 200 with what each rank has armed."""
        if self.control_check is not None and not self.control_check(scope):
            await unauthorized(scope, send)
            return
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if len(body) > ARM_BODY_MAX or not msg.get("more_body", False):
                break
        try:
            req = rpc.Arm(**json.loads(body or b"{}"))
        except (ValueError, TypeError) as e:
            await send_json(send, 400, {"error": f"not a failpoint: {e}"})
            return
        ef = _CURRENT
        if ef is None:
            await send_json(send, 503, {"error": "the engine follower is not running"})
            return
        try:
            replies = await asyncio.wait_for(ef.rpc(req), 120)
        except Exception as e:  # noqa: BLE001 - e.g. a rank without STITCH_FAILPOINTS=1
            await send_json(send, 409, {"error": f"{type(e).__name__}: {e}"})
            return
        await send_json(send, 200, {"ranks": [{"rank": r.rank, "armed": r.armed}
                                              for r in replies]})

    async def verify(self, scope: Scope, send: Any) -> None:
        """`POST /stitch/verify`: key, one at a time, rate-limited (class doc)."""
        if self.control_check is not None and not self.control_check(scope):
            await unauthorized(scope, send)
            return
        wait = self._verify_after - time.monotonic()
        if self._verifying or wait > 0:
            busy = self._verifying
            wait = max(self._verify_took, self.verify_cooldown) if busy else wait
            await send_json(send, 429, protocol.error_body(
                "stitch_busy" if busy else "stitch_rate_limited",
                "a verify is running (one at a time)" if busy else
                f"at most one verify every {self.verify_cooldown:g} s (or its duration)"),
                [(b"retry-after", str(max(1, math.ceil(wait))).encode())])
            return
        self._verifying = True
        t0 = time.monotonic()
        try:
            ef = _CURRENT
            check = await ef.verify() if ef is not None else {"ok": None, "error": "not started"}
        finally:
            self._verifying = False
            self._verify_took = time.monotonic() - t0
            self._verify_after = time.monotonic() + max(self.verify_cooldown, self._verify_took)
        await send_json(send, 200 if check.get("ok") else 503, check)


def _run_or_unknown() -> str:
    try:
        return Settings.read("run") or "unknown"
    except SettingsError:
        return "unknown"


_CURRENT: EngineFollower | None = None
_REFUSING: VersionGate | None = None  # a gate holding no version, when the follower could not start


def _current_gate() -> VersionGate | None:
    return _CURRENT.gate if _CURRENT is not None else _REFUSING


def current() -> EngineFollower | None:
    """The engine follower of this process (None before start-up)."""
    return _CURRENT
