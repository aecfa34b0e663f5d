"""`stitch board serve` under slow and greedy clients: real server, real sockets (no mocks).

Slow loris connections dribble one header line at a time and must be closed at the request-head
deadline however often they send; a legitimate GET is answered meanwhile, also when the
connection cap is as small as the one of the adversarial review (4). One address over its
per-client cap loses its longest-idle connection, or when all are busy answering, gets a 503;
another address is served all along.
"""

from __future__ import annotations

import asyncio
import http.client
import os
import socket
import threading
import time

import pytest

from stitch_core.versions.board.local import LocalBoard
from stitch_core.versions.board.serve import serve
from stitch_core.versions.manifest import Latest, latest_key

RUN = "run-s"
BIG = f"{RUN}/versions/000001/big.bin"  # 64 MiB of zeros: more than loopback buffers absorb


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("slowloris")
    latest = Latest(run=RUN, version=1, kind="snapshot", updated="2026-01-01T00:00:00Z")
    asyncio.run(LocalBoard(root).move_latest(RUN, None, latest))
    big = root / BIG
    big.parent.mkdir(parents=True)
    with open(big, "wb") as f:
        f.truncate(64 << 20)
    return root


class Running:
    """A server from `serve(**kw)` in a thread; stopped on exit."""

    def __init__(self, root, **kw):
        self.server = serve(root, "127.0.0.1", 0, **kw)
        self.port = self.server.server_port
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(10)


def get_latest(port: int, source: str = "127.0.0.1") -> tuple[int, float]:
    """(status, seconds) of one GET of `latest` on a new connection from `source`."""
    t0 = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60,
                                      source_address=(source, 0))
    try:
        conn.request("GET", f"/{latest_key(RUN)}")
        r = conn.getresponse()
        r.read()
        return r.status, time.monotonic() - t0
    finally:
        conn.close()


class Dribbler(threading.Thread):
    """A slow loris: opens a request and sends one more header line every `every` seconds,
    never ending the head; `closed_after`: seconds from connecting until the server closed it."""

    def __init__(self, port: int, every: float = 0.5):
        super().__init__(daemon=True)
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.sendall(f"GET /{latest_key(RUN)} HTTP/1.1\r\nHost: board\r\n".encode())
        self.t0, self.every = time.monotonic(), every
        self.closed_after: float | None = None
        self.stop = threading.Event()
        self.start()

    def run(self) -> None:
        self.sock.settimeout(self.every)
        while not self.stop.is_set():
            try:
                self.sock.sendall(b"X-Drip: 1\r\n")
                if self.sock.recv(1) == b"":  # the server closed it
                    break
            except TimeoutError:
                continue  # still open: drip again
            except OSError:
                break
        self.closed_after = time.monotonic() - self.t0

    def close(self) -> None:
        self.stop.set()
        self.join(5)
        self.sock.close()


def test_slowloris_is_closed_at_the_head_deadline_and_does_not_delay_a_get(root):
    """8 connections dribbling a header line every 0.5 s: a GET of `latest` is answered at
    once (the thread server made it wait for a worker), each dribbler is closed at the 4 s head
    deadline although it never stops sending."""
    with Running(root, head_timeout=4) as r:
        drips = [Dribbler(r.port) for _ in range(8)]
        try:
            time.sleep(1)
            for _ in range(5):
                status, took = get_latest(r.port)
                assert status == 200 and took < 2.5  # well inside the head deadline
            for d in drips:
                d.join(15)
            after = sorted(d.closed_after for d in drips)
            assert after[0] > 3.5 and after[-1] < 8, after  # closed by the deadline, not sooner
            assert r.server.head_timeouts >= 8
            assert r.server.active == 0
        finally:
            for d in drips:
                d.close()


