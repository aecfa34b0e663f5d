"""Ports for the servers the tests, benchmarks and demo start (standard library only)."""

from __future__ import annotations

import contextlib
import socket
import time


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picked it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(host: str, port: int, timeout: float = 15) -> None:
    """Wait until something accepts TCP connections on host:port (RuntimeError after `timeout`)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.5):
            return
        time.sleep(0.05)
    raise RuntimeError(f"{host}:{port} did not accept connections")
