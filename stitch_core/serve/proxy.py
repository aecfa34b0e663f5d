"""HTTP proxy mechanics of `stitch gateway` (stitch_core.serve.gateway routes; this forwards).

Kept apart so that each rule of a correct proxy is in one place:

* only origin-form request targets (``/path?query``) are forwarded (`origin_target`); the
  upstream URL is the engine's admitted base URL with that path and query set through httpx's
  URL API (`upstream_url`), so a target such as ``@127.0.0.1:9/admin`` can never turn the
  engine's address into user info and the request into one to another host;
* hop-by-hop headers (RFC 9110 §7.6.1: ``Connection``, the ones it names, ``Keep-Alive``,
  ``TE``, ``Transfer-Encoding``, ``Upgrade``, ``Proxy-*``, ``Trailer``) are dropped both ways
  (`end_to_end`);
* a body is read whole only up to a cap (`read_capped`): a 409 small enough to be a Stitch
  refusal is parsed, a larger one is relayed as any answer;
* a client that leaves is noticed at every await (`ClientGoneError`, `until_gone`), so waits end and
  upstream requests are cancelled (their connection closed: the engine aborts the generation).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
from collections.abc import AsyncIterator, Awaitable, Iterable
from typing import Literal, TypeVar

import httpx

from stitch_core.errors import StitchError
from stitch_core.serve import protocol
from stitch_core.serve.asgi_types import Receive, Scope, Send

Headers = list[tuple[bytes, bytes]]
_T = TypeVar("_T")

REFUSAL_MAX_BYTES = 64 << 10  # a 409 body read whole to see whether it is a Stitch refusal
HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-connection", b"proxy-authenticate",
                        b"proxy-authorization", b"te", b"trailer", b"transfer-encoding",
                        b"upgrade"})
# set again by httpx on the way up / by uvicorn on the way down
REQUEST_OWN = frozenset({b"host", b"content-length", protocol.WAIT_HEADER.lower().encode()})
RESPONSE_OWN = frozenset({b"date", b"server"})


class ClientGoneError(StitchError, ConnectionError):
    """The client disconnected before its answer was complete."""


def origin_target(scope: Scope) -> bytes | None:
    """The request target as sent (path and query, percent-encoding kept) if it is in origin
    form (starts with ``/``), else None (the gateway answers 400)."""
    raw = scope.get("raw_path") or scope.get("path", "").encode("latin-1", "replace")
    if not raw.startswith(b"/"):
        return None
    query = scope.get("query_string", b"")
    return raw + b"?" + query if query else raw


def upstream_url(base: httpx.URL, target: bytes) -> httpx.URL:
    """`target` (origin form) at the engine `base`: its scheme, host, port and path prefix."""
    return base.copy_with(raw_path=base.raw_path.rstrip(b"/") + target)


def end_to_end(headers: Iterable[tuple[bytes, bytes]],
               own: frozenset[bytes] = frozenset()) -> Headers:
    """`headers` less the hop-by-hop ones, those the ``Connection`` header names, and `own`."""
    headers = list(headers)
    named = {t.strip().lower() for k, v in headers if k.lower() == b"connection"
             for t in v.split(b",")}
    drop = HOP_BY_HOP | named | own
    return [(k, v) for k, v in headers if k.lower() not in drop]


def response_headers(resp: httpx.Response, engine_header: bytes, engine: str) -> Headers:
    """An engine's response headers to send on, plus the one naming the engine."""
    return [*end_to_end(resp.headers.raw, RESPONSE_OWN),
            (engine_header, engine.encode("latin-1", "replace"))]


async def read_capped(resp: httpx.Response,
                      cap: int) -> tuple[bytes, AsyncIterator[bytes] | None]:
    """The start of `resp`'s raw body (content-encoding kept): all of it and None if it is at
    most `cap` bytes, else what was read and the iterator with the rest."""
    parts: list[bytes] = []
    size = 0
    chunks = resp.aiter_raw()
    async for chunk in chunks:
        parts.append(chunk)
        size += len(chunk)
        if size > cap:
            return b"".join(parts), chunks
    return b"".join(parts), None


def refusal_kind(raw: bytes) -> Literal["refusal", "malformed"] | None:
    """What a 409 body is: a Stitch refusal (any dialect: another engine may serve), one that
    names the refusal type but not its fields ("malformed": that engine is skipped), or None
    (an ordinary answer, sent on as it is)."""
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(obj, dict):
        return None
    err = obj.get("error")
    if not isinstance(err, dict) or err.get("type") != protocol.NOT_READY_TYPE:
        return None
    try:
        return "refusal" if protocol.parse_not_ready(obj) is not None else None
    except ValueError:
        return "malformed"


async def send_response(send: Send, status: int, headers: Headers, head: bytes = b"",
                        rest: AsyncIterator[bytes] | None = None) -> None:
    """An answer: `head` (already read), then what `rest` yields as it comes (no buffering)."""
    await send({"type": "http.response.start", "status": status, "headers": headers})
    if head:
        await send({"type": "http.response.body", "body": head, "more_body": True})
    if rest is not None:
        async for chunk in rest:
            if chunk:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


def bearer_ok(scope: Scope, key: str | None) -> bool:
    """Whether the request carries ``Authorization: Bearer <key>`` (always, without a key);
    compared in constant time."""
    if key is None:
        return True
    got = b""
    for k, v in scope.get("headers", []):
        if k.lower() == b"authorization":
            got = v.strip()
    scheme, _, token = got.partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), key.encode())


async def read_body(receive: Receive, limit: int) -> bytes | None:
    """The whole request body (kept to resend it to another engine), None if over `limit`;
    ClientGoneError if the client left first."""
    parts, size = [], 0
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            raise ClientGoneError("the client left while sending its request")
        chunk = msg.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        parts.append(chunk)
        if not msg.get("more_body"):
            return b"".join(parts)


async def watch_disconnect(receive: Receive, gone: asyncio.Event) -> None:
    """Set `gone` when the client disconnects (run once the request body was read whole)."""
    while (await receive())["type"] != "http.disconnect":
        pass
    gone.set()


async def until_gone(aw: Awaitable[_T], gone: asyncio.Event) -> _T:
    """`aw`'s result, unless the client leaves first: then `aw` is cancelled (an upstream
    request with it: its connection is closed) and ClientGoneError raised."""
    task = asyncio.ensure_future(aw)
    waiter = asyncio.ensure_future(gone.wait())
    try:
        done, _ = await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # we were cancelled: so is `aw`
        task.cancel()
        raise
    finally:
        waiter.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        late = await task  # finished as it was cancelled: a response to close
        if isinstance(late, httpx.Response):
            await late.aclose()
    raise ClientGoneError("the client left")
