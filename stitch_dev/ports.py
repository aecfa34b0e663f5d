"""Ports for the servers the tests, benchmarks and demo start (standard library only)."""

from __future__ import annotations

import contextlib
import random
import socket
import time
from pathlib import Path

_LOW = 10000  # the bottom of the range free_port draws from, below the OS's ephemeral range
_RNG = random.SystemRandom()  # not the global generator, which tests seed


def _ephemeral_low() -> int:
    """The lowest port the OS hands out for bind(0) and outgoing connections."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, drawn below the OS's ephemeral range
    when there is room: a port the OS picked could be handed out again, before the server
    binds it, to any process's outgoing connection or bind(0) (an SGLang restart was seen
    failing on exactly that: "address already in use")."""
    top = min(_ephemeral_low(), 65536) - 1
    if top - _LOW >= 1000:
        for _ in range(50):
            port = _RNG.randint(_LOW, top)
            if _bindable(port):
                return port
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
