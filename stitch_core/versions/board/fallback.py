"""A read-only board over an ordered list of boards: a region's relay first, the origin last.

`open_board("http://relay.eu:8080,http://origin:8000")` (a comma-separated list, as in
`STITCH_BOARD`) opens one. Every read goes to the first board that is up and falls back to the next
one on any board error: a relay that refuses connections, times out or answers 5xx, and also a
NotFoundError, because a relay or mirror may not hold an object the origin already has (a version
is published at the origin first). A board that failed with a connection-level error is skipped for
`cooldown` seconds (its own retries are cut to `relay_attempts`), so a dead relay costs a follower
one failed connect per cooldown, not one per read. TooLargeError is final: the object is the same
everywhere. `latest` is read the same way: through the relay (which never caches it;
docs/relays.md), from the origin when the relay fails. A first board that keeps its own copy of
`latest` (a JetStream mirror; not an HTTP relay) is also checked against the origin's: when it is
behind, the read waits up to `latest_wait` seconds for it to catch up (then the version's objects
are read from it as well) and else returns the origin's. Followers never write to a board, so a
write, a delete or a `latest` move is refused (ReadOnlyBoardError): publish to the origin.

A copy that does not match its manifest (`get_verified`: the size and SHA-256 a manifest lists)
is not the end either: a relay that cached a corrupted or tampered object would otherwise stop
its whole region. The board that served it is asked once to refresh it (`get_refreshed`: an HTTP
relay re-fetches the object from its origin and replaces its cached copy, at most once a minute
per object), and when that copy is bad too, or the board cannot refresh, the object is fetched
from the next board. A bad copy does not put a board in its cooldown (it answers; one object is
wrong).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

from stitch_core.settings import Settings, env_name
from stitch_core.versions.board.base import (
    BadCopyError,
    Board,
    BoardError,
    NotFoundError,
    ReadOnlyBoardError,
    TooLargeError,
    check_copy,
)
from stitch_core.versions.manifest import Latest

log = logging.getLogger("stitch.board.fallback")
# the value of a refresh request's header, where the region's relay was given a refresh token
# (`stitch relay http --refresh-token-file`); without it the header says "1"
ENV_REFRESH_TOKEN = env_name("relay_refresh_token")
T = TypeVar("T")


class FallbackBoard(Board):
    """Reads from `boards` in order (first: the nearest), falling back on errors; read-only."""

    readonly = True

    def __init__(self, boards: list[Board], *, cooldown: float = 10.0,
                 check_latest: bool = False, latest_wait: float = 2.0):
        if not boards:
            raise BoardError("a fallback board needs at least one board")
        self.boards = boards
        self.url = ",".join(b.url for b in boards)
        self.cooldown = cooldown
        self._down_until = [0.0] * len(boards)
        self._last = 0  # the board that answered the last read
        self.served: list[int] = [0] * len(boards)  # reads answered by each board (status)
        # a replica that copies `latest` itself (a JetStream mirror) can be a moment behind the
        # origin: then wait up to `latest_wait` for it to catch up, so the objects are read
        # from it too, instead of a follower woken by an announcement finding nothing new
        self.check_latest = check_latest
        self.latest_wait = latest_wait
        self.behind = 0  # reads of latest that waited for the replica, or read the origin
        self.bad_copies = [0] * len(boards)  # objects each board served that did not verify
        self.refreshed = [0] * len(boards)  # bad copies each board replaced when asked to

    def _order(self) -> list[int]:
        now = time.monotonic()
        up = [i for i in range(len(self.boards)) if self._down_until[i] <= now]
        down = [i for i in range(len(self.boards)) if self._down_until[i] > now]
        return up + down  # boards in their cooldown are still tried, last

    async def _first(self, what: str, call: Callable[[Board], Awaitable[T]], *,
                     on_bad: Callable[[int], Awaitable[T]] | None = None) -> T:
        errors: list[BaseException] = []
        for i in self._order():
            board = self.boards[i]
            try:
                out = await call(board)
            except TooLargeError:
                raise
            except BadCopyError as e:  # this board's copy is wrong; the board itself answers
                self.bad_copies[i] += 1
                log.warning("board %s served a bad copy (%s); %s", board.url, e,
                            "asking it to refresh" if on_bad else "trying the next")
                if on_bad is not None and i < len(self.boards) - 1:
                    try:
                        out = await on_bad(i)
                    except (BoardError, OSError) as e2:
                        log.warning("board %s: no good copy after a refresh (%s); trying the "
                                    "next", board.url, e2)
                        errors.append(e)
                        continue
                    self.refreshed[i] += 1
                    self.served[i] += 1
                    self._last = i
                    return out
                errors.append(e)
                continue
            except NotFoundError as e:
                log.debug("board %s: %s not found; trying the next", board.url, what)
                errors.append(e)
                continue
            except (BoardError, OSError) as e:
                if i < len(self.boards) - 1:
                    log.warning("board %s failed (%s: %s); falling back to the next", board.url,
                                what, e)
                self._down_until[i] = time.monotonic() + self.cooldown
                errors.append(e)
                continue
            self._down_until[i] = 0.0
            self.served[i] += 1
            self._last = i
            return out
        if all(isinstance(e, NotFoundError) for e in errors):
            raise NotFoundError(f"{what}: not found on any of {self.url}")
        last = next(e for e in reversed(errors) if not isinstance(e, NotFoundError))
        if isinstance(last, BadCopyError):
            raise BadCopyError(f"{what}: no board holds a good copy ({self.url}); last: {last}")
        raise BoardError(f"{what}: every board failed ({self.url}); last: {last}") from last

    async def get(self, key: str, max_bytes: int | None = None) -> bytes:
        return await self._first(key, lambda b: b.get(key, max_bytes=max_bytes))

    async def get_file(self, key: str, dest: Path, size: int | None = None) -> None:
        # a partial download from a failed board is resumed from the next (same bytes: immutable)
        await self._first(key, lambda b: b.get_file(key, dest, size=size))

    async def get_verified(self, key: str, dest: Path, size: int, sha256: str) -> None:
        """The object from the first board whose copy matches `size` and `sha256`: a board that
        serves a bad copy is asked to refresh it (an HTTP relay re-fetches it from its origin),
        then the next board is tried (module doc)."""

        async def refreshed(i: int) -> None:
            if not await self.boards[i].get_refreshed(key, dest, size):
                raise BadCopyError(f"{key}: {self.boards[i].url} cannot refresh its copy")
            await asyncio.to_thread(check_copy, dest, key, size, sha256, self.boards[i].url)

        await self._first(key, lambda b: b.get_verified(key, dest, size, sha256),
                          on_bad=refreshed)

    async def get_refreshed(self, key: str, dest: Path, size: int) -> bool:
        return False  # get_verified refreshes the board that served a bad copy

    async def _first_listing(self, call: Callable[[Board], Awaitable[list[T] | None]]
                             ) -> list[T] | None:
        """The first board (in `_order`) that can list and answers: its listing, else None."""
        for i in self._order():
            try:
                got = await call(self.boards[i])
            except (BoardError, OSError):
                continue
            if got is not None:
                return got
        return None

    async def list_keys(self, prefix: str) -> list[str] | None:
        return await self._first_listing(lambda b: b.list_keys(prefix))

    async def exists(self, key: str) -> bool:
        async def one(b: Board) -> bool:
            if not await b.exists(key):
                raise NotFoundError(key)
            return True

        try:
            return await self._first(key, one)
        except NotFoundError:
            return False

    async def read_latest(self, run: str) -> Latest | None:
        async def one(b: Board) -> Latest:
            got = await b.read_latest(run)
            if got is None:
                raise NotFoundError(f"{run}/latest")
            return got

        try:
            near = await self._first(f"{run}/latest", one)
        except NotFoundError:
            return None
        if not self.check_latest or self._last_served() == len(self.boards) - 1:
            return near
        try:
            far = await self.boards[-1].read_latest(run)
        except (BoardError, OSError):
            return near  # the origin is unreachable: the replica is what there is
        if far is None or far.version <= near.version:
            return near
        self.behind += 1
        deadline = time.monotonic() + self.latest_wait
        while time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            with contextlib.suppress(BoardError, OSError):
                got = await self.boards[self._last_served()].read_latest(run)
                if got is not None and got.version >= far.version:
                    return got
        return far  # still behind: the origin's word; objects fall back to it on NotFoundError

    def _last_served(self) -> int:
        return self._last

    async def list_versions(self, run: str) -> list[int] | None:
        return await self._first_listing(lambda b: b.list_versions(run))

    async def put(self, key: str, src: bytes | Path, *, sha256: str | None = None) -> None:
        raise ReadOnlyBoardError(
            f"{self.url} is a list of read-only replicas; publish to the origin")

    async def move_latest(self, run: str, expected: int | None, new: Latest) -> None:
        raise ReadOnlyBoardError(f"{self.url} is a list of read-only replicas; cannot move latest")

    async def delete(self, key: str) -> None:
        raise ReadOnlyBoardError(f"{self.url} is a list of read-only replicas; cannot delete {key}")

    async def close(self) -> None:
        for b in self.boards:
            await b.close()


def open_fallback(urls: list[str], open_one: Callable[[str], Board], *,
                  relay_attempts: int = 2) -> FallbackBoard:
    """A FallbackBoard of `urls` (nearest first); HTTP relays before the last retry only
    `relay_attempts` times, so a dead relay hands over to the next board quickly."""
    from stitch_core.versions.board.http import HttpBoard

    boards = [open_one(u) for u in urls]
    for b in boards[:-1]:
        if isinstance(b, HttpBoard):
            import httpx

            b.refresh_token = b.refresh_token or Settings.read("relay_refresh_token")
            b.attempts = max(1, min(b.attempts, relay_attempts))
            b.timeout = httpx.Timeout(b.timeout.read or 30.0, connect=2.0)
    # an HTTP relay passes `latest` through to the origin (never cached: docs/relays.md), so
    # only a replica that holds its own copy (a NATS mirror, a directory) is checked against
    # the origin's
    return FallbackBoard(boards, check_latest=not isinstance(boards[0], HttpBoard))
