"""StitchASGI: the Stitch protocol (docs/protocol.md) as a pure ASGI middleware over a VersionGate.

It wraps any OpenAI-compatible ASGI app (vLLM's and SGLang's FastAPI apps) without importing a
framework. On the version-controlled routes (`stitch_core.serve.routes.Route`: by default POST on
`protocol.DEFAULT_PATHS`; engine adapters find theirs in the app's route table at start-up) it
parses the Stitch request headers, admits the request through the gate (HTTP 400 / 409 when it
cannot), salts the prefix cache with the admitted version, and marks the answer with the versions
that produced it: response headers and a ``"stitch"`` field in the JSON body, or, for SSE streams,
one extra event right before ``data: [DONE]`` (at the end of streams without one), or, for NDJSON
streams, the field on the ``"done": true`` line; all in the route's dialect (OpenAI, Responses,
Anthropic). Routes that generate but cannot be stamped (``control="refuse"``, e.g. WebSockets) are
refused while the engine holds no proven version. ``GET /stitch/status`` is answered here. Other
paths and scope types pass through; override `lifespan` to hook startup/shutdown, `set_guard` to
put the engine's own authentication in front of admission.

Over 400 lines: the middleware's request, streaming and stamping paths share one state machine
per request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any

from stitch_core.serve import protocol
from stitch_core.serve.gate import NotReady, Ticket, VersionGate
from stitch_core.serve.routes import WEBSOCKET, Dialect, Route, RouteTable
from stitch_core.settings import Settings

log = logging.getLogger("stitch.asgi")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
GateSource = VersionGate | Callable[[], VersionGate | None]

_EVENT_END = re.compile(rb"\r\n\r\n|\n\n|\r\r")
_LINE = re.compile(r"\r\n|\n|\r")
_DONE = "[DONE]"
_COPIED = ("id", "object", "created", "model", "request_id")
_NDJSON = ("application/x-ndjson", "application/jsonl", "application/json-seq")




class BodyTooLarge(ValueError):
    """A version-controlled request's body is over the middleware's limit (answered 413)."""


class StreamStopped(OSError):
    """Raised to the inner app from `send` once the middleware ended its response, as a client
    disconnect is signalled under ASGI spec 2.4 (frameworks then cancel the generation)."""


def _spec_version(scope: Scope) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in str(scope.get("asgi", {}).get("spec_version", "2.0"))
                     .split("."))
    except ValueError:
        return (2, 0)


def _header(headers: Iterable[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    for k, v in headers:
        if k.lower() == name:
            return v
    return None


def _without(headers: Iterable[tuple[bytes, bytes]], *names: bytes) -> list[tuple[bytes, bytes]]:
    return [(k, v) for k, v in headers if k.lower() not in names]


def _media_type(headers: Iterable[tuple[bytes, bytes]]) -> str:
    ct = _header(headers, b"content-type") or b""
    return ct.split(b";", 1)[0].strip().lower().decode("latin-1")


def sse_data(event: bytes) -> str | None:
    """The data of one SSE event (its ``data:`` lines joined), None if it has none."""
    lines = [ln for ln in _LINE.split(event.decode("utf-8", "replace")) if ln.startswith("data:")]
    if not lines:
        return None
    return "\n".join(ln[6:] if ln.startswith("data: ") else ln[5:] for ln in lines)


def sse_event(obj: Any, event: str | None = None) -> bytes:
    """One SSE event (``data: ...`` and a blank line, after ``event: <event>`` if given): a string
    as is, anything else as JSON."""
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {data}\n\n".encode()


def error_body(dialect: Dialect, body: dict) -> dict:
    """A Stitch error body (``{"error": {...}}``) as the route's dialect sends errors: the
    Anthropic API adds ``"type": "error"`` at the top."""
    return {"type": "error", **body} if dialect == "anthropic" else body


def route_path(scope: Scope) -> str:
    """The request path without the app's ``root_path`` (how routes are matched)."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


