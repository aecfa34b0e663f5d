"""The ASGI vocabulary the serve layer's HTTP modules share, framework-free.

The callables' types (`Scope`, `Message`, `Receive`, `Send`, `ASGIApp`), dropping headers from a
message's header list (`without_headers`) and sending a whole JSON answer (`send_json`). Used by
the engine's middleware (`asgi`, `stamping`), the gateway (`gateway`, `proxy`) and
`stitch_core.node`.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def without_headers(headers: Iterable[tuple[bytes, bytes]],
                    *names: bytes) -> list[tuple[bytes, bytes]]:
    """`headers` less those named in `names` (lower-case)."""
    return [(k, v) for k, v in headers if k.lower() not in names]


async def send_json(send: Send, status: int, body: Any,
                    headers: Iterable[tuple[bytes, bytes]] = ()) -> None:
    """Send a complete JSON answer with `status` (and extra `headers`) through `send`."""
    data = json.dumps(body, default=str).encode()
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
        *headers]})
    await send({"type": "http.response.body", "body": data, "more_body": False})
