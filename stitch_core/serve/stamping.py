"""Stamping an admitted request's answer: the ``"stitch"`` field in what the app sends back.

`Exchange` stands between the app and the client for one request that `stitch_core.serve.asgi`
admitted (the admission, the gate's ticket and the request side are the middleware's). It marks
the answer with the versions that produced it, in the route's dialect (OpenAI, Responses,
Anthropic; `stitch_core.serve.route_table.Dialect`):

* a JSON body: the ``"stitch"`` field, plus the version response headers;
* an SSE stream: one extra event right before ``data: [DONE]`` (at the end of streams without
  one): a chunk with no choices (OpenAI), a typed ``response.stitch`` event (Responses) or a named
  ``stitch`` event (Anthropic);
* an NDJSON stream: the field on the ``"done": true`` line (a stream without one ends with a
  ``{"stitch": ...}`` line).

A request pinned to an exact version whose version changes before the answer is complete gets a
409 (before the first byte) or its stream cut with a ``version_changed`` error event, and the app
is told the client went away (`StreamStoppedError`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import Iterable
from typing import Any

from stitch_core.errors import StitchError
from stitch_core.serve import protocol
from stitch_core.serve.asgi_types import Message, Receive, Send, send_json, without_headers
from stitch_core.serve.gate import Ticket, VersionGate
from stitch_core.serve.route_table import Dialect
from stitch_core.serve.spans import Span, SpanSink

log = logging.getLogger("stitch.serve")

_EVENT_END = re.compile(rb"\r\n\r\n|\n\n|\r\r")
_LINE = re.compile(r"\r\n|\n|\r")
_DONE = "[DONE]"
_COPIED = ("id", "object", "created", "model", "request_id")
_NDJSON = ("application/x-ndjson", "application/jsonl", "application/json-seq")


class StreamStoppedError(StitchError, OSError):
    """Raised to the inner app from `send` once the middleware ended its response, as a client
    disconnect is signalled under ASGI spec 2.4 (frameworks then cancel the generation)."""


def _header(headers: Iterable[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    for k, v in headers:
        if k.lower() == name:
            return v
    return None


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


class Exchange:
    """The response side of one admitted request: marks, rewrites or cuts what the app sends.

    Once the middleware has ended a response itself (`stopped`), the app is told the client went
    away, the way its ASGI spec version says: `receive` answers ``http.disconnect`` (spec < 2.4:
    Starlette's disconnect listener then cancels the stream at its current await) and, under spec
    2.4, `send` raises :class:`StreamStoppedError` (an OSError); otherwise further sends are
    dropped.
    """

    def __init__(self, gate: VersionGate, ticket: Ticket, send: Send,
                 spec_version: tuple[int, ...] = (2, 0), dialect: Dialect = "openai",
                 sink: SpanSink | None = None):
        self.gate, self.ticket, self._send = gate, ticket, send
        self.sink = sink  # the engine's per-token version spans, when its plugin reports them
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

    def _release(self) -> tuple[int | None, int | None, list[list[Span]] | None]:
        """Release the ticket: (version_start, version_end, the engine's spans per output). With
        spans, start and end are the first and last versions that sampled a token; spans naming
        a version outside what the gate served during the request are not used."""
        start, end = self.gate.release(self.ticket)
        outputs = self.sink.spans() if self.sink is not None else None
        if outputs is None:
            return start, end, None
        named = [v for o in outputs for v, _, _ in o]
        if not named:
            return start, end, outputs
        if start is None or end is None or min(named) < start or max(named) > end:
            log.warning("stitch: engine spans name versions %s-%s outside %s-%s; not used",
                        min(named), max(named), start, end)
            return start, end, None
        return min(o[0][0] for o in outputs if o), max(o[-1][0] for o in outputs if o), outputs

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
                raise StreamStoppedError("the Stitch middleware ended this response")
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
            headers = without_headers(self.headers, b"content-length")
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
        start, end, outputs = self._release()
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
                obj[protocol.RESPONSE_FIELD] = protocol.stitch_field(self.run, start, end,
                                                                     outputs)
                body = json.dumps(obj, ensure_ascii=False).encode()
                headers = [*without_headers(headers, b"content-length"),
                           (b"content-length", str(len(body)).encode())]
        headers = [*headers, *protocol.response_headers(
            self.run, start, end, outputs if self.status == 200 else None)]
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
        start, end, outputs = self._release()
        if self._pinned_violated():
            await self._cut()  # drops this message's events too: they may be the new version's
            return False
        field = protocol.stitch_field(self.run, start, end, outputs)
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
        the app's further sends raise StreamStoppedError."""
        self.gate.release(self.ticket)
        e = self.gate.version_changed(self.ticket)
        self._stopping()
        body = self._cut_events(e.body)
        await self._send({"type": "http.response.body", "body": body, "more_body": False})
        if self._raise_on_send:
            raise StreamStoppedError("exact-pinned version changed mid-stream")

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
                start, end, outputs = self._release()
                if self._pinned_violated():
                    await self._cut()
                    return
                obj[protocol.RESPONSE_FIELD] = protocol.stitch_field(self.run, start, end,
                                                                     outputs)
                line = json.dumps(obj, ensure_ascii=False).encode()
                self._marked = True
            out.append(line + b"\n")
        if not more and not self._marked:
            start, end, outputs = self._release()
            if self._pinned_violated():
                await self._cut()
                return
            out.append(json.dumps({protocol.RESPONSE_FIELD: protocol.stitch_field(
                self.run, start, end, outputs)}).encode() + b"\n")
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
