"""`stitch gateway`: a fleet of Stitch engines behind one OpenAI-compatible endpoint.

Size: about 410 lines, one job: the gateway's ASGI app (the fleet table from heartbeats, a
request's route with its retries, the gateway's own routes). What could stand alone already does:
admission (stitch_core.serve.admission), routing order (stitch_core.serve.routing) and HTTP rules
(stitch_core.serve.proxy).

A plain ASGI app (served by uvicorn; upstream through one ``httpx.AsyncClient``). It learns the
engines of a run from their NATS heartbeats (the stream's last ones at start, then each new one),
each admitted first (stitch_core.serve.admission: its own subject only, a sane clock, a plain
http(s) URL, optionally an allowed host), and sends every request to an engine that can serve
its version headers now (stitch_core.serve.routing gives the order: same region, least loaded,
newest). An engine's 409 (``stitch_version_not_ready``), a failed connection or no response
head within ``upstream_timeout`` sends the request to the next one. With ``X-Stitch-Wait: S``
a request no engine can serve yet waits up to S seconds for a heartbeat showing one; else the
gateway answers itself in the engines' shape: 409 (engines serve other versions), 503 (none
serves) or 504 (the last engine tried timed out). Answers stream through unchanged, plus
``X-Stitch-Engine`` (the engine's id). HTTP rules: stitch_core.serve.proxy.

Its own routes: ``GET /stitch/gateway`` (JSON, `GatewayStatus`), ``GET /metrics`` (Prometheus
text), both behind ``Authorization: Bearer <api_key>`` when a key is set, and ``GET /health``.
It publishes a `GatewayHeartbeat` on ``stitch.<run>.gateways.<id>`` for `stitch status`.
docs/gateway.md has the details.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from typing import Any

import httpx

from stitch_core.serve import protocol, proxy
from stitch_core.serve.admission import (
    Admission,
    HeartbeatRejectedError,
    UrlAllowList,
    parse_heartbeat,
)
from stitch_core.serve.asgi_types import Receive, Scope, Send, send_json
from stitch_core.serve.proxy import ClientGoneError
from stitch_core.serve.routing import (
    DEFAULT_MAX_ENGINES,
    DEFAULT_TTL,
    Engine,
    EngineTable,
    GatewayStatus,
    metrics_text,
)
from stitch_core.settings import MAX_BODY_BYTES, env_name
from stitch_core.versions import announce, nats_conn, streams
from stitch_core.versions.manifest import GatewayHeartbeat, Heartbeat, check_run
from stitch_core.versions.tasks import cancel_all

log = logging.getLogger("stitch.gateway")

ENGINE_HEADER = "X-Stitch-Engine"
"""Response header naming the engine (its heartbeat id) that answered through the gateway."""
STATUS_PATH = "/stitch/gateway"
METRICS_PATH = "/metrics"
HEALTH_PATH = "/health"
API_KEY_ENV = env_name("gateway_api_key")  # named in messages; read by the CLI (Settings)
MAX_ATTEMPTS = 4  # engines tried per request (409s, failed connections, timeouts)
DEFAULT_UPSTREAM_TIMEOUT = 300.0  # seconds for an engine's response head (docs/gateway.md)
_ENGINE = ENGINE_HEADER.lower().encode()
_DONE, _FAILED, _TIMEOUT = "done", "failed", "timeout"


class Gateway:
    """The gateway ASGI app for `run` (see the module doc). `nats`: the NATS URL (None: feed
    `heartbeat` yourself, as tests may); `ttl`: seconds an engine stays routable after its last
    heartbeat; `region`: engines of this region are tried first; `engine_url_allow`: host, name
    (``*.domain``) and CIDR patterns engine URLs must match (empty: any); `max_engines`: table
    size; `upstream_timeout`: seconds an engine has for its response head (None: no limit);
    `api_key`: the Bearer key of the status and metrics routes (None: open)."""

    def __init__(self, run: str, nats: str | None, *, region: str | None = None,
                 ttl: float = DEFAULT_TTL, gateway_id: str | None = None,
                 url: str | None = None, heartbeat_interval: float = 2.0,
                 max_wait: float = protocol.DEFAULT_MAX_WAIT, max_body: int = MAX_BODY_BYTES,
                 timeout: httpx.Timeout | None = None,
                 upstream_timeout: float | None = DEFAULT_UPSTREAM_TIMEOUT,
                 engine_url_allow: UrlAllowList | list[str] | None = None,
                 max_engines: int = DEFAULT_MAX_ENGINES, api_key: str | None = None):
        self.run = check_run(run)
        self.nats_url = nats
        self.table = EngineTable(run, region=region, ttl=ttl, max_engines=max_engines)
        allow = (engine_url_allow if isinstance(engine_url_allow, UrlAllowList)
                 else UrlAllowList.parse(engine_url_allow or []))
        self.admission = Admission(run, allow)
        self.id = gateway_id or f"gw-{socket.gethostname()}-{os.getpid()}"
        self.url, self.heartbeat_interval = url, heartbeat_interval
        self.max_wait, self.max_body = max_wait, max_body
        self.upstream_timeout = upstream_timeout or None
        self.api_key = api_key or None
        # no read timeout: a generation may stream for as long as it takes (the response head
        # has `upstream_timeout`, applied around the send)
        self.timeout = timeout or httpx.Timeout(None, connect=5.0)
        self.client: httpx.AsyncClient | None = None
        self.in_flight = self.requests = self.retries = self.waited = self.refused = 0
        self.timeouts = self.rejected = 0
        self._nc: Any = None
        self._tasks: list[asyncio.Task] = []
        self._stopping = False

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Open the upstream client, read the fleet's last heartbeats, follow new ones."""
        self._stopping = False
        self.client = httpx.AsyncClient(timeout=self.timeout, follow_redirects=False,
                                        limits=httpx.Limits(max_connections=None,
                                                            max_keepalive_connections=64))
        for name in ("accept", "accept-encoding", "user-agent"):  # only what the client sent
            self.client.headers.pop(name, None)
        log.info("gateway %s: /stitch/gateway and /metrics %s; engine URLs: %s; upstream "
                 "timeout %s", self.id, "need the API key" if self.api_key else "are open",
                 "allow-list" if self.admission.allow else "any http(s) host",
                 f"{self.upstream_timeout:g} s" if self.upstream_timeout else "none")
        if self.nats_url is None:
            return
        self._nc = await nats_conn.connect(self.nats_url, name=f"stitch-gateway-{self.id}")
        js = self._nc.jetstream()
        await self._nc.subscribe(streams.engines_subject(self.run), cb=self._on_heartbeat)
        now = time.time()
        for st in await announce.fleet_stored(js, self.run):
            self.heartbeat(st.subject, st.hb, now=st.stored, age=now - st.stored, seq=st.seq)
        try:
            await streams.ensure_gateways_stream(js, self.run)
        except Exception as e:  # noqa: BLE001 - e.g. no right to create it: route anyway
            log.warning("gateway %s: no heartbeats of its own (stitch status will not list it):"
                        " %s", self.id, e)
        else:
            self._tasks.append(asyncio.create_task(self._heartbeats(js)))
        self._tasks.append(asyncio.create_task(self._prune()))
        log.info("gateway %s: run %s, %d engine(s) routable", self.id, self.run,
                 len(self.table.live()))

    async def stop(self) -> None:
        # bounded (cancel_all): on Python < 3.12 a cancellation can be swallowed inside
        # nats-py's wait_for, so a loop may outlive one cancel (it also checks `_stopping`)
        self._stopping = True
        await cancel_all(self._tasks, rounds=3)
        nc, self._nc = self._nc, None
        if nc is not None:  # only a plain subscription: nothing to drain
            with contextlib.suppress(Exception):
                await asyncio.wait_for(nc.close(), 5.0)
        client, self.client = self.client, None
        if client is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(client.aclose(), 5.0)

    async def _on_heartbeat(self, msg: Any) -> None:
        try:
            hb = parse_heartbeat(msg.data)
        except HeartbeatRejectedError as e:
            self._rejected(msg.subject, e)
            return
        self.heartbeat(msg.subject, hb)

    def heartbeat(self, subject: str, hb: Heartbeat, *, now: float | None = None, age: float = 0.0,
                  seq: int | None = None) -> bool:
        """Admit `hb` (arrived on `subject`) and put it in the table; False if rejected."""
        try:
            admitted = self.admission.admit(subject, hb, now)
        except HeartbeatRejectedError as e:
            self._rejected(subject, e)
            return False
        self.table.observe(admitted, age=age, seq=seq)
        return True

    def _rejected(self, subject: str, e: Exception) -> None:
        self.rejected += 1
        n = self.rejected
        if n & (n - 1) == 0 or n % 1000 == 0:  # powers of two and every 1000th: no log flood
            log.warning("gateway: heartbeat on %s rejected: %s (%d rejected so far)", subject,
                        e, n)

    async def _prune(self) -> None:
        while not self._stopping:
            self.table.prune()
            await asyncio.sleep(self.table.ttl)

    async def _heartbeats(self, js: Any) -> None:
        while not self._stopping:
            st = self.status()
            with contextlib.suppress(Exception):
                await announce.publish_gateway_heartbeat(js, GatewayHeartbeat(
                    id=self.id, run=self.run, url=self.url, region=self.table.region,
                    engines=st.routable, versions=st.versions, in_flight=self.in_flight,
                    requests_total=self.requests, time=time.time()))
            await asyncio.sleep(self.heartbeat_interval)

    def status(self) -> GatewayStatus:
        rows = self.table.rows()
        return GatewayStatus(
            id=self.id, run=self.run, region=self.table.region, ttl=self.table.ttl,
            nats_connected=bool(self._nc is not None and self._nc.is_connected),
            engines=rows, routable=sum(r.routable for r in rows),
            versions=sorted({r.version for r in rows if r.routable and r.version is not None}),
            in_flight=self.in_flight, requests_total=self.requests, retries_total=self.retries,
            waited_total=self.waited, refused_total=self.refused, timeouts_total=self.timeouts,
            heartbeats_rejected_total=self.rejected, engines_evicted_total=self.table.evicted,
            max_engines=self.table.max_engines, api_key_required=self.api_key is not None)

    # ------------------------------------------------------------------ ASGI

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":  # WebSockets are not proxied
            return
        path, method = scope.get("path", ""), scope.get("method", "GET")
        own = method == "GET" and path in (STATUS_PATH, METRICS_PATH)
        if own and not proxy.bearer_ok(scope, self.api_key):
            await send_json(send, 401, protocol.error_body(
                "authentication_error", "this gateway's status and metrics need "
                "'Authorization: Bearer <key>' (its --api-key)"),
                [(b"www-authenticate", b'Bearer realm="stitch-gateway"')])
        elif own and path == STATUS_PATH:
            await send_json(send, 200, self.status().model_dump())
        elif own:
            data = metrics_text(self.status()).encode()
            await send({"type": "http.response.start", "status": 200, "headers": [
                (b"content-type", b"text/plain; version=0.0.4; charset=utf-8")]})
            await send({"type": "http.response.body", "body": data})
        elif method == "GET" and path == HEALTH_PATH:
            live = len(self.table.live())
            await send_json(send, 200 if live else 503, {"engines": live})
        else:
            self.in_flight += 1
            try:
                await self.proxy(scope, receive, send)
            except ClientGoneError as e:
                log.info("gateway: %s %s: %s", method, path[:200], e)
            finally:
                self.in_flight -= 1
                self.requests += 1

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                try:
                    await self.start()
                except Exception as e:
                    log.error("gateway %s: cannot start: %s", self.id, e)
                    await send({"type": "lifespan.startup.failed", "message": str(e)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                await self.stop()
                await send({"type": "lifespan.shutdown.complete"})
                return

    # ------------------------------------------------------------------ proxying

    async def proxy(self, scope: Scope, receive: Receive, send: Send) -> None:
        """One request: pick an engine (waiting if allowed), retry 409s elsewhere, stream back.
        Raises ClientGoneError when the client left (whatever was waiting or in flight
        cancelled)."""
        run_header = protocol.response_headers(self.run, None, None)
        anthropic = scope.get("path", "").startswith("/v1/messages")
        target = proxy.origin_target(scope)
        if target is None:
            await send_json(send, 400, _dialect(anthropic, protocol.bad_request_body(
                "the request target must be a path starting with '/' (origin form)")),
                run_header)
            return
        try:
            req = protocol.parse_request(scope.get("headers", []), self.max_wait)
        except protocol.BadRequestError as e:
            await send_json(send, 400, _dialect(anthropic, protocol.bad_request_body(str(e))),
                            run_header)
            return
        body = await proxy.read_body(receive, self.max_body)
        if body is None:
            await send_json(send, 413, protocol.bad_request_body(
                f"request body over {self.max_body} bytes"), run_header)
            return
        gone = asyncio.Event()
        watch = asyncio.create_task(proxy.watch_disconnect(receive, gone))
        try:
            await self._route(scope, target, body, req, gone, send, anthropic, run_header)
        finally:
            watch.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await watch

    async def _route(self, scope: Scope, target: bytes, body: bytes,
                     req: protocol.VersionRequest, gone: asyncio.Event, send: Send,
                     anthropic: bool, run_header: proxy.Headers) -> None:
        deadline = time.monotonic() + req.wait
        tried: dict[str, int] = {}  # engine key -> its beat when it refused or failed
        last_409: tuple[int, proxy.Headers, bytes] | None = None
        timed_out = waited = False
        headers = proxy.end_to_end(scope.get("headers", []), proxy.REQUEST_OWN)
        for attempt in range(MAX_ATTEMPTS):
            found = self.table.candidates(req, tried)
            if not found and time.monotonic() < deadline and not self.table.passed(req):
                self.waited += not waited
                waited = True
                found = await proxy.until_gone(
                    self.table.wait_candidates(req, deadline, tried), gone)
            if not found:
                break
            engine = found[0]
            tried[engine.key] = engine.beat
            self.retries += attempt > 0
            engine.in_flight += 1
            engine.requests += 1
            try:
                outcome = await self._attempt(engine, scope, target, headers, body, deadline,
                                              gone, send)
            finally:
                engine.in_flight -= 1
            if outcome == _DONE:
                return
            if isinstance(outcome, tuple):
                last_409 = outcome
            timed_out = outcome == _TIMEOUT
        if last_409 is not None:  # the last engine's own refusal, as it said it
            await proxy.send_response(send, *last_409)
            return
        if timed_out:
            await send_json(send, 504, _dialect(anthropic, protocol.error_body(
                "stitch_gateway_timeout", f"no engine of run {self.run} sent a response head "
                f"within {self.upstream_timeout:g} s")), run_header)
            return
        self.refused += 1
        status, err = self.table.refusal(req)
        await send_json(send, status, _dialect(anthropic, err),
                        [(b"retry-after", b"1"), *run_header])

    async def _attempt(self, engine: Engine, scope: Scope, target: bytes,
                       headers: proxy.Headers, body: bytes, deadline: float,
                       gone: asyncio.Event, send: Send) -> str | tuple[int, proxy.Headers, bytes]:
        """Send the request to `engine`: _DONE when its answer was sent on, else why not
        (_FAILED, _TIMEOUT, or its Stitch refusal: status, headers, body)."""
        assert self.client is not None and engine.base is not None
        left = deadline - time.monotonic()
        if left > 0:  # what is left of the wait, for the engine's own catch-up
            headers = [*headers, (protocol.WAIT_HEADER.lower().encode(), f"{left:.3f}".encode())]
        # the engine may spend the forwarded wait catching up before it answers
        limit = None if self.upstream_timeout is None else self.upstream_timeout + max(0, left)
        try:
            request = self.client.build_request(
                scope.get("method", "GET"), proxy.upstream_url(engine.base, target),
                headers=headers, content=body)
            resp = await proxy.until_gone(
                asyncio.wait_for(self.client.send(request, stream=True), limit), gone)
        except TimeoutError:
            engine.errors += 1
            self.timeouts += 1
            log.warning("gateway: engine %s (%s) sent no response head within %.0f s",
                        engine.id, engine.hb.url, limit)
            return _TIMEOUT
        except (httpx.TransportError, httpx.InvalidURL, ValueError) as e:  # nothing answered
            engine.errors += 1
            log.warning("gateway: engine %s (%s) failed: %r", engine.id, engine.hb.url, e)
            return _FAILED
        try:
            rh = proxy.response_headers(resp, _ENGINE, engine.id)
            head, rest = b"", resp.aiter_raw()
            if resp.status_code == 409:
                try:
                    head, rest = await proxy.until_gone(asyncio.wait_for(
                        proxy.read_capped(resp, proxy.REFUSAL_MAX_BYTES), limit), gone)
                except (TimeoutError, httpx.TransportError) as e:  # its 409's body did not come
                    engine.errors += 1
                    log.warning("gateway: engine %s: no 409 body: %r", engine.id, e)
                    return _FAILED
                kind = proxy.refusal_kind(head) if rest is None else None
                if kind == "refusal":
                    engine.refused += 1
                    return resp.status_code, rh, head
                if kind == "malformed":
                    engine.errors += 1
                    log.warning("gateway: engine %s answered a malformed refusal: %r", engine.id,
                                head[:200])
                    return _FAILED
            await proxy.until_gone(proxy.send_response(send, resp.status_code, rh, head, rest),
                                   gone)
            return _DONE
        except httpx.TransportError as e:  # cut mid-answer: the client gets a cut answer
            log.warning("gateway: engine %s (%s) cut its answer: %r", engine.id, engine.hb.url, e)
            return _DONE
        finally:
            await resp.aclose()  # unread: the connection is closed, the engine aborts


def _dialect(anthropic: bool, body: dict) -> dict:
    return {"type": "error", **body} if anthropic else body


def serve(gateway: Gateway, host: str, port: int) -> None:
    """Run `gateway` under uvicorn until interrupted."""
    import uvicorn

    uvicorn.run(gateway, host=host, port=port, lifespan="on", log_level="info",
                timeout_keep_alive=30)
