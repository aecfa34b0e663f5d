"""Connections and sends of `stitch board serve`: uvicorn's HTTP/1.1 protocol with a request-head
deadline and connection caps, `BoardServer` (the bound server the CLI, tests and benchmarks
drive) and `BoardApp` (the ASGI app sending what a `serve.BoardHandler` decided).

Why some of this is hand-written: uvicorn (0.54, h11) has no request-head timeout. Nothing is
armed when a connection opens, its keep-alive timer starts only after a response, and any byte
received cancels it, so a client that connects and sends one header line every few seconds (or
nothing at all) holds its connection forever; the old thread-per-connection server had a timeout
per read, so such clients held its worker threads for as long as they kept dribbling.
`BoardProtocol` is a small subclass of uvicorn's `H11Protocol` (passed as `http=`) that adds:

- one deadline per request head: from the moment the connection opens, or its previous response
  is complete, the whole head must arrive within `head_timeout` seconds however it is dribbled,
  else the connection is closed (an idle keep-alive connection is closed the same way);
- a cap per client address (`max_conns_per_client`) and in all (`max_conns`): a connection over
  a cap evicts the connection of that client (of anyone, for the global cap) that has waited
  longest for a request head, an idle keep-alive or a slow loris; when every one is busy
  answering, the new connection gets a 503 and is closed.

Everything else is uvicorn's: parsing (h11, request heads over 16 KiB refused), keep-alive,
and flow control, so answers are sent asynchronously and a slow reader holds only its own
connection (the app adds a stall timeout per chunk).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import resource
import socket
import struct
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from stitch_core.errors import StitchError

MAX_CONNS = 1024  # connections open at once (all clients)
# connections open at once from one address: followers behind one NAT, or one relay, share an
# address; 100 followers on one host (benchmarks/fleet_load.py) must all get in
MAX_CONNS_PER_CLIENT = 256
HEAD_TIMEOUT = 10.0  # seconds a request head (or the next one, on keep-alive) may take
GRACEFUL = 5.0  # seconds `shutdown()` lets answers in flight finish
SEND_CHUNK = 256 << 10  # a body is read and sent this much at a time
SEND_TIMEOUT = 60.0  # seconds one chunk may wait for a reader that takes nothing
THREADS = 32  # answers decided at once (stat, open, ETag: disk work, off the event loop)
_REFUSED = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\n"
            b"Content-Length: 24\r\nCache-Control: no-store\r\nRetry-After: 1\r\n"
            b"Connection: close\r\n\r\n503 Service Unavailable\n")


class AbortedError(StitchError, ConnectionAbortedError):
    """An answer given up on purpose (a cut body, a stalled reader): uvicorn closes the
    connection; not logged as an application error."""


class _QuietAborts(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], AbortedError))


class BoardProtocol(H11Protocol):
    """uvicorn's h11 protocol with a whole-request-head deadline and the server's connection
    caps (see the module doc); `board` is set on a subclass made per server."""

    board: BoardServer

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_timer: asyncio.TimerHandle | None = None
        self.refused = not self.board._admit(self)
        if self.refused:
            transport.write(_REFUSED)
            transport.close()
            return
        self._await_head()

    def data_received(self, data: bytes) -> None:
        if not self.refused:
            super().data_received(data)

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:  # a whole request head arrived: its answer is under way
            self._head_done()

    def on_response_complete(self) -> None:
        # armed before uvicorn looks for a pipelined request (which disarms it at once)
        if not self.transport.is_closing():
            self._await_head()
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._head_done()
        self.board._forget(self)
        super().connection_lost(exc)

    def _await_head(self) -> None:
        self._head_done()
        self.board._waiting[self] = None  # insertion order: the longest waiting first
        self._head_timer = self.loop.call_later(self.board.head_timeout, self._head_late)

    def _head_done(self) -> None:
        if getattr(self, "_head_timer", None) is not None:
            self._head_timer.cancel()
            self._head_timer = None
        self.board._waiting.pop(self, None)

    def _head_late(self) -> None:
        self._head_timer = None
        self.board._waiting.pop(self, None)
        if not self.transport.is_closing():
            self.board.head_timeouts += 1
            self.transport.close()


class BoardServer:
    """An ASGI app served by uvicorn with `BoardProtocol` on a socket bound at construction
    (`server_port` is known at once, a port in use is an OSError here). The socketserver-like
    surface of the old server is kept: `serve_forever()` (blocks), `shutdown()` (from another
    thread: answers in flight get `GRACEFUL` seconds), `server_close()`. Attributes set on it
    are visible to handlers as `self.server`."""

    request_queue_size = 1024  # the listen backlog: a fleet woken at once must not lose SYNs

    def __init__(self, app: Any, addr: tuple[str, int], *, max_conns: int = MAX_CONNS,
                 max_conns_per_client: int = MAX_CONNS_PER_CLIENT,
                 head_timeout: float = HEAD_TIMEOUT, verbose: bool = False):
        host, port = addr
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(self.address_family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.listen(self.request_queue_size)
        except BaseException:
            sock.close()
            raise
        self.socket = sock
        self.server_address = sock.getsockname()[:2]
        self.server_port: int = self.server_address[1]
        self.app, self.verbose, self.head_timeout = app, verbose, float(head_timeout)
        self.root: Any = None  # what the app serves (`serve()` sets the board directory)
        self.max_conns = _fd_room(max(1, max_conns))
        self.max_workers = self.max_conns  # the old name (`--workers`)
        self.max_conns_per_client = max_conns_per_client  # 0: no cap
        self.active = self.peak = 0  # connections open now, the most at once
        self.evicted = self.refused = self.head_timeouts = 0
        self._conns: set[BoardProtocol] = set()
        self._by_ip: dict[str, set[BoardProtocol]] = {}
        self._by_client: dict[Any, BoardProtocol] = {}
        self._waiting: dict[BoardProtocol, None] = {}
        proto = type("BoardProtocol", (BoardProtocol,), {"board": self})
        config = uvicorn.Config(
            app, http=proto, ws="none", lifespan="off", interface="asgi3", log_config=None,
            access_log=False, proxy_headers=False, server_header=False,
            headers=[("Server", "stitch-board")], timeout_keep_alive=max(1, int(head_timeout)),
            timeout_graceful_shutdown=int(GRACEFUL), backlog=self.request_queue_size)
        self._uv = uvicorn.Server(config)
        self._running = threading.Event()
        self._done = threading.Event()
        log = logging.getLogger("uvicorn.error")
        if not any(isinstance(f, _QuietAborts) for f in log.filters):
            log.addFilter(_QuietAborts())

    # ---------------------------------------------------------------- socketserver surface

    def serve_forever(self, poll_interval: float | None = None) -> None:
        """Serve until `shutdown()` (or SIGINT/SIGTERM when run in the main thread)."""
        self._running.set()
        try:
            asyncio.run(self._uv.serve(sockets=[self.socket]))
        finally:
            self._done.set()

    def shutdown(self) -> None:
        """Stop serving and wait for `serve_forever()` to return."""
        self._uv.should_exit = True
        if self._running.is_set():
            self._done.wait(GRACEFUL + 10)

    def server_close(self) -> None:
        with contextlib.suppress(OSError):
            self.socket.close()
        close = getattr(self.app, "close", None)
        if close is not None:
            close()

    def gone(self, client: Any) -> bool:
        """Whether the connection from `client` (an ASGI scope's) is closed or closing."""
        p = self._by_client.get(client)
        return p is None or p.transport.is_closing()

    def abort(self, client: Any) -> None:
        """Reset the connection from `client` at once (from the event loop): what the kernel
        still buffers for it is dropped too (a plain close would go on sending it)."""
        p = self._by_client.get(client)
        if p is None:
            return
        sock = p.transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        p.transport.abort()

    # ---------------------------------------------------------------- caps (event loop only)

    def _admit(self, p: BoardProtocol) -> bool:
        ip = p.client[0] if p.client else ""
        mine = self._by_ip.get(ip, set())
        cap = self.max_conns_per_client
        if (cap and len(mine) >= cap and not self._evict(lambda q: q in mine)) or \
                (len(self._conns) >= self.max_conns and not self._evict(lambda q: True)):
            self.refused += 1
            return False
        self._by_ip.setdefault(ip, set()).add(p)
        self._conns.add(p)
        self._by_client[p.client] = p
        self.active = len(self._conns)
        self.peak = max(self.peak, self.active)
        return True

    def _evict(self, which: Callable[[BoardProtocol], bool]) -> bool:
        """Close the connection `which` accepts that has waited longest for a request head."""
        for q in self._waiting:
            if which(q):
                q._head_done()
                self._forget(q)
                q.transport.close()
                self.evicted += 1
                return True
        return False

    def _forget(self, p: BoardProtocol) -> None:
        if p not in self._conns:
            return
        self._conns.discard(p)
        ip = p.client[0] if p.client else ""
        mine = self._by_ip.get(ip)
        if mine is not None:
            mine.discard(p)
            if not mine:
                del self._by_ip[ip]
        if self._by_client.get(p.client) is p:
            del self._by_client[p.client]
        self._waiting.pop(p, None)
        self.active = len(self._conns)


class Connection:
    """What `BoardHandler.connection` gives: enough to cut the client's connection."""

    def __init__(self, server: BoardServer, client: Any):
        self.server, self.client = server, client

    def __hash__(self) -> int:
        return hash(self.client)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Connection) and other.client == self.client

    def shutdown(self, how: int = 2) -> None:
        p = self.server._by_client.get(self.client)
        if p is not None:
            p.loop.call_soon_threadsafe(p.transport.abort)

    def close(self) -> None:
        self.shutdown()


