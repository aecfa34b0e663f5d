"""The HTTP-process side of the SGLang plugin: `SglangFollower` and `StitchMiddleware`.

The plugin (`stitch_sglang.plugin`) adds `StitchMiddleware` to SGLang's FastAPI app just before
uvicorn starts. At application start-up it starts a `SglangFollower` (a `stitch_core.node.
EngineFollower`) in the HTTP process, where SGLang's TokenizerManager lives:

* RPC: a `StitchCallReqInput` through the TokenizerManager's scheduler channel, answered by every
  TP rank (`stitch_sglang.worker`) and matched to its call by id (`Calls`);
* engine steps are held with `pause_generation`: `mode="retract"` under
  STITCH_KV_AFTER_APPLY=recompute (the default: running requests go back to the queue and, once
  the radix cache is flushed after the apply, are prefilled again, prompt and tokens so far, on
  the new weights, SGLang's own preemption path), `mode="in_place"` under `keep` (requests keep
  their KV); released with `continue_generation`;
* after each apply (steps still held) SGLang's own `weight_version` is set to the Stitch version,
  so `meta_info.weight_version(s)` of native `/generate` and the `metadata` of OpenAI answers
  agree with the "stitch" field, and a flush of the radix cache is queued for when the engine is
  idle (requests are also salted per version by the middleware, so no version reuses another's
  KV).

The version protocol, `/stitch/status`, `/stitch/verify` and the Prometheus metrics come from
`stitch_core`. Which routes are version-controlled is read from SGLang's own route table at
start-up (`classify`, the rule of `stitch_core.serve.route_table`): every POST/PUT route except
those SGLang marks as admin endpoints (``@auth_level(ADMIN_...)``: weight updates, cache flushes,
profiling, pauses, ...) and the tokenizer / count / parser / session / cancel / abort ones, so
native `/generate` (POST and PUT), `/encode`, `/classify`, the OpenAI, Anthropic and Ollama
routes, scoring and rerank; WebSockets (the realtime API) are refused while no version is
proven. `FALLBACK` is version-controlled whatever the table says.

SGLang adds its `--api-key` middleware after the plugin added Stitch's, so around it: the key is
checked before admission. `/stitch/verify` takes `--api-key` or `--admin-api-key`.
Configuration: the environment (`stitch_core.node.Settings`: STITCH_BOARD, STITCH_RUN, ...).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from pathlib import Path
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
from stitch_core.versions.manifest import PULLED_MANIFEST

log = logging.getLogger("stitch.sglang")

__all__ = ["SglangFollower", "StitchMiddleware", "Settings", "current", "PATHS", "classify",
           "FALLBACK"]

PATHS = (*protocol.DEFAULT_PATHS, "/generate")
_BOTH = frozenset({"POST", "PUT"})
# version-controlled whatever the route table says (generating routes of SGLang 0.5.23)
FALLBACK: tuple[Route, ...] = (
    *(Route(p) for p in protocol.DEFAULT_PATHS),
    Route("/generate", _BOTH),
    Route("/v1/responses", dialect="responses"),
    Route("/v1/messages", dialect="anthropic", salt=False),
    Route("/invocations"),
    Route("/encode", _BOTH, salt=False),
    Route("/classify", _BOTH, salt=False),
    Route("/v1/realtime", frozenset({WEBSOCKET}), salt=False, control="refuse"),
)
_AUTH_MIDDLEWARE = "_ApiKeyASGIMiddleware"  # sglang.srt.utils.auth.add_api_key_middleware's


def _control_endpoint(info: RouteInfo) -> bool:
    """SGLang marks its admin endpoints with `@auth_level(AuthLevel.ADMIN_*)`."""
    level = getattr(info.endpoint, "_auth_level", None)
    return level is not None and str(getattr(level, "value", level)) != "normal"


def classify(info: RouteInfo) -> Route | None:
    """A route of SGLang's app: version-controlled (a `Route`) or not (None)."""
    return route_table.generating(info, _control_endpoint)


