"""The fault rig's board over HTTP: the board directory served in a thread by
``stitch_core.versions.board.serve``, its handler able to answer 503, answer late, or have its
connections cut."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from pathlib import Path
from typing import Any

from stitch_core.versions.board.serve import BoardHandler, BoardServer, serve


class FaultyHandler(BoardHandler):
    """Counts requests; answers 503, answers late, per the server's `faults`; its connections can
    be dropped (`drop_all`) so that an outage also cuts keep-alive connections."""

    def setup(self) -> None:
        super().setup()
        with self.server.lock:
            self.server.conns.add(self.connection)

    def finish(self) -> None:
        with contextlib.suppress(Exception):
            super().finish()
        with self.server.lock:
            self.server.conns.discard(self.connection)

    def _serve(self, body: bool) -> None:
        srv = self.server
        srv.requests += 1
        mode = srv.faults.get("mode")
        if mode == "5xx":
            srv.failed += 1
            return self._status(503)
        if mode == "slow":
            time.sleep(srv.faults.get("delay", 1.0))
        return super()._serve(body)


class HttpBoardServer:
    """The board directory served over HTTP in a thread; `stop()` refuses connections (the
    listening socket closed, live connections cut), `start()` serves again on the same port."""

    def __init__(self, root: Path):
        self.root = root
        self.port = 0
        self.faults: dict[str, Any] = {}
        self.requests = 0
        self.server: BoardServer | None = None
        self.thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        for _ in range(100):
            try:
                s = serve(self.root, "127.0.0.1", self.port, handler=FaultyHandler)
                break
            except OSError:  # the port is still held by the previous socket
                time.sleep(0.05)
        else:
            raise RuntimeError(f"cannot bind 127.0.0.1:{self.port}")
        s.faults, s.requests, s.failed = self.faults, 0, 0
        s.conns, s.lock = set(), threading.Lock()
        self.server, self.port = s, s.server_port
        self.thread = threading.Thread(target=s.serve_forever, daemon=True, name="board-http")
        self.thread.start()

    def stop(self) -> None:
        s, self.server = self.server, None
        if s is None:
            return
        s.shutdown()
        s.server_close()
        with s.lock:
            conns = list(s.conns)
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
        self.requests += s.requests
        assert self.thread is not None
        self.thread.join(5)
