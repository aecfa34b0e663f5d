"""The API-server side of the vLLM plugin: `--middleware stitch_vllm.server.StitchMiddleware`.

At application start-up the middleware starts a `VllmFollower` (a `stitch_core.node.
EngineFollower`) in the API server process: its RPC reaches `StitchWorkerExtension.stitch_call` on
every TP rank through vLLM's `collective_rpc`; engine steps are held during writes with
`pause_generation(mode="keep")`; the prefix cache is reset after each apply (requests are also
salted per version by the middleware). The version protocol, `/stitch/status`, `/stitch/verify`
and the Prometheus metrics come from `stitch_core` (engine-agnostic). Configuration: the
environment (`stitch_core.node.Settings`: STITCH_BOARD, STITCH_RUN, STITCH_NATS_URL, ...).

Which routes are version-controlled is read from vLLM's own route table at start-up
(`classify`, the rule of `stitch_core.serve.route_table`): every POST/PUT route except those whose
endpoint lives in vLLM's server-administration, RL-control, model-list or render/derender modules
(`CONTROL_MODULES`) or is a tokenizer / count / abort / cancel endpoint; WebSocket routes (the
realtime API) are refused while no version is proven. `FALLBACK` is version-controlled whatever
the table says.

`--middleware` puts Stitch outside vLLM's own middleware, so in front of its `--api-key` check:
Stitch finds vLLM's `AuthenticationMiddleware` instance below itself and runs a copy of it in
front of admission (vLLM's own rule and 401), and checks `/stitch/verify` with its
`verify_token`.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from stitch_core.engine import rpc
from stitch_core.engine.proof import read_pulled_manifest
from stitch_core.engine.replica import ReplicaError
from stitch_core.node import (
    EngineFollower,
    FollowerMiddleware,
    Settings,
    bearer_check,
    check_guard,
    current,
    instance_guard,
)
from stitch_core.serve import protocol, route_table, spans
from stitch_core.serve.route_table import WEBSOCKET, Route, RouteInfo

__all__ = ["VllmFollower", "StitchMiddleware", "Settings", "current", "classify", "FALLBACK"]

log = logging.getLogger("stitch.vllm")

# endpoints in these modules run no model on a prompt: the server's administration and dev routes
# (tokenizer, health, caches, sleep, LoRA, elastic EP, SageMaker ping, ...), RL control (pause,
# weight transfer), the model list, and prompt rendering for disaggregated serving
CONTROL_MODULES = ("vllm.entrypoints.serve.", "vllm.entrypoints.rl.",
                   "vllm.entrypoints.openai.models.", "vllm.entrypoints.scale_out.render.",
                   "vllm.entrypoints.scale_out.derender.")

# version-controlled whatever the route table says (the generating routes of vLLM 0.32)
FALLBACK: tuple[Route, ...] = (
    *(Route(p) for p in protocol.DEFAULT_PATHS),
    Route("/v1/responses", dialect="responses"),
    Route("/v1/messages", dialect="anthropic"),
    Route("/v1/chat/completions/batch"),
    Route("/inference/v1/generate"),
    Route("/generative_scoring"),
    Route("/invocations", salt=False),
    Route("/v1/realtime", frozenset({WEBSOCKET}), salt=False, control="refuse"),
)


def _control_endpoint(info: RouteInfo) -> bool:
    return info.module.startswith(CONTROL_MODULES)


def classify(info: RouteInfo) -> Route | None:
    """A route of vLLM's app: version-controlled (a `Route`) or not (None)."""
    return route_table.generating(info, _control_endpoint)


def api_keys(app: Any) -> list[str]:
    """The API keys vLLM is configured with (``--api-key`` first, else ``VLLM_API_KEY``)."""
    keys = getattr(getattr(getattr(app, "state", None), "args", None), "api_key", None)
    if isinstance(keys, str):
        keys = [keys]
    return [k for k in (keys or [os.environ.get("VLLM_API_KEY")]) if k]


def _reports(out: Any) -> Any:
    """vLLM's weight-version spans of the finished outputs of one `RequestOutput`."""
    if out.finished:
        for c in out.outputs:
            if c.weight_versions is not None:
                yield c.index, [(w.version, w.start, w.end) for w in c.weight_versions]