class BoardApp:
    """The ASGI app: a `handler` decides each answer in a thread pool, then it is sent here,
    the body read from its file in `SEND_CHUNK`s, each send given `send_timeout` seconds."""

    def __init__(self, handler: Any, *, send_timeout: float = SEND_TIMEOUT,
                 threads: int = THREADS):
        self.handler, self.send_timeout = handler, send_timeout
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="board-serve")
        self.server: BoardServer | None = None  # set by serve()

    def close(self) -> None:
        self.pool.shutdown(wait=False)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        assert self.server is not None
        loop = asyncio.get_running_loop()
        h = self.handler(self.server, scope)
        try:
            first = await loop.run_in_executor(self.pool, self._decide, h)
            await self._answer(h, first, send, loop, scope.get("client"))
        finally:
            h._drop_file()

    @staticmethod
    def _decide(h: Any) -> bytes:
        """In a pool thread: the handler's answer and the first chunk of its body (one thread
        hop for an object up to `SEND_CHUNK`)."""
        h.run()
        if h.file is None or h.command == "HEAD":
            return b""
        fd, offset, left = h.file
        data = os.pread(fd, min(SEND_CHUNK, left), offset)
        h.file = (fd, offset + len(data), left - len(data))
        return data

    async def _answer(self, h: Any, first: bytes, send: Any, loop: asyncio.AbstractEventLoop,
                      client: Any) -> None:
        # names as the handler wrote them (h11 keeps their case on the wire)
        headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in h.response_headers]
        if h.close_connection and not any(k.lower() == b"connection" for k, _ in headers):
            headers.append((b"Connection", b"close"))
        declared = next((v for k, v in headers if k.lower() == b"content-length"), b"")
        await self._send(send, {"type": "http.response.start", "status": h.code or 500,
                                "headers": headers}, client)
        sent = 0
        if h.command != "HEAD":
            data = h.wfile.getvalue() + first
            while data:
                await self._send(send, {"type": "http.response.body", "body": data,
                                        "more_body": True}, client)
                sent, data = sent + len(data), b""
                if h.file is not None and h.file[2] > 0 and not self.server.gone(client):
                    fd, offset, left = h.file
                    data = await loop.run_in_executor(self.pool, os.pread, fd,
                                                      min(SEND_CHUNK, left), offset)
                    h.file = (fd, offset + len(data), left - len(data))
            if declared.isdigit() and sent < int(declared) and h.code not in (204, 304):
                # a body cut short (a file that shrank, an injected fault): the connection is
                # closed so the client sees a short read, never a padded one
                raise AbortedError(f"{h.path}: sent {sent} of {int(declared)} bytes")
        await self._send(send, {"type": "http.response.body", "body": b"", "more_body": False},
                         client)

    async def _send(self, send: Any, message: dict, client: Any) -> None:
        try:
            async with asyncio.timeout(self.send_timeout):
                await send(message)
        except TimeoutError:
            # reset, not closed: a close would first wait for the stalled reader to take
            # what is buffered
            self.server.abort(client)
            raise AbortedError(f"a reader took nothing for {self.send_timeout} s") from None



def _fd_room(want: int) -> int:
    """`want` connections, or as many as the open-file limit leaves room for (raised toward
    the hard limit first): running out of descriptors stalls accepting for everyone."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = want + 128
    if soft != resource.RLIM_INFINITY and soft < need:
        new = need if hard == resource.RLIM_INFINITY else min(need, hard)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return want
    return max(1, min(want, soft - 128))