def test_slowloris_at_the_connection_cap_of_the_review(root):
    """The review's setup (`--workers 4`, here the connection cap) with 4 dribblers and a head
    deadline of 30 s: a new connection evicts the dribbler waiting longest, so the GET is served
    at once instead of after the 30 s the thread server took."""
    with Running(root, max_conns=4, head_timeout=30) as r:
        drips = [Dribbler(r.port, every=0.2) for _ in range(4)]
        try:
            time.sleep(0.5)
            assert r.server.active == 4
            status, took = get_latest(r.port)
            assert status == 200 and took < 5
            assert r.server.evicted >= 1 and r.server.peak <= 4
            drips[0].join(5)
            assert drips[0].closed_after is not None  # the oldest went first
        finally:
            for d in drips:
                d.close()


def _connect(port: int, source: str = "127.0.0.1") -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a slow reader: tiny window
    s.bind((source, 0))
    s.connect(("127.0.0.1", port))
    return s


def _is_closed(s: socket.socket, wait: float) -> bool:
    s.settimeout(wait)
    try:
        return s.recv(1) == b""
    except TimeoutError:
        return False
    except OSError:
        return True


def test_per_client_cap_evicts_idle_then_refuses_while_another_client_is_served(root):
    """Cap 3 per address. Five idle connections from 127.0.0.1: the two oldest are closed. Then
    three busy ones (big downloads nobody reads) leave nothing to evict: a fourth gets a 503 and
    is closed, while 127.0.0.2 is served, also during the stalled downloads."""
    with Running(root, max_conns_per_client=3, head_timeout=30) as r:
        idle = [_connect(r.port) for _ in range(5)]
        try:
            assert [_is_closed(s, 1.0) for s in idle] == [True, True, False, False, False]
            assert r.server.evicted == 2
        finally:
            for s in idle:
                s.close()
        busy = [_connect(r.port) for _ in range(3)]
        try:
            for s in busy:
                s.sendall(f"GET /{BIG} HTTP/1.1\r\nHost: board\r\n\r\n".encode())
                s.settimeout(5)
                assert s.recv(16).startswith(b"HTTP/1.1 200")
            deadline = time.monotonic() + 10
            while (r.server.active != 3 or r.server._waiting) and time.monotonic() < deadline:
                time.sleep(0.05)
            extra = _connect(r.port)
            try:
                extra.settimeout(5)
                answer = extra.recv(200)
                assert answer.startswith(b"HTTP/1.1 503") and b"Retry-After: 1" in answer
                assert _is_closed(extra, 5)
            finally:
                extra.close()
            assert r.server.refused == 1
            status, took = get_latest(r.port, source="127.0.0.2")
            assert status == 200 and took < 5
            for s in busy:  # still stalled mid-body, not dropped
                assert not _is_closed(s, 0.1)
        finally:
            for s in busy:
                s.close()


def test_a_reader_that_takes_nothing_is_dropped(root):
    """A download nobody reads is given up after the send timeout (its connection closed),
    and holds no thread meanwhile: others are served."""
    with Running(root, send_timeout=1.5) as r:
        s = _connect(r.port)
        try:
            s.sendall(f"GET /{BIG} HTTP/1.1\r\nHost: board\r\n\r\n".encode())
            time.sleep(0.5)
            assert get_latest(r.port)[0] == 200
            t0 = time.monotonic()
            s.settimeout(0.2)
            closed = False
            while not closed and time.monotonic() - t0 < 20:
                time.sleep(0.5)  # read a trickle: nowhere near what the buffers hold
                try:
                    closed = s.recv(1024) == b""
                except TimeoutError:
                    pass
                except OSError:
                    closed = True
            assert closed
        finally:
            s.close()


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "PATCH", "OPTIONS"])
def test_other_methods_are_405(root, method):
    with Running(root) as r:
        conn = http.client.HTTPConnection("127.0.0.1", r.port, timeout=10)
        try:
            conn.request(method, f"/{latest_key(RUN)}", body=b"x")
            resp = conn.getresponse()
            assert resp.status == 405 and resp.getheader("Allow") == "GET, HEAD"
            assert resp.getheader("Cache-Control") == "no-store"
            resp.read()
        finally:
            conn.close()
    assert os.path.exists(root / latest_key(RUN))