def api_keys(tm: Any = None) -> tuple[str | None, str | None]:
    """SGLang's (`--api-key`, `--admin-api-key`)."""
    try:
        from sglang.srt.runtime_context import get_serving

        serving = get_serving()
    except Exception:
        serving = getattr(tm, "server_args", None)
    return getattr(serving, "api_key", None), getattr(serving, "admin_api_key", None)
FLUSH_TIMEOUT = 60.0  # seconds a queued radix-cache flush waits for the engine to go idle

class Calls:
    """Stitch RPCs over SGLang's scheduler channel, each reply matched to its call by id.

    SGLang's `FanOutCommunicator` hands whatever reply arrives next to the call waiting now: a call
    given up on (the coordinator's STITCH_RPC_TIMEOUT ran out while a rank hung) leaves its reply
    in flight, and the next call (the Undo, then the Sums proving it) would take that stale reply
    as its own. Here a reply whose call is no longer waiting is dropped (logged)."""

    def __init__(self, send: Any, fan_out: int):
        self._send = send
        self.fan_out = fan_out
        self._waiting: dict[str, tuple[asyncio.Future, list[Any]]] = {}
        self.dropped = 0

    async def __call__(self, req: Any) -> list[Any]:
        fut = asyncio.get_running_loop().create_future()
        self._waiting[req.call_id] = (fut, [])
        try:
            self._send(req)
            return await fut
        finally:
            self._waiting.pop(req.call_id, None)

    def handle_recv(self, out: Any) -> None:
        waiting = self._waiting.get(out.call_id)
        if waiting is None:
            self.dropped += 1
            log.warning("stitch: dropped a late reply (call %s, given up on)", out.call_id)
            return
        fut, got = waiting
        got.append(out)
        if len(got) >= self.fan_out and not fut.done():
            fut.set_result(got)


_ACTIVE = False  # the middleware was added to SGLang's app (this process follows a run)
_WAKE = threading.Event()  # a version is proven, or the server is stopping: warm-up may end


def _reports(out: Any) -> Any:
    """SGLang's weight-version spans of the finished outputs in one item (a dict, or a batch's
    list of them) of ``generate_request``."""
    for i, o in enumerate(out if isinstance(out, list) else [out]):
        meta = o.get("meta_info", {}) if isinstance(o, dict) else {}
        reported = meta.get("weight_versions")
        if meta.get("finish_reason") is not None and reported is not None:
            yield int(o.get("index", i)), [(w["version"], w["start"], w["end"]) for w in reported]


def record_spans(tokenizer_manager: Any) -> None:
    """Report SGLang's per-token weight-version spans (``meta_info["weight_versions"]``) into the
    request's `SpanSink`: SGLang's HTTP routes (native and OpenAI) call
    ``tokenizer_manager.generate_request`` (`stitch_core.serve.spans.record_into_sinks`)."""
    if not spans.record_into_sinks(tokenizer_manager, "generate_request", _reports):
        # not SGLang's TokenizerManager as we know it: answers carry no spans
        log.warning("stitch: the tokenizer manager has no generate_request; answers carry no "
                    "per-token version spans")


