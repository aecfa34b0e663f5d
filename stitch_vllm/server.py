"""The API-server side of the vLLM plugin: `--middleware stitch_vllm.server.StitchMiddleware`.

At application start-up the middleware starts an `EngineFollower` in the API server process:

* a `stitch_core.coordinator.Coordinator` whose RPC reaches `StitchWorkerExtension.stitch_call` on
  every TP rank through vLLM's `collective_rpc`; it learns the layouts, proves the loaded weights
  against the snapshot's manifest (`stitch-manifest.json`, written by `stitch pull`) and then
  applies every version: decode once here, gather/write on the ranks with engine steps held
  (`pause_generation(mode="keep")`), reset the prefix cache after each apply;
* a `stitch_core.follower.Follower` (NATS announcements + a reconcile timer on the board) feeding
  it versions in order;
* a `stitch_core.gate.VersionGate` that the middleware (`stitch_core.asgi.StitchASGI`) consults for
  the version protocol: `X-Stitch-Version`, `X-Stitch-Min-Version`, `X-Stitch-Wait`, 409
  `stitch_version_not_ready`, `X-Stitch-Version-Start/End`, the `"stitch"` body field,
  `GET /stitch/status`, Prometheus metrics on vLLM's `/metrics`.

Configuration is the environment (`Settings`): STITCH_BOARD, STITCH_RUN, STITCH_NATS_URL, ...
Requests get 409 until the engine holds a verified version; it never serves silently.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pickle
import tempfile
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel

from stitch_core.asgi import StitchASGI, send_json

log = logging.getLogger("stitch.vllm")

__all__ = ["Settings", "EngineFollower", "StitchMiddleware", "current"]


class Settings(BaseModel):
    """Environment configuration (STITCH_<FIELD> upper-cased)."""

    board: str | None = None  # board URL or directory; unset: serve the loaded version only
    run: str | None = None  # default: the run of the snapshot's manifest
    nats_url: str | None = None  # announcements (optional: the board is polled anyway)
    cache_dir: str = str(Path(tempfile.gettempdir()) / "stitch-cache")
    apply_mode: Literal["immediate", "drain"] = "immediate"
    drain_timeout: float = 30.0
    max_wait: float = 600.0
    reconcile_interval: float = 5.0
    pause_steps: bool = True  # hold engine steps while ranks write (verified before resuming)
    verify_interval: float = 0.0  # seconds between full fingerprint checks (0: start-up only)
    engine_id: str | None = None
    engine_url: str | None = None  # advertised in heartbeats
    region: str | None = None

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Settings:
        env = dict(os.environ if env is None else env)
        vals: dict[str, Any] = {}
        for name in cls.model_fields:
            key = f"STITCH_{name.upper()}"
            if key in env and env[key] != "":
                vals[name] = env[key]
        return cls.model_validate(vals)


class EngineFollower:
    """Coordinator + Follower + VersionGate for one vLLM engine (one API server process)."""

    def __init__(self, engine_client: Any, settings: Settings, model_dir: str | None = None):
        self.engine = engine_client
        self.settings = settings
        self.model_dir = model_dir or engine_client.model_config.model
        self.gate: Any = None
        self.coord: Any = None
        self.follower: Any = None
        self.error: str | None = None
        self._tasks: list[asyncio.Task] = []

    async def _rpc(self, method: str, payload: dict[str, Any]) -> list[dict[str, Any]]:
        blob = pickle.dumps(payload)
        replies = await self.engine.collective_rpc("stitch_call", args=(method, blob))
        return [pickle.loads(r) for r in replies]

    async def _pause(self) -> None:
        await self.engine.pause_generation(mode="keep", clear_cache=False)

    async def _resume(self) -> None:
        await self.engine.resume_generation()

    async def _reset_cache(self) -> None:
        # requests are salted per version (StitchASGI), so this only frees stale blocks; it is
        # refused while requests run, which is fine
        await self.engine.reset_prefix_cache()

    async def start(self) -> None:
        """Create the gate at once (requests get 409 meanwhile), then prove and follow."""
        from stitch_core.coordinator import read_pulled_manifest
        from stitch_core.gate import VersionGate
        from stitch_core.metrics import Metrics, default_registry

        s = self.settings
        m = read_pulled_manifest(self.model_dir)
        run = s.run or (m.run if m is not None else None)
        if run is None:
            raise ValueError("STITCH_RUN is not set and the model directory has no "
                             "stitch-manifest.json (start from `stitch pull` output)")
        self.gate = VersionGate(run, mode=s.apply_mode, drain_timeout=s.drain_timeout,
                                max_wait=s.max_wait, metrics=Metrics(default_registry(), run=run))
        self.gate.status_extra = self.status_extra
        self._tasks.append(asyncio.create_task(self._run(run)))

    async def _run(self, run: str) -> None:
        from stitch_core.coordinator import Coordinator, EngineStateError
        from stitch_core.follower import Follower

        s = self.settings
        try:
            self.coord = Coordinator(
                self._rpc, run=run, gate=self.gate,
                pause=self._pause if s.pause_steps else None,
                resume=self._resume if s.pause_steps else None, after_apply=self._reset_cache)
            version = await self.coord.start(self.model_dir)
        except Exception as e:
            self.error = f"start-up check failed: {e}"
            log.exception("stitch: %s; not serving", self.error)
            return
        if s.board is None:
            log.warning("stitch: STITCH_BOARD is not set; serving %s v%s without following", run,
                        version)
            return

        async def apply(step, path):
            try:
                await self.coord(step, path)
            except EngineStateError:
                check = await self.coord.verify()
                if not check["ok"]:
                    self.follower.version = None  # reload from a snapshot on the next round
                raise

        self.follower = Follower(
            s.board, run, apply, version=version, nats=s.nats_url, cache_dir=s.cache_dir,
            reconcile_interval=s.reconcile_interval, engine_id=s.engine_id, url=s.engine_url,
            region=s.region, on_latest=self.gate.set_latest)
        self.gate.catch_up = self.follower.wait_for
        await self.follower.start()
        if s.verify_interval > 0:
            self._tasks.append(asyncio.create_task(self._verify_every(s.verify_interval)))

    async def _verify_every(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            with contextlib.suppress(Exception):
                check = await self.coord.verify()
                if not check["ok"] and self.follower is not None:
                    self.follower.version = None
                    self.follower._wake.set()

    def status_extra(self) -> dict[str, Any]:
        out: dict[str, Any] = {"engine": "vllm", "model_dir": str(self.model_dir)}
        if self.coord is not None:
            out.update(self.coord.status())
        if self.follower is not None:
            out["follower"] = {"id": self.follower.id, "last_error": self.follower.last_error,
                               "latest": self.follower.latest}
        if self.error:
            out["error"] = self.error
        return out

    async def verify(self) -> dict[str, Any]:
        if self.coord is None:
            return {"ok": None, "error": self.error or "starting"}
        return await self.coord.verify()

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        if self.follower is not None:
            with contextlib.suppress(Exception):
                await self.follower.stop()


_CURRENT: EngineFollower | None = None


def current() -> EngineFollower | None:
    """The engine follower of this API server process (None before start-up)."""
    return _CURRENT


class StitchMiddleware(StitchASGI):
    """vLLM `--middleware`: the version protocol, plus the follower's start and stop."""

    def __init__(self, app: Any):
        super().__init__(app, lambda: _CURRENT.gate if _CURRENT is not None else None)

    async def lifespan(self, scope, receive, send) -> None:
        async def recv():
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                await self._startup(scope.get("app"))
            elif msg["type"] == "lifespan.shutdown":
                await self._shutdown()
            return msg

        await self.app(scope, recv, send)

    async def _startup(self, app: Any) -> None:
        global _CURRENT
        engine = getattr(getattr(app, "state", None), "engine_client", None)
        if engine is None:
            log.error("stitch: no engine client on the app; the middleware is inactive")
            return
        try:
            ef = EngineFollower(engine, Settings.from_env())
            await ef.start()
            _CURRENT = ef
        except Exception:
            log.exception("stitch: could not start the follower; requests get 409")

    async def _shutdown(self) -> None:
        global _CURRENT
        if _CURRENT is not None:
            await _CURRENT.stop()
            _CURRENT = None

    async def http(self, scope, receive, send) -> None:
        if scope.get("path") == "/stitch/verify" and scope.get("method") == "POST":
            ef = _CURRENT
            check = await ef.verify() if ef is not None else {"ok": None, "error": "not started"}
            await send_json(send, 200 if check.get("ok") else 503, check)
            return
        await super().http(scope, receive, send)
