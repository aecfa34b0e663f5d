"""The API-server side of the vLLM plugin: `--middleware stitch_vllm.server.StitchMiddleware`.

At application start-up the middleware starts a `VllmFollower` (a `stitch_core.node.
EngineFollower`) in the API server process: its RPC reaches `StitchWorkerExtension.stitch_call` on
every TP rank through vLLM's `collective_rpc`; engine steps are held during writes with
`pause_generation(mode="keep")`; the prefix cache is reset after each apply (requests are also
salted per version by the middleware). The version protocol, `/stitch/status`, `/stitch/verify`
and the Prometheus metrics come from `stitch_core` (engine-agnostic). Configuration: the
environment (`stitch_core.node.Settings`: STITCH_BOARD, STITCH_RUN, STITCH_NATS_URL, ...).
"""

from __future__ import annotations

from typing import Any

from stitch_core.engine import rpc
from stitch_core.node import EngineFollower, FollowerMiddleware, Settings, current

__all__ = ["VllmFollower", "StitchMiddleware", "Settings", "current"]


class VllmFollower(EngineFollower):
    """vLLM's follower (API server): RPC via `collective_rpc`, pauses via `pause_generation`."""

    engine_name = "vllm"

    def __init__(self, engine_client: Any, settings: Settings, model_dir: str | None = None):
        super().__init__(settings, model_dir or engine_client.model_config.model)
        self.engine = engine_client

    async def rpc(self, req: rpc.Request) -> list[rpc.Reply]:
        replies = await self.engine.collective_rpc("stitch_call", args=(rpc.encode(req),))
        return [rpc.decode(r) for r in replies]

    async def pause(self) -> None:
        await self.engine.pause_generation(mode="keep", clear_cache=False)

    async def resume(self) -> None:
        await self.engine.resume_generation()

    async def after_apply(self, version: int) -> None:
        # frees stale blocks when idle; refused while requests run (they are salted per version)
        await self.engine.reset_prefix_cache()


class StitchMiddleware(FollowerMiddleware):
    """vLLM `--middleware`: the version protocol, plus the follower's start and stop."""

    def make_follower(self, app: Any) -> VllmFollower | None:
        engine = getattr(getattr(app, "state", None), "engine_client", None)
        if engine is None:
            return None
        return VllmFollower(engine, Settings.from_env())