class SglangFollower(EngineFollower):
    """The follower in SGLang's HTTP process: RPC via the TokenizerManager, in-place pauses,
    SGLang's weight-version label set to the Stitch version at every apply (per-token spans)."""

    engine_name = "sglang"

    def __init__(self, tokenizer_manager: Any, settings: Settings, model_dir: str | None = None):
        super().__init__(settings, model_dir or tokenizer_manager.server_args.model_path)
        self.tm = tokenizer_manager
        record_spans(tokenizer_manager)
        self.recompute = settings.kv_after_apply == "recompute"
        self.ready = False  # the engine held a proven version once (SGLang's warm-up may run)
        self._comm: Any = None
        self._background: set[asyncio.Task] = set()

    # ------------------------------------------------------------ EngineFollower hooks

    def _communicator(self) -> Calls:
        if self._comm is None:
            from sglang.utils import TypeBasedDispatcher

            from .worker import StitchCallReqOutput

            try:
                from sglang.srt.runtime_context import get_parallel

                fan_out = int(get_parallel().num_dp_ranks)
            except Exception:
                fan_out = 1
            self.tm.auto_create_handle_loop()
            comm = Calls(self.tm._dispatch_to_scheduler, fan_out)
            self.tm._result_dispatcher += TypeBasedDispatcher(
                [(StitchCallReqOutput, comm.handle_recv)])
            self._comm = comm
        return self._comm

    async def rpc(self, req: rpc.Request) -> list[rpc.Reply]:
        from .worker import StitchCallReqInput

        method = type(req).__name__
        outs = await self._communicator()(StitchCallReqInput(
            method=method, blob=rpc.encode(req), call_id=uuid.uuid4().hex))
        errors = [o.error for o in outs if o.error]
        if errors:
            raise ReplicaError(f"stitch {method} failed on the engine: {'; '.join(errors)}")
        return [rpc.decode(r) for o in outs for r in o.replies]

    async def pause(self) -> None:
        from sglang.srt.managers.io_struct import PauseGenerationReqInput

        # retract: running requests go back to the queue, their KV released to the radix cache
        # (flushed in after_apply, so they are prefilled again on the new weights); in_place: the
        # scheduler stops running batches, requests keep their KV (vLLM's "keep"). Sent on the
        # same ordered channel as the RPC that follows, so it lands first
        mode = "retract" if self.recompute else "in_place"
        await self.tm.pause_generation(PauseGenerationReqInput(mode=mode))

    async def resume(self) -> None:
        from sglang.srt.managers.io_struct import ContinueGenerationReqInput

        await self.tm.continue_generation(ContinueGenerationReqInput(torch_empty_cache=False))

    async def after_apply(self, version: int) -> None:
        await self._set_weight_version(version)
        if self.recompute:  # steps held, requests retracted: the flush is immediate
            out = await self.tm.flush_cache()
            if out.success:
                log.info("stitch: radix cache flushed after v%s; running requests are "
                         "prefilled again on it", version)
                return
            log.warning("stitch: radix cache not flushed after v%s (%s): requests running "
                        "across the apply keep their prefix KV", version, out.message)
        # refused while requests run, so queue it until the engine is idle (bounded)
        task = asyncio.create_task(self._flush(version))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ------------------------------------------------------------ SGLang specifics

    async def _set_weight_version(self, version: int) -> None:
        from sglang.srt.managers.io_struct import UpdateWeightVersionReqInput

        try:  # while steps are held: SGLang's per-request version spans are exact
            await self.tm.update_weight_version(UpdateWeightVersionReqInput(
                new_version=str(version), abort_all_requests=False))
        except Exception:
            log.exception("stitch: could not set SGLang's weight_version to %s", version)

    async def _flush(self, version: int) -> None:
        try:
            out = await self.tm.flush_cache(timeout_s=FLUSH_TIMEOUT)
            if out.success:
                log.info("stitch: radix cache flushed after v%s", version)
            else:  # harmless: requests are salted per version
                log.info("stitch: radix cache not flushed after v%s: %s", version, out.message)
        except Exception as e:
            log.warning("stitch: radix cache flush after v%s failed: %s", version, e)

    async def start(self) -> None:
        # label the loaded weights with the version they are proven against before any request
        # is admitted (a proof that fails serves nothing, whatever the label)
        m = read_pulled_manifest(self.model_dir)
        if m is not None:
            self.tm.auto_create_handle_loop()
            await self._set_weight_version(m.version)
        await super().start()
        self._tasks.append(asyncio.create_task(self._when_serving()))

    async def _when_serving(self) -> None:
        """Once a version is proven: SGLang's weight_version follows it, the warm-up may run."""
        v = await self.gate.wait_version()
        await self._set_weight_version(v)
        self.ready = True
        log.warning("stitch: %s v%s proven on %d rank(s); SGLang's warm-up may run",
                    self.gate.run, v, self.coord.ranks if self.coord else 0)
        _WAKE.set()

    async def stop(self) -> None:
        _WAKE.set()
        for t in list(self._background):
            t.cancel()
        await super().stop()


