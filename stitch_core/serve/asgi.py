"""StitchASGI: the Stitch protocol (docs/protocol.md) as a pure ASGI middleware over a VersionGate.

It wraps any OpenAI-compatible ASGI app (vLLM's and SGLang's FastAPI apps) without importing a
framework, and decides for each request whether and at which version it runs. On the
version-controlled routes (`stitch_core.serve.route_table.Route`: by default POST on
`protocol.DEFAULT_PATHS`; engine adapters find theirs in the app's route table at start-up) it
parses the Stitch request headers, admits the request through the gate (HTTP 400 / 409 when it
cannot), salts the prefix cache with the admitted version and hands the app's answer to
`stitch_core.serve.stamping.Exchange`, which marks it with the versions that produced it (response
headers and a ``"stitch"`` field in the JSON body or the stream, in the route's dialect). Routes
that generate but cannot be stamped (``control="refuse"``, e.g. WebSockets) are refused while the
engine holds no proven version. ``GET /stitch/status`` is answered here. Other paths and scope
types pass through; override `lifespan` to hook startup/shutdown, `set_guard` to put the engine's
own authentication in front of admission.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable

from stitch_core.errors import StitchError
from stitch_core.serve import protocol, spans
from stitch_core.serve.asgi_types import (
    ASGIApp,
    Message,
    Receive,
    Scope,
    Send,
    send_json,
    without_headers,
)
from stitch_core.serve.gate import NotReadyError, VersionGate
from stitch_core.serve.route_table import WEBSOCKET, Route, RouteTable
from stitch_core.serve.spans import SpanSink
from stitch_core.serve.stamping import Exchange, error_body
from stitch_core.settings import Settings

log = logging.getLogger("stitch.asgi")

GateSource = VersionGate | Callable[[], VersionGate | None]


class BodyTooLargeError(StitchError, ValueError):
    """A version-controlled request's body is over the middleware's limit (answered 413)."""


def _spec_version(scope: Scope) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in str(scope.get("asgi", {}).get("spec_version", "2.0"))
                     .split("."))
    except ValueError:
        return (2, 0)


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
                raise protocol.BadRequestError(
                    f"{route.path} generates but its answers cannot be stamped: it takes no "
                    f"{protocol.VERSION_HEADER} / {protocol.MIN_VERSION_HEADER}")
            gate.release(await gate.admit())  # refused while no version is proven
        except protocol.BadRequestError as e:
            status, body = 400, protocol.bad_request_body(str(e))
        except NotReadyError as e:
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
        except protocol.BadRequestError as e:
            await send_json(send, 400, error_body(route.dialect, protocol.bad_request_body(
                str(e))), run_header)
            return
        try:
            ticket = await gate.admit(req.exact, req.minimum, req.wait)
        except NotReadyError as e:
            await send_json(send, 409, error_body(route.dialect, e.body), [
                (b"retry-after", str(e.retry_after).encode()), *run_header])
            return
        sink = SpanSink()  # the engine plugin records the outputs' version spans here
        exchange = Exchange(gate, ticket, send, _spec_version(scope), route.dialect, sink)
        try:
            if (self.salt and route.salt) or route.dialect == "responses":
                salt = self.salt and route.salt
                try:
                    scope, receive, body = await self._salted(scope, receive, gate.run,
                                                              ticket.start, salt)
                except BodyTooLargeError as e:
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
            bound = spans.bind(sink)
            try:
                await self.app(scope, receive, exchange.send)
            except Exception as e:
                if not exchange.stopped:
                    raise
                log.debug("inner app ended after its stream was stopped: %r", e)
            finally:
                spans.unbind(bound)
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
                raise BodyTooLargeError(f"request body over {self.max_body:,} bytes (the most this "
                                   "server reads to version-control a request; "
                                   "STITCH_MAX_BODY_BYTES)")
            if not msg.get("more_body", False):
                break
        body = sent = b"".join(chunks)
        salted = salt_body(body, run, version) if salt else None
        if salted is not None:
            body = salted
            headers = without_headers(scope.get("headers", []), b"content-length",
                                      b"transfer-encoding")
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
