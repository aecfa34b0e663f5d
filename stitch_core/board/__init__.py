"""Boards: stores of immutable versions. A URL picks the backend.

    /path or file:///path   LocalBoard (the default)
    http(s)://host/prefix   HttpBoard (read-only; any static server or CDN)
    nats://host:port/bucket NatsBoard (JetStream object store + KV)
"""

from __future__ import annotations

from .base import Board, BoardError, LatestConflict, NotFound, ReadOnlyBoard
from .local import LocalBoard


def open_board(url: str) -> Board:
    if url.startswith(("http://", "https://")):
        from .http import HttpBoard

        return HttpBoard(url)
    if url.startswith(("nats://", "tls://")):
        from .nats import NatsBoard

        return NatsBoard(url)
    return LocalBoard(url.removeprefix("file://"))


__all__ = ["Board", "BoardError", "LatestConflict", "LocalBoard", "NotFound", "ReadOnlyBoard",
           "open_board"]