class StitchMiddleware(FollowerMiddleware):
    """The version protocol on SGLang's app (`/generate` included), plus the follower's start
    and stop. Added by the plugin; `app.add_middleware(StitchMiddleware)` does the same."""

    def __init__(self, app: Any, **kw: Any):
        kw.setdefault("routes", FALLBACK)
        super().__init__(app, **kw)

    def discover_routes(self, app: Any) -> list[Route] | None:
        return route_table.discover(app, classify, FALLBACK)

    def setup_auth(self, app: Any) -> None:
        from sglang.srt.entrypoints.http_server import get_global_state

        api_key, admin_key = api_keys(getattr(get_global_state(), "tokenizer_manager", None))
        auth = self.below(lambda m: type(m).__name__ == _AUTH_MIDDLEWARE)
        outside = any(getattr(m.cls, "__name__", "") == _AUTH_MIDDLEWARE
                      for m in getattr(app, "user_middleware", []))
        if auth is not None:  # below Stitch: run it in front of admission too
            self.set_guard(instance_guard(auth))
        elif not outside and (own := bearer_check([api_key])) is not None:
            log.warning("stitch: SGLang has an API key but no key check around Stitch's "
                        "middleware; Stitch checks it itself on every route it controls")
            self.set_guard(check_guard(own))
        self.control_check = bearer_check([api_key, admin_key])

    def make_follower(self, app: Any) -> SglangFollower | None:
        from sglang.srt.entrypoints.http_server import get_global_state

        state = get_global_state()
        tm = getattr(state, "tokenizer_manager", None)
        if tm is None:
            return None
        return SglangFollower(tm, Settings.from_env())

    async def shutdown(self) -> None:
        _WAKE.set()
        await super().shutdown()


# ------------------------------------------------------------------ hooks (see plugin.py)


def follows(model_path: str | None, env: dict[str, str] | None = None) -> bool:
    """Is this server a Stitch follower? STITCH_BOARD/STITCH_RUN set, or a pulled snapshot."""
    s = Settings.from_env(env, fields=("board", "run"))
    if s.board or s.run:
        return True
    return bool(model_path) and (Path(str(model_path)) / PULLED_MANIFEST).is_file()


def before_http_server(*args: Any, **kwargs: Any) -> None:
    """BEFORE hook on `_setup_and_run_http_server(server_args, tokenizer_manager, ...)`."""
    global _ACTIVE
    server_args = kwargs.get("server_args", args[0] if args else None)
    model_path = getattr(server_args, "model_path", None)
    if not follows(model_path):
        log.warning("stitch: plugin loaded, but this server follows no run (no STITCH_BOARD or "
                    "STITCH_RUN, no stitch-manifest.json in %s): SGLang runs unchanged",
                    model_path)
        return None
    workers = getattr(server_args, "tokenizer_worker_num", 1) or 1
    if workers != 1:
        log.error("stitch: --tokenizer-worker-num %s is not supported (each tokenizer worker "
                  "would run its own follower); SGLang runs WITHOUT the Stitch protocol", workers)
        return None
    from sglang.srt.entrypoints.http_server import app

    app.add_middleware(StitchMiddleware)
    _ACTIVE = True
    s = Settings.from_env(fields=("board", "run"))
    log.warning("stitch: following %s (run %s); requests get 409 until the loaded weights are "
                "proven; GET /stitch/status", s.board or "no board", s.run or "of the manifest")
    return None


def around_warmup(original: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND hook on `_wait_and_warmup` (a thread of SGLang's lifespan): SGLang's warm-up POSTs
    /generate and kills the server on any non-200, and /health answers 503 until it passed. Run
    it only once the engine holds a proven version (it then passes the gate like any request);
    return without it if the server stops first (the lifespan joins this thread)."""
    if not _ACTIVE:
        return original(*args, **kwargs)
    ef = current()
    if ef is None:
        log.error("stitch: the follower did not start (see above); SGLang's warm-up is withheld "
                  "and /health stays 503")
    else:
        log.warning("stitch: SGLang's warm-up waits for a proven version (/health is 503 "
                    "until then)")
    _WAKE.wait()
    ef = current()
    if not isinstance(ef, SglangFollower) or not ef.ready:
        return None
    return original(*args, **kwargs)
