"""A real `stitch board serve` origin that counts the requests it answers (what crossed the
'WAN' in the relay tests and benchmarks): `start_origin(root)`, then `origin.gets[(method,
path)]`; `stop_origin(origin)` shuts it down."""

from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path

from stitch_core.versions.board.serve import BoardHandler, BoardServer, serve


class Counting(BoardHandler):
    """Counts requests per (method, path) on its server's `gets`."""

    def _serve(self, body: bool) -> None:
        with self.server.lock:
            self.server.gets[(self.command, self.path)] += 1
        super()._serve(body)


def start_origin(root: Path, handler: type[Counting] = Counting) -> BoardServer:
    """Serve `root` on a free loopback port in a thread; `.url`, `.gets` set."""
    srv = serve(root, port=0, handler=handler)
    srv.gets, srv.lock = Counter(), threading.Lock()
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    srv.url = f"http://127.0.0.1:{srv.server_port}"
    return srv


def stop_origin(srv: BoardServer) -> None:
    srv.shutdown()
    srv.server_close()