def record_spans(engine_client: Any) -> None:
    """Report vLLM's per-token weight-version spans (`CompletionOutput.weight_versions`) into the
    request's `SpanSink`: vLLM's OpenAI server layers call ``engine_client.generate`` per prompt
    (`stitch_core.serve.spans.record_into_sinks`)."""
    spans.record_into_sinks(engine_client, "generate", _reports)


class VllmFollower(EngineFollower):
    """vLLM's follower (API server): RPC via `collective_rpc`, pauses via `pause_generation`,
    vLLM's weight-version label set to the Stitch version at every apply (per-token spans)."""

    engine_name = "vllm"

    def __init__(self, engine_client: Any, settings: Settings, model_dir: str | None = None):
        super().__init__(settings, model_dir or engine_client.model_config.model)
        self.engine = engine_client
        record_spans(engine_client)

    async def start(self) -> None:
        # label the loaded weights with the version they are proven against before any request
        # is admitted (a proof that fails serves nothing, whatever the label)
        m = read_pulled_manifest(self.model_dir)
        if m is not None:
            await self.label(m.version)
        await super().start()

    async def label(self, version: int) -> None:
        """vLLM's weight-version label: every engine step from now on reports `version`."""
        await self.engine.update_weight_version(str(version))

    async def rpc(self, req: rpc.Request) -> list[rpc.Reply]:
        replies = [rpc.decode(r) for r in await self.engine.collective_rpc(
            "stitch_call", args=(rpc.encode(req),))]
        failed = [f"rank {i}: {r.error}" for i, r in enumerate(replies)
                  if isinstance(r, rpc.Failed)]
        if failed:  # every rank answered (the worker never raises): the queues stay in step
            raise ReplicaError(f"stitch {type(req).__name__} failed on the engine: "
                               f"{'; '.join(failed)}")
        return replies

    async def pause(self) -> None:
        await self.engine.pause_generation(mode="keep", clear_cache=False)

    async def resume(self) -> None:
        await self.engine.resume_generation()

    async def after_apply(self, version: int) -> None:
        # steps are held: the first step on the new weights is the first labelled `version`
        try:
            await self.label(version)
        except Exception:
            log.exception("stitch: cannot set vLLM's weight version to %s; per-token version "
                          "spans of requests running now will not be reported", version)
        # the prefix cache holds the old weights' KV; with `recompute` (STITCH_KV_AFTER_APPLY)
        # the running requests are preempted too, and recompute theirs on the new weights when
        # steps resume; with `keep` the reset is refused while requests run (they are salted)
        await self.engine.reset_prefix_cache(
            reset_running_requests=self.settings.kv_after_apply == "recompute")


class StitchMiddleware(FollowerMiddleware):
    """vLLM `--middleware`: the version protocol, plus the follower's start and stop."""

    def __init__(self, app: Any, **kw: Any):
        kw.setdefault("routes", FALLBACK)
        super().__init__(app, **kw)

    def discover_routes(self, app: Any) -> list[Route] | None:
        return route_table.discover(app, classify, FALLBACK)

    def setup_auth(self, app: Any) -> None:
        auth = self.below(lambda m: type(m).__name__ == "AuthenticationMiddleware"
                          and callable(getattr(m, "verify_token", None)))
        if auth is not None:
            from starlette.datastructures import Headers

            self.set_guard(instance_guard(auth))
            self.control_check = lambda scope: bool(auth.verify_token(Headers(scope=scope)))
            return
        check = bearer_check(api_keys(app))
        if check is not None:  # keys configured, vLLM's key check not where it used to be
            log.warning("stitch: vLLM has an API key but its AuthenticationMiddleware is not "
                        "below Stitch's; Stitch checks the key itself on every route it controls")
            self.set_guard(check_guard(check))
        self.control_check = check

    def make_follower(self, app: Any) -> VllmFollower | None:
        engine = getattr(getattr(app, "state", None), "engine_client", None)
        if engine is None:
            return None
        return VllmFollower(engine, Settings.from_env())