def salt_body(body: bytes, run: str, version: int | None) -> bytes | None:
    """`body` with ``cache_salt`` set for `version` (a user salt kept in front; a list of strings,
    one per prompt, is salted item by item), or None when the body is not a JSON object (or its
    cache_salt is neither: the app will judge it)."""
    try:
        obj = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(obj, dict):
        return None
    user = obj.get("cache_salt")
    if isinstance(user, list) and user and all(isinstance(u, str) for u in user):
        # one salt per prompt of a batch (SGLang's native /generate)
        obj["cache_salt"] = [protocol.cache_salt(run, version, u or None) for u in user]
        return json.dumps(obj, ensure_ascii=False).encode()
    if user is not None and not isinstance(user, str):
        return None
    obj["cache_salt"] = protocol.cache_salt(run, version, user or None)
    return json.dumps(obj, ensure_ascii=False).encode()


async def send_json(send: Send, status: int, body: Any,
                    headers: Iterable[tuple[bytes, bytes]] = ()) -> None:
    """Send a complete JSON answer with `status` (and extra `headers`) through `send`."""
    data = json.dumps(body, default=str).encode()
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
        *headers]})
    await send({"type": "http.response.body", "body": data, "more_body": False})


class StitchASGI:
    """ASGI middleware implementing the Stitch protocol on top of a `VersionGate`.

    `gate`: a VersionGate, or a zero-argument callable returning one or None (None: requests pass
    through untouched and the status path answers 503 ``{"state": "not_ready"}``).
    `paths`: POST paths under version control (OpenAI dialect, salted); `routes`: more
    (`Route`s, matched first). `salt`: set ``cache_salt`` in JSON bodies (of routes that take it).
    `status_path`: answered with the gate's status (None: not answered here).
    """

    def __init__(self, app: ASGIApp, gate: GateSource, *,
                 paths: Iterable[str] = protocol.DEFAULT_PATHS, routes: Iterable[Route] = (),
                 salt: bool = True, status_path: str | None = protocol.STATUS_PATH,
                 max_body: int | None = None):
        self.app = app
        self._gate = gate
        self.salt = salt
        self.max_body = max_body if max_body is not None else \
            Settings.read("max_body_bytes")  # STITCH_MAX_BODY_BYTES, e.g. 64MiB
        self.status_path = status_path
        self.set_routes([*routes, *(Route(p) for p in paths)])
        self.set_guard(None)

    def set_routes(self, routes: Iterable[Route]) -> None:
        """Replace the version-controlled routes (an engine adapter, from its app's table)."""
        self.routes = RouteTable(routes)
        self.paths = frozenset(r.path for r in self.routes)

    def set_guard(self, guard: Callable[[ASGIApp], ASGIApp] | None) -> None:
        """Put `guard(inner)` (the engine's own authentication around Stitch's handler) in front
        of admission on every version-controlled route: a request is admitted only once the
        engine would let it in. None: no guard."""
        self._entry: ASGIApp = guard(self._controlled) if guard is not None else self._controlled

    def get_gate(self) -> VersionGate | None:
        g = self._gate
        return g if isinstance(g, VersionGate) else g()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            await self.http(scope, receive, send)
        elif kind == "websocket" and self.routes.find(WEBSOCKET, route_path(scope)) is not None:
            await self._entry(scope, receive, send)
        elif kind == "lifespan":
            await self.lifespan(scope, receive, send)
        else:
            await self.app(scope, receive, send)

    async def lifespan(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Lifespan scope: passed to the app (override to start/stop an engine coordinator)."""
        await self.app(scope, receive, send)

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        path, method = route_path(scope), scope.get("method", "GET")
        if self.status_path is not None and path == self.status_path and method == "GET":
            await self.status(scope, receive, send)
            return
        if self.routes.find(method, path) is None or self.get_gate() is None:
            await self.app(scope, receive, send)
            return
        await self._entry(scope, receive, send)

    async def _controlled(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A request on a version-controlled route (past the guard, if any)."""
        ws = scope["type"] == "websocket"
        route = self.routes.find(WEBSOCKET if ws else scope.get("method", "GET"),
                                 route_path(scope))
        gate = self.get_gate()
        if route is None or gate is None:
            await self.app(scope, receive, send)
        elif route.control == "refuse":
            await self.refuse_unready(gate, route, scope, receive, send)
        else:
            await self.serve(gate, scope, receive, send, route)

    async def refuse_unready(self, gate: VersionGate, route: Route, scope: Scope,
                             receive: Receive, send: Send) -> None:
        """A route that generates but cannot be stamped: 409 while the engine holds no proven
        version (a WebSocket: the handshake is refused), 400 for version headers (they cannot be
        honoured there), otherwise passed through untouched."""
        run_header = protocol.response_headers(gate.run, None, None)
        status, body, extra = 0, {}, []
        try:
            req = protocol.parse_request(scope.get("headers", []), gate.max_wait)
            if req.exact is not None or req.minimum is not None:
                raise protocol.BadRequest(
                    f"{route.path} generates but its answers cannot be stamped: it takes no "
                    f"{protocol.VERSION_HEADER} / {protocol.MIN_VERSION_HEADER}")
            gate.release(await gate.admit())  # refused while no version is proven
        except protocol.BadRequest as e:
            status, body = 400, protocol.bad_request_body(str(e))
        except NotReady as e:
            status, body = 409, e.body
            extra = [(b"retry-after", str(e.retry_after).encode())]
        if not status:
            await self.app(scope, receive, send)
        elif scope["type"] == "websocket":
            await _refuse_websocket(scope, send, status, body, [*extra, *run_header])
        else:
            await send_json(send, status, error_body(route.dialect, body), [*extra, *run_header])

    async def status(self, scope: Scope, receive: Receive, send: Send) -> None:
        gate = self.get_gate()
        if gate is None:
            body: dict = {"run": None, "version": None, "latest": None, "lag": None,
                          "state": "not_ready", "mode": None}
        else:
            body = gate.status()
        body["routes"] = [r.describe() for r in self.routes]
        await send_json(send, 503 if body.get("state") == "not_ready" else 200, body)

    async def serve(self, gate: VersionGate, scope: Scope, receive: Receive, send: Send,
                    route: Route | None = None) -> None:
        """One request on a version-controlled route (default: OpenAI dialect, salted)."""
        route = route or Route(route_path(scope), frozenset({scope.get("method", "POST")}))
        run_header = protocol.response_headers(gate.run, None, None)
        try:
            req = protocol.parse_request(scope.get("headers", []), gate.max_wait)
        except protocol.BadRequest as e:
            await send_json(send, 400, error_body(route.dialect, protocol.bad_request_body(
                str(e))), run_header)
            return
        try:
            ticket = await gate.admit(req.exact, req.minimum, req.wait)
        except NotReady as e:
            await send_json(send, 409, error_body(route.dialect, e.body), [
                (b"retry-after", str(e.retry_after).encode()), *run_header])
            return
        exchange = _Exchange(gate, ticket, send, _spec_version(scope), route.dialect)
        try:
            if (self.salt and route.salt) or route.dialect == "responses":
                salt = self.salt and route.salt
                try:
                    scope, receive, body = await self._salted(scope, receive, gate.run,
                                                              ticket.start, salt)
                except BodyTooLarge as e:
                    await send_json(send, 413, protocol.bad_request_body(str(e)), run_header)
                    return
                if route.dialect == "responses" and _background(body):
                    # it would generate after this answer, unstamped: refused
                    await send_json(send, 400, protocol.bad_request_body(
                        "background responses cannot be version-controlled (their tokens are "
                        "generated after the answer that would name their versions)"),
                        run_header)
                    return
            if ticket.exact is not None:  # may be cut: the app must be able to see a disconnect
                receive = exchange.receive_from(receive)
            try:
                await self.app(scope, receive, exchange.send)
            except Exception as e:
                if not exchange.stopped:
                    raise
                log.debug("inner app ended after its stream was stopped: %r", e)
        finally:
            gate.release(ticket)

    async def _salted(self, scope: Scope, receive: Receive, run: str, version: int | None,
                      salt: bool = True) -> tuple[Scope, Receive, bytes]:
        """Read the request body and replay it, with ``cache_salt`` set when `salt` and it is a
        JSON object; also returns the body as the client sent it."""
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] != "http.request":  # disconnected while sending its body
                async def gone(msg: Message = msg) -> Message:
                    return msg
                return scope, gone, b""
            chunks.append(msg.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body:
                raise BodyTooLarge(f"request body over {self.max_body:,} bytes (the most this "
                                   "server reads to version-control a request; "
                                   "STITCH_MAX_BODY_BYTES)")
            if not msg.get("more_body", False):
                break
        body = sent = b"".join(chunks)
        salted = salt_body(body, run, version) if salt else None
        if salted is not None:
            body = salted
            headers = _without(scope.get("headers", []), b"content-length", b"transfer-encoding")
            scope = {**scope, "headers": [*headers, (b"content-length", str(len(body)).encode())]}
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return scope, replay, sent


def _background(body: bytes) -> bool:
    """Whether a Responses API request asks to run in the background."""
    try:
        obj = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return False
    return isinstance(obj, dict) and obj.get("background") is True


async def _refuse_websocket(scope: Scope, send: Send, status: int, body: dict,
                            headers: list[tuple[bytes, bytes]]) -> None:
    """Refuse a WebSocket handshake: an HTTP answer where the server can send one (the
    ``websocket.http.response`` extension), else a close (code 1013, try again later)."""
    if "websocket.http.response" in (scope.get("extensions") or {}):
        data = json.dumps(body).encode()
        await send({"type": "websocket.http.response.start", "status": status, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
            *headers]})
        await send({"type": "websocket.http.response.body", "body": data, "more_body": False})
    else:
        await send({"type": "websocket.close", "code": 1013 if status == 409 else 1008,
                    "reason": body["error"]["message"][:120]})


