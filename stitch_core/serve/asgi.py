"""StitchASGI: the Stitch protocol (docs/protocol.md) as a pure ASGI middleware over a VersionGate.

It wraps any OpenAI-compatible ASGI app (vLLM's and SGLang's FastAPI apps) without importing a
framework. On the configured completion paths (POST) it parses the Stitch request headers, admits
the request through the gate (HTTP 400 / 409 when it cannot), salts the prefix cache with the
admitted version, and marks the answer with the versions that produced it: response headers and a
``"stitch"`` field in the JSON body, or, for SSE streams, one extra chunk right before
``data: [DONE]``. ``GET /stitch/status`` is answered here. Other paths and scope types pass
through; override `lifespan` to hook startup/shutdown.

Slightly over 400 lines: the middleware's request, streaming and stamping paths share one
state machine per request.
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
_COPIED = ("id", "object", "created", "model")


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


def sse_event(obj: Any) -> bytes:
    """One SSE event (``data: ...`` and a blank line): a string as is, anything else as JSON."""
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)
    return f"data: {data}\n\n".encode()


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
    `paths`: POST paths under version control. `salt`: set ``cache_salt`` in their JSON bodies.
    `status_path`: answered with the gate's status (None: not answered here).
    """

    def __init__(self, app: ASGIApp, gate: GateSource, *,
                 paths: Iterable[str] = protocol.DEFAULT_PATHS, salt: bool = True,
                 status_path: str | None = protocol.STATUS_PATH):
        self.app = app
        self._gate = gate
        self.paths = frozenset(paths)
        self.salt = salt
        self.status_path = status_path

    def get_gate(self) -> VersionGate | None:
        g = self._gate
        return g if isinstance(g, VersionGate) else g()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            await self.http(scope, receive, send)
        elif kind == "lifespan":
            await self.lifespan(scope, receive, send)
        else:
            await self.app(scope, receive, send)

    async def lifespan(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Lifespan scope: passed to the app (override to start/stop an engine coordinator)."""
        await self.app(scope, receive, send)

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        path, method = scope.get("path", ""), scope.get("method", "GET")
        if self.status_path is not None and path == self.status_path and method == "GET":
            await self.status(scope, receive, send)
            return
        gate = self.get_gate() if method == "POST" and path in self.paths else None
        if gate is None:
            await self.app(scope, receive, send)
            return
        await self.serve(gate, scope, receive, send)

    async def status(self, scope: Scope, receive: Receive, send: Send) -> None:
        gate = self.get_gate()
        if gate is None:
            body: dict = {"run": None, "version": None, "latest": None, "lag": None,
                          "state": "not_ready", "mode": None}
        else:
            body = gate.status()
        await send_json(send, 503 if body.get("state") == "not_ready" else 200, body)

    async def serve(self, gate: VersionGate, scope: Scope, receive: Receive, send: Send) -> None:
        """One request on a version-controlled path."""
        run_header = protocol.response_headers(gate.run, None, None)
        try:
            req = protocol.parse_request(scope.get("headers", []), gate.max_wait)
        except protocol.BadRequest as e:
            await send_json(send, 400, protocol.bad_request_body(str(e)), run_header)
            return
        try:
            ticket = await gate.admit(req.exact, req.minimum, req.wait)
        except NotReady as e:
            await send_json(send, 409, e.body, [
                (b"retry-after", str(e.retry_after).encode()), *run_header])
            return
        exchange = _Exchange(gate, ticket, send, _spec_version(scope))
        try:
            if self.salt:
                scope, receive = await self._salted(scope, receive, gate.run, ticket.start)
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

    async def _salted(self, scope: Scope, receive: Receive, run: str,
                      version: int | None) -> tuple[Scope, Receive]:
        """Read the request body and replay it with ``cache_salt`` set (when a JSON object)."""
        chunks = []
        while True:
            msg = await receive()
            if msg["type"] != "http.request":  # disconnected while sending its body
                async def gone(msg: Message = msg) -> Message:
                    return msg
                return scope, gone
            chunks.append(msg.get("body", b""))
            if not msg.get("more_body", False):
                break
        body = b"".join(chunks)
        salted = salt_body(body, run, version)
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

        return scope, replay


class _Exchange:
    """The response side of one admitted request: marks, rewrites or cuts what the app sends.

    Once the middleware has ended a response itself (`stopped`), the app is told the client went
    away, the way its ASGI spec version says: `receive` answers ``http.disconnect`` (spec < 2.4:
    Starlette's disconnect listener then cancels the stream at its current await) and, under spec
    2.4, `send` raises :class:`StreamStopped` (an OSError); otherwise further sends are dropped.
    """

    def __init__(self, gate: VersionGate, ticket: Ticket, send: Send,
                 spec_version: tuple[int, ...] = (2, 0)):
        self.gate, self.ticket, self._send = gate, ticket, send
        self._raise_on_send = spec_version >= (2, 4)
        self._stop = asyncio.Event()
        self.mode: str | None = None  # "stream" or "buffer" once the response started
        self.stopped = False  # the middleware ended the response
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self._chunks: list[bytes] = []
        self._pending = b""
        self._last: dict | None = None  # last JSON chunk of a stream
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
        elif kind == "http.response.body" and self.mode == "buffer":
            await self._buffer_body(message)
        else:
            await self._send(message)

    async def _start(self, message: Message) -> None:
        self.status = int(message["status"])
        self.headers = list(message.get("headers", []))
        if self.status == 200 and _media_type(self.headers) == "text/event-stream":
            self.mode = "stream"
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
        await send_json(self._send, 409, e.body, [
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
        out.append(event)
        return True

    async def _mark(self, out: list[bytes]) -> bool:
        """Queue the "stitch" chunk (the request is complete here); False if cut instead."""
        start, end = self.gate.release(self.ticket)
        if self._pinned_violated():
            await self._cut()  # drops this message's events too: they may be the new version's
            return False
        chunk = {k: self._last[k] for k in _COPIED if self._last and k in self._last}
        chunk["choices"] = []
        chunk[protocol.RESPONSE_FIELD] = protocol.stitch_field(self.run, start, end)
        out.append(sse_event(chunk))
        self._marked = True
        return True

    async def _cut(self) -> None:
        """End the stream with the version_changed error event and [DONE]; the app's further
        sends raise StreamStopped."""
        self.gate.release(self.ticket)
        e = self.gate.version_changed(self.ticket)
        self._stopping()
        body = sse_event(e.body) + sse_event(_DONE)
        await self._send({"type": "http.response.body", "body": body, "more_body": False})
        if self._raise_on_send:
            raise StreamStopped("exact-pinned version changed mid-stream")
