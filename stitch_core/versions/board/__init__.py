"""Boards: stores of immutable versions. A URL picks the backend.

    /path or file:///path   LocalBoard (the default)
    http(s)://host/prefix   HttpBoard (read-only; any static server or CDN)
    nats://host:port/bucket NatsBoard (JetStream object store + KV)
"""

from __future__ import annotations

from stitch_core.versions.board.base import (
    Board,
    BoardError,
    LatestConflict,
    NotFound,
    ReadOnlyBoard,
)
from stitch_core.versions.board.local import LocalBoard


def open_board(url: str) -> Board:
    """The board a URL names: HttpBoard, NatsBoard, else a LocalBoard (a path or file:// URL)."""
    if url.startswith(("http://", "https://")):
        from stitch_core.versions.board.http import HttpBoard

        return HttpBoard(url)
    if url.startswith(("nats://", "tls://")):
        from stitch_core.versions.board.nats import NatsBoard

        return NatsBoard(url)
    return LocalBoard(url.removeprefix("file://"))


__all__ = ["Board", "BoardError", "LatestConflict", "LocalBoard", "NotFound", "ReadOnlyBoard",
           "open_board"]