class _Exchange:
    """The response side of one admitted request: marks, rewrites or cuts what the app sends.

    Once the middleware has ended a response itself (`stopped`), the app is told the client went
    away, the way its ASGI spec version says: `receive` answers ``http.disconnect`` (spec < 2.4:
    Starlette's disconnect listener then cancels the stream at its current await) and, under spec
    2.4, `send` raises :class:`StreamStopped` (an OSError); otherwise further sends are dropped.
    """

    def __init__(self, gate: VersionGate, ticket: Ticket, send: Send,
                 spec_version: tuple[int, ...] = (2, 0), dialect: Dialect = "openai"):
        self.gate, self.ticket, self._send = gate, ticket, send
        self.dialect = dialect
        self._raise_on_send = spec_version >= (2, 4)
        self._stop = asyncio.Event()
        self.mode: str | None = None  # "stream", "lines" (NDJSON) or "buffer" once started
        self.stopped = False  # the middleware ended the response
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self._chunks: list[bytes] = []
        self._pending = b""
        self._last: dict | None = None  # last JSON chunk of a stream
        self._seq: int | None = None  # last sequence_number of a Responses stream
        self._marked = False  # the stream's "stitch" chunk went out

    @property
    def run(self) -> str:
        return self.gate.run

    def _pinned_violated(self) -> bool:
        return self.ticket.exact is not None and self.gate.violated(self.ticket)

    def receive_from(self, receive: Receive) -> Receive:
        """`receive`, answering ``http.disconnect`` once the response was stopped."""

        async def wrapped() -> Message:
            if self.stopped:
                return {"type": "http.disconnect"}
            inner = asyncio.ensure_future(receive())
            stop = asyncio.ensure_future(self._stop.wait())
            try:
                await asyncio.wait({inner, stop}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                stop.cancel()
                if not inner.done():
                    inner.cancel()
            if inner.done() and not inner.cancelled():
                return inner.result()
            return {"type": "http.disconnect"}

        return wrapped

    def _stopping(self) -> None:
        self.stopped = True
        self._stop.set()

    async def send(self, message: Message) -> None:
        if self.stopped:
            if self._raise_on_send:
                raise StreamStopped("the Stitch middleware ended this response")
            return
        kind = message["type"]
        if kind == "http.response.start":
            await self._start(message)
        elif kind == "http.response.body" and self.mode == "stream":
            await self._stream_body(message)
        elif kind == "http.response.body" and self.mode == "lines":
            await self._lines_body(message)
        elif kind == "http.response.body" and self.mode == "buffer":
            await self._buffer_body(message)
        else:
            await self._send(message)

    async def _start(self, message: Message) -> None:
        self.status = int(message["status"])
        self.headers = list(message.get("headers", []))
        media = _media_type(self.headers)
        if self.status == 200 and (media == "text/event-stream" or media in _NDJSON):
            self.mode = "stream" if media == "text/event-stream" else "lines"
            if self._pinned_violated():  # moved before the first byte: a plain 409
                await self._refuse_changed()
                return
            headers = _without(self.headers, b"content-length")
            headers += protocol.response_headers(self.run, self.ticket.start,
                                                 self.gate.current_end())
            await self._send({**message, "headers": headers})
        else:
            self.mode = "buffer"  # sent when complete, with the final version_end

    async def _refuse_changed(self) -> None:
        start, end = self.gate.release(self.ticket)
        e = self.gate.version_changed(self.ticket)
        self._stopping()
        await send_json(self._send, 409, error_body(self.dialect, e.body), [
            (b"retry-after", str(e.retry_after).encode()),
            *protocol.response_headers(self.run, start, end)])

    async def _buffer_body(self, message: Message) -> None:
        self._chunks.append(message.get("body", b""))
        if message.get("more_body", False):
            return
        body = b"".join(self._chunks)
        self._chunks = []
        start, end = self.gate.release(self.ticket)
        if self.status == 200 and self._pinned_violated():
            await self._refuse_changed()
            return
        headers = self.headers
        if self.status == 200 and _media_type(headers) == "application/json":
            try:
                obj = json.loads(body)
            except (ValueError, UnicodeDecodeError):
                obj = None
            if isinstance(obj, dict):
                obj[protocol.RESPONSE_FIELD] = protocol.stitch_field(self.run, start, end)
                body = json.dumps(obj, ensure_ascii=False).encode()
                headers = [*_without(headers, b"content-length"),
                           (b"content-length", str(len(body)).encode())]
        headers = [*headers, *protocol.response_headers(self.run, start, end)]
        await self._send({"type": "http.response.start", "status": self.status,
                          "headers": headers})
        await self._send({"type": "http.response.body", "body": body, "more_body": False})

    async def _stream_body(self, message: Message) -> None:
        more = message.get("more_body", False)
        if self._pinned_violated():
            await self._cut()
            return
        self._pending += message.get("body", b"")
        out: list[bytes] = []
        pos = 0
        for m in _EVENT_END.finditer(self._pending):
            event = self._pending[pos:m.end()]
            pos = m.end()
            if not await self._event(event, out):
                return
        self._pending = self._pending[pos:]
        if not more:
            rest, self._pending = self._pending, b""
            if rest.strip() and sse_data(rest) == _DONE:
                if not await self._event(rest, out):
                    return
            else:
                if rest.strip():
                    out.append(rest if rest.endswith((b"\n", b"\r")) else rest + b"\n\n")
                if not self._marked and not await self._mark(out):
                    return
        if out or not more:
            await self._send({"type": "http.response.body", "body": b"".join(out),
                              "more_body": more})

    async def _event(self, event: bytes, out: list[bytes]) -> bool:
        """Queue one complete SSE event (the "stitch" chunk before [DONE]); False if cut."""
        data = sse_data(event)
        if data == _DONE:
            if not self._marked and not await self._mark(out):
                return False
        elif data is not None:
            try:
                obj = json.loads(data)
            except ValueError:
                obj = None
            if isinstance(obj, dict):
                self._last = obj
                if isinstance(obj.get("sequence_number"), int):
                    self._seq = obj["sequence_number"]
        out.append(event)
        return True

    async def _mark(self, out: list[bytes]) -> bool:
        """Queue the "stitch" chunk (the request is complete here); False if cut instead."""
        start, end = self.gate.release(self.ticket)
        if self._pinned_violated():
            await self._cut()  # drops this message's events too: they may be the new version's
            return False
        field = protocol.stitch_field(self.run, start, end)
        if self.dialect == "responses":  # a typed event after the others
            ev: dict[str, Any] = {"type": "response.stitch"}
            if self._seq is not None:
                ev["sequence_number"] = self._seq + 1
            out.append(sse_event({**ev, protocol.RESPONSE_FIELD: field}, "response.stitch"))
        elif self.dialect == "anthropic":  # a named event (clients skip unknown ones)
            out.append(sse_event({"type": "stitch", protocol.RESPONSE_FIELD: field}, "stitch"))
        else:
            chunk = {k: self._last[k] for k in _COPIED if self._last and k in self._last}
            chunk["choices"] = []
            chunk[protocol.RESPONSE_FIELD] = field
            out.append(sse_event(chunk))
        self._marked = True
        return True

    def _cut_events(self, body: dict) -> bytes:
        """The stream's version_changed error, in its dialect."""
        if self.mode == "lines":
            return json.dumps(body).encode() + b"\n"
        if self.dialect == "responses":
            err = body["error"]
            ev = {"type": "error", "code": err["type"], "message": err["message"], "param": None,
                  **({"sequence_number": self._seq + 1} if self._seq is not None else {}),
                  "error": err}
            return sse_event(ev, "error")
        if self.dialect == "anthropic":
            return sse_event(error_body("anthropic", body), "error")
        return sse_event(body) + sse_event(_DONE)

    async def _cut(self) -> None:
        """End the stream with the version_changed error (then [DONE] where the dialect has it);
        the app's further sends raise StreamStopped."""
        self.gate.release(self.ticket)
        e = self.gate.version_changed(self.ticket)
        self._stopping()
        body = self._cut_events(e.body)
        await self._send({"type": "http.response.body", "body": body, "more_body": False})
        if self._raise_on_send:
            raise StreamStopped("exact-pinned version changed mid-stream")

    async def _lines_body(self, message: Message) -> None:
        """An NDJSON stream: lines pass as they come; the ``"done": true`` line gets the
        "stitch" field (a stream without one ends with a ``{"stitch": ...}`` line)."""
        more = message.get("more_body", False)
        if self._pinned_violated():
            await self._cut()
            return
        self._pending += message.get("body", b"")
        *lines, self._pending = self._pending.split(b"\n")
        if not more and self._pending.strip():
            lines.append(self._pending)
        if not more:
            self._pending = b""
        out: list[bytes] = []
        for line in lines:
            obj = _json_line(line) if not self._marked else None
            if obj is not None and obj.get("done") is True:
                start, end = self.gate.release(self.ticket)
                if self._pinned_violated():
                    await self._cut()
                    return
                obj[protocol.RESPONSE_FIELD] = protocol.stitch_field(self.run, start, end)
                line = json.dumps(obj, ensure_ascii=False).encode()
                self._marked = True
            out.append(line + b"\n")
        if not more and not self._marked:
            start, end = self.gate.release(self.ticket)
            if self._pinned_violated():
                await self._cut()
                return
            out.append(json.dumps({protocol.RESPONSE_FIELD: protocol.stitch_field(
                self.run, start, end)}).encode() + b"\n")
            self._marked = True
        if out or not more:
            await self._send({"type": "http.response.body", "body": b"".join(out),
                              "more_body": more})


def _json_line(line: bytes) -> dict | None:
    try:
        obj = json.loads(line)
    except (ValueError, UnicodeDecodeError):
        return None
    return obj if isinstance(obj, dict) else None
