"""Boards: stores of immutable versions. A URL picks the backend.

    /path or file:///path   LocalBoard (the default)
    http(s)://host/prefix   HttpBoard (read-only; any static server or CDN)
    nats://host:port/bucket NatsBoard (JetStream object store + KV)
    URL,URL,...             FallbackBoard: the first (a region's relay) with fallback to the
                            next (the origin); read-only (docs/relays.md)
"""

from __future__ import annotations

from stitch_core.versions.board.base import (
    Board,
    BoardError,
    LatestConflictError,
    NotFoundError,
    ReadOnlyBoardError,
)
from stitch_core.versions.board.local import LocalBoard


def open_board(url: str) -> Board:
    """The board a URL names: HttpBoard, NatsBoard, else a LocalBoard (a path or file:// URL);
    a comma-separated list of them: a FallbackBoard (nearest first, read-only)."""
    if "," in url:
        from stitch_core.versions.board.fallback import open_fallback

        urls = [u.strip() for u in url.split(",") if u.strip()]
        if len(urls) > 1:
            return open_fallback(urls, open_board)
        url = urls[0] if urls else url
    if url.startswith(("http://", "https://")):
        from stitch_core.versions.board.http import HttpBoard

        return HttpBoard(url)
    if url.startswith(("nats://", "tls://")):
        from stitch_core.versions.board.nats import NatsBoard

        return NatsBoard(url)
    return LocalBoard(url.removeprefix("file://"))


__all__ = ["Board", "BoardError", "LatestConflictError", "LocalBoard", "NotFoundError",
           "ReadOnlyBoardError", "open_board"]
