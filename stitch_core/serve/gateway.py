"""`stitch gateway`: a fleet of Stitch engines behind one OpenAI-compatible endpoint.

A plain ASGI app (served by uvicorn; upstream through one ``httpx.AsyncClient``). It learns the
engines of a run from their NATS heartbeats (the stream's last ones at start, then each new one)
and sends every request to an engine that can serve its version headers now
(stitch_core.serve.routing gives the order: same region, least loaded, newest). An engine's 409
(``stitch_version_not_ready``) or a failed connection sends the request to the next one. With
``X-Stitch-Wait: S`` a request no engine can serve yet waits, up to S seconds, for a heartbeat
showing one that can; otherwise the gateway answers itself, in the engines' shape: 409 when
engines serve other versions, 503 when none is serving. Answers stream through unchanged (SSE
chunk by chunk), the engines' ``X-Stitch-*`` stamps included, plus ``X-Stitch-Engine`` (the id
of the engine that answered).

Its own routes: ``GET /stitch/gateway`` (JSON, `GatewayStatus`), ``GET /metrics`` (Prometheus
text) and ``GET /health``. It publishes a `GatewayHeartbeat` on ``stitch.<run>.gateways.<id>``
for `stitch status`. docs/gateway.md has the details.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import time
from typing import Any

import httpx

from stitch_core.serve import protocol
from stitch_core.serve.asgi import MAX_BODY_BYTES, Receive, Scope, Send, send_json
from stitch_core.serve.routing import DEFAULT_TTL, EngineTable, GatewayStatus, metrics_text
from stitch_core.versions import announce
from stitch_core.versions.manifest import Heartbeat, check_run

log = logging.getLogger("stitch.gateway")

ENGINE_HEADER = "X-Stitch-Engine"
"""Response header naming the engine (its heartbeat id) that answered through the gateway."""
STATUS_PATH = "/stitch/gateway"
METRICS_PATH = "/metrics"
HEALTH_PATH = "/health"
MAX_ATTEMPTS = 4  # engines tried per request (409s and failed connections)
# hop-by-hop headers (RFC 9110 7.6.1) and those httpx / uvicorn set themselves
_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
                  "trailer", "transfer-encoding", "upgrade", "host", "content-length"})


class Gateway:
    """The gateway ASGI app for `run` (see the module doc). `nats`: the NATS URL (None: feed
    `table.observe` yourself, as tests may); `ttl`: seconds an engine stays routable after its
    last heartbeat; `region`: engines of this region are tried first."""

    def __init__(self, run: str, nats: str | None, *, region: str | None = None,
                 ttl: float = DEFAULT_TTL, gateway_id: str | None = None,
                 url: str | None = None, heartbeat_interval: float = 2.0,
                 max_wait: float = protocol.DEFAULT_MAX_WAIT, max_body: int = MAX_BODY_BYTES,
                 timeout: httpx.Timeout | None = None):
        self.run = check_run(run)
        self.nats_url = nats
        self.table = EngineTable(run, region=region, ttl=ttl)
        self.id = gateway_id or f"gw-{socket.gethostname()}-{os.getpid()}"
        self.url, self.heartbeat_interval = url, heartbeat_interval
        self.max_wait, self.max_body = max_wait, max_body
        # no read timeout: a generation may stream for as long as it takes
        self.timeout = timeout or httpx.Timeout(None, connect=5.0)
        self.client: httpx.AsyncClient | None = None
        self.in_flight = self.requests = self.retries = self.waited = self.refused = 0
        self._nc: Any = None
        self._tasks: list[asyncio.Task] = []

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Open the upstream client, read the fleet's last heartbeats, follow new ones."""
        self.client = httpx.AsyncClient(timeout=self.timeout, follow_redirects=False,
                                        limits=httpx.Limits(max_connections=None,
                                                            max_keepalive_connections=64))
        if self.nats_url is None:
            return
        self._nc = await announce.connect(self.nats_url, name=f"stitch-gateway-{self.id}")
        js = self._nc.jetstream()
        await self._nc.subscribe(announce.engines_subject(self.run), cb=self._on_heartbeat)
        now = time.time()
        for hb in await announce.fleet(js, self.run):
            self.table.observe(hb, age=now - hb.time)
        try:
            await announce.ensure_gateways_stream(js, self.run)
        except Exception as e:  # noqa: BLE001 - e.g. no right to create it: route anyway
            log.warning("gateway %s: no heartbeats of its own (stitch status will not list it):"
                        " %s", self.id, e)
        else:
            self._tasks.append(asyncio.create_task(self._heartbeats(js)))
        self._tasks.append(asyncio.create_task(self._prune()))
        log.info("gateway %s: run %s, %d engine(s) routable", self.id, self.run,
                 len(self.table.live()))

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks.clear()
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
            hb = Heartbeat.model_validate_json(msg.data)
        except ValueError as e:
            log.warning("gateway: malformed heartbeat on %s: %s", msg.subject,
                        str(e).splitlines()[0])
            return
        self.table.observe(hb)

    async def _prune(self) -> None:
        while True:
            self.table.prune()
            await asyncio.sleep(self.table.ttl)

    async def _heartbeats(self, js: Any) -> None:
        while True:
            st = self.status()
            with contextlib.suppress(Exception):
                await announce.publish_gateway_heartbeat(js, announce.GatewayHeartbeat(
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
            waited_total=self.waited, refused_total=self.refused)

    # ------------------------------------------------------------------ ASGI

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":  # WebSockets are not proxied
            return
        path, method = scope.get("path", ""), scope.get("method", "GET")
        if method == "GET" and path == STATUS_PATH:
            await send_json(send, 200, self.status().model_dump())
        elif method == "GET" and path == METRICS_PATH:
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
        """One request: pick an engine (waiting if allowed), retry 409s elsewhere, stream back."""
        run_header = protocol.response_headers(self.run, None, None)
        anthropic = scope.get("path", "").startswith("/v1/messages")
        try:
            req = protocol.parse_request(scope.get("headers", []), self.max_wait)
        except protocol.BadRequest as e:
            await send_json(send, 400, _dialect(anthropic, protocol.bad_request_body(str(e))),
                            run_header)
            return
        body = await _read_body(receive, self.max_body)
        if body is None:
            await send_json(send, 413, protocol.bad_request_body(
                f"request body over {self.max_body} bytes"), run_header)
            return
        deadline = time.monotonic() + req.wait
        tried: dict[str, float] = {}  # engine id -> heartbeat time when it refused
        last_409: tuple[httpx.Response, bytes, str] | None = None
        waited = False
        for attempt in range(MAX_ATTEMPTS):
            found = self.table.candidates(req, tried)
            if not found and time.monotonic() < deadline and not self.table.passed(req):
                self.waited += not waited
                waited = True
                found = await self.table.wait_candidates(req, deadline, tried)
            if not found:
                break
            engine = found[0]
            tried[engine.id] = engine.hb.time
            if attempt:
                self.retries += 1
            engine.in_flight += 1
            engine.requests += 1
            try:
                resp = await self._send(scope, engine.hb.url or "", body, deadline)
            except httpx.TransportError as e:  # nothing was answered: another engine
                engine.errors += 1
                engine.in_flight -= 1
                log.warning("gateway: engine %s (%s) failed: %r", engine.id, engine.hb.url, e)
                continue
            try:
                if resp.status_code == 409:
                    raw = b"".join([c async for c in resp.aiter_raw()])  # as sent
                    if _not_ready(raw):
                        engine.refused += 1
                        last_409 = (resp, raw, engine.id)
                        continue
                    await _answer(send, resp, engine.id, raw)
                else:
                    await self._stream(resp, engine.id, receive, send)
                return
            finally:
                engine.in_flight -= 1
                await resp.aclose()
        if last_409 is not None:  # the last engine's own refusal, as it said it
            resp, raw, eid = last_409
            await _answer(send, resp, eid, raw)
            return
        self.refused += 1
        status, err = self.table.refusal(req)
        await send_json(send, status, _dialect(anthropic, err),
                        [(b"retry-after", b"1"), *run_header])

    async def _send(self, scope: Scope, base: str, body: bytes,
                    deadline: float) -> httpx.Response:
        assert self.client is not None, "the gateway was not started"
        headers = [(k, v) for k, v in scope.get("headers", [])
                   if k.lower().decode("latin-1") not in _HOP
                   and k.lower() != protocol.WAIT_HEADER.lower().encode()]
        left = deadline - time.monotonic()
        if left > 0:  # what is left of the wait, for the engine's own catch-up
            headers.append((protocol.WAIT_HEADER.lower().encode(), f"{left:.3f}".encode()))
        path = scope.get("raw_path") or scope.get("path", "/").encode()
        query = scope.get("query_string", b"")
        url = base.rstrip("/") + path.decode("latin-1") + ("?" + query.decode("latin-1")
                                                           if query else "")
        request = self.client.build_request(scope.get("method", "GET"), url, headers=headers,
                                            content=body)
        return await self.client.send(request, stream=True)

    async def _stream(self, resp: httpx.Response, engine: str, receive: Receive,
                      send: Send) -> None:
        """Send `resp` on as it comes (no buffering); stop reading it if the client leaves."""
        await send({"type": "http.response.start", "status": resp.status_code,
                    "headers": _headers(resp, engine)})

        async def relay() -> None:
            async for chunk in resp.aiter_raw():
                if chunk:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        async def gone() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        relay_t, gone_t = asyncio.ensure_future(relay()), asyncio.ensure_future(gone())
        try:
            await asyncio.wait({relay_t, gone_t}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (relay_t, gone_t):
                t.cancel()
            with contextlib.suppress(asyncio.CancelledError, OSError, httpx.HTTPError):
                await relay_t  # its error, if any, surfaces (the client gets a cut stream)
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await gone_t


def _headers(resp: httpx.Response, engine: str) -> list[tuple[bytes, bytes]]:
    out = [(k, v) for k, v in resp.headers.raw
           if k.lower() not in (b"connection", b"keep-alive", b"transfer-encoding", b"date",
                                b"server")]
    out.append((ENGINE_HEADER.lower().encode(), engine.encode("latin-1", "replace")))
    return out


async def _answer(send: Send, resp: httpx.Response, engine: str, raw: bytes) -> None:
    """A response already read whole (`raw`: as sent, content-encoding kept), sent on."""
    await send({"type": "http.response.start", "status": resp.status_code,
                "headers": _headers(resp, engine)})
    await send({"type": "http.response.body", "body": raw, "more_body": False})


def _not_ready(raw: bytes) -> bool:
    """Whether a 409's body is a Stitch refusal (any dialect), i.e. another engine may serve."""
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return False
    return isinstance(obj, dict) and protocol.parse_not_ready(obj) is not None


def _dialect(anthropic: bool, body: dict) -> dict:
    return {"type": "error", **body} if anthropic else body


async def _read_body(receive: Receive, limit: int) -> bytes | None:
    """The whole request body (kept to resend it to another engine), None if over `limit`."""
    parts, size = [], 0
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            break
        chunk = msg.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        parts.append(chunk)
        if not msg.get("more_body"):
            break
    return b"".join(parts)


def serve(gateway: Gateway, host: str, port: int) -> None:
    """Run `gateway` under uvicorn until interrupted."""
    import uvicorn

    uvicorn.run(gateway, host=host, port=port, lifespan="on", log_level="info",
                timeout_keep_alive=30)
