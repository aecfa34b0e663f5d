"""A read-only board over HTTP(S): any static file server or CDN (e.g. `stitch board serve`).

Keys are appended to the base URL with '/'. Reads retry with exponential backoff on connection
errors, timeouts, 5xx, 408 and 429 (never on other 4xx). `get_file` streams to `<dest>.part`,
resumes a partial file with a Range request and renames it into place when complete. Static
servers cannot list, so `list_versions` is None: followers walk from `<run>/latest`.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import httpx
from pydantic import ValidationError

from stitch_core.errors import StitchError
from stitch_core.versions.board.base import (
    BadCopyError,
    Board,
    BoardError,
    NotFoundError,
    ReadOnlyBoardError,
    check_key,
    open_part,
    part_path,
    part_size,
    too_large,
)
from stitch_core.versions.manifest import MAX_LATEST_BYTES, Latest, latest_key

T = TypeVar("T")
NO_CACHE = {"Cache-Control": "no-cache", "Pragma": "no-cache"}
CONTENT_RANGE_RE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")
CHUNK = 1 << 20
# asks a Stitch relay (nginx, stitch_core.versions.relay) to fetch this object from its origin
# again and replace its cached copy: honoured at most once a minute per object (and, where the
# relay has a refresh token, only with the token as the value); sent by a FallbackBoard only,
# after the relay served a copy that did not match the manifest (docs/relays.md)
REFRESH_HEADER = "X-Stitch-Refresh"


class _TransientError(StitchError, ConnectionError):
    """A failure worth retrying (5xx, 408, 429, a short body)."""


class HttpBoard(Board):
    """A read-only board under a base URL, with retried reads and resumable downloads."""

    readonly = True

    def __init__(self, url: str, *, timeout: float = 30.0, connect_timeout: float = 30.0,
                 attempts: int = 5, backoff: float = 0.2, max_backoff: float = 10.0,
                 headers: dict[str, str] | None = None, refresh_token: str | None = None):
        self.url = url.rstrip("/")
        self.refresh_token = refresh_token  # the value of REFRESH_HEADER (None: "1")
        self.timeout = httpx.Timeout(timeout, connect=connect_timeout)
        self.attempts = max(1, attempts)
        self.backoff = backoff
        self.max_backoff = max_backoff
        self.headers = {"User-Agent": "stitch-board", **(headers or {})}
        self._client: httpx.AsyncClient | None = None

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self.timeout, headers=self.headers,
                                             follow_redirects=True)
        return self._client

    async def close(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            await client.aclose()

    def _url(self, key: str) -> str:
        return f"{self.url}/{check_key(key)}"

    def _delay(self, failures: int) -> float:
        return min(self.backoff * 2 ** max(failures - 1, 0), self.max_backoff) * \
            random.uniform(0.5, 1.0)

    @staticmethod
    def _check(r: httpx.Response, what: str) -> None:
        code = r.status_code
        if code == 404:
            raise NotFoundError(f"{what}: not found")
        if code >= 500 or code in (408, 429):
            raise _TransientError(f"HTTP {code}")
        if code >= 400:
            raise BoardError(f"{what}: HTTP {code}")

    async def _retrying(self, what: str, once: Callable[[], Awaitable[T]]) -> T:
        for failures in range(1, self.attempts + 1):
            try:
                return await once()
            except (httpx.TransportError, _TransientError) as e:
                if failures >= self.attempts:
                    raise BoardError(f"{what}: {e!r} (gave up after {failures} attempts)") from e
                await asyncio.sleep(self._delay(failures))
        raise AssertionError("unreachable")

    async def _get(self, key: str, headers: dict[str, str] | None = None,
                   max_bytes: int | None = None) -> bytes:
        url = self._url(key)

        async def once() -> bytes:
            if max_bytes is None:
                r = await self._http().get(url, headers=headers)
                self._check(r, f"GET {url}")
                return r.content
            async with self._http().stream("GET", url, headers=headers) as r:
                self._check(r, f"GET {url}")
                declared = r.headers.get("content-length", "")
                if declared.isdigit() and int(declared) > max_bytes:
                    raise too_large(key, int(declared), max_bytes)
                parts, got = [], 0
                async for b in r.aiter_bytes():
                    got += len(b)
                    if got > max_bytes:
                        raise too_large(key, None, max_bytes)
                    parts.append(b)
                return b"".join(parts)

        return await self._retrying(f"GET {url}", once)

    async def get(self, key: str, max_bytes: int | None = None) -> bytes:
        return await self._get(key, max_bytes=max_bytes)

    async def exists(self, key: str) -> bool:
        url = self._url(key)

        async def once() -> bool:
            r = await self._http().head(url)
            try:
                self._check(r, f"HEAD {url}")
            except NotFoundError:
                return False
            return True

        return await self._retrying(f"HEAD {url}", once)

    async def read_latest(self, run: str) -> Latest | None:
        key = latest_key(run)
        try:
            data = await self._get(key, headers=NO_CACHE, max_bytes=MAX_LATEST_BYTES)
        except NotFoundError:
            return None
        try:
            return Latest.model_validate_json(data)
        except ValidationError as e:
            raise BoardError(f"bad latest at {self._url(key)}: {e}") from e

    async def get_refreshed(self, key: str, dest: Path, size: int) -> bool:
        """One GET of `key` carrying REFRESH_HEADER (not retried: a relay that refuses the
        refresh, 429 once a minute per object, is not asked again)."""
        tmp = part_path(Path(dest))
        tmp.unlink(missing_ok=True)  # a refreshed copy is fetched whole, never resumed
        await self.get_file(key, dest, size=size, attempts=1,
                            headers={REFRESH_HEADER: self.refresh_token or "1"})
        return True

    async def get_file(self, key: str, dest: Path, size: int | None = None, *,
                       headers: dict[str, str] | None = None,
                       attempts: int | None = None) -> None:
        """Download to `dest` via `dest.part`, resuming it; `size`: the exact expected size
        (BadCopyError if the object is not that size). `headers`: extra request headers;
        `attempts`: this download's attempts (default: the board's)."""
        url = self._url(key)
        extra = headers or {}
        attempts = attempts or self.attempts
        dest = Path(dest)
        tmp = part_path(dest)
        wrote = 0

        def reject(msg: str) -> BoardError:
            tmp.unlink(missing_ok=True)
            return BadCopyError(f"GET {url}: {msg}")

        async def once() -> bool:
            """One request; True when `tmp` holds the whole object, False to start over."""
            nonlocal wrote
            have = part_size(tmp)  # (a symlink planted there is removed, never followed)
            if size is not None and have > size:
                tmp.unlink()
                have = 0
            hdrs = {**extra, "Accept-Encoding": "identity"}
            if have:
                hdrs["Range"] = f"bytes={have}-"
            async with self._http().stream("GET", url, headers=hdrs) as r:
                if r.status_code == 416 and have:  # the .part is complete, or stale
                    m = re.match(r"^bytes \*/(\d+)$", r.headers.get("Content-Range", ""))
                    if m and int(m[1]) == have:
                        return True
                    tmp.unlink()
                    return False
                self._check(r, f"GET {url}")
                if r.status_code == 206:
                    m = CONTENT_RANGE_RE.match(r.headers.get("Content-Range", ""))
                    if not m or int(m[1]) != have:
                        raise BoardError(f"GET {url}: asked for bytes {have}-, got "
                                         f"{r.headers.get('Content-Range')!r}")
                    total = None if m[3] == "*" else int(m[3])
                    append = True
                else:  # 200: the server ignored the range, start from zero
                    have, append = 0, False
                    n = r.headers.get("Content-Length")
                    total = int(n) if n and n.isdigit() else None
                if size is not None and total is not None and total != size:
                    raise reject(f"object is {total} bytes, expected {size}")
                buf = bytearray()
                with open_part(tmp, append=append) as f:
                    try:
                        async for chunk in r.aiter_bytes():
                            if size is not None and have + len(chunk) > size:
                                raise reject(f"body is larger than the expected {size} bytes")
                            buf += chunk
                            have += len(chunk)
                            wrote += len(chunk)
                            if len(buf) >= CHUNK:
                                await asyncio.to_thread(f.write, bytes(buf))
                                buf.clear()
                    finally:  # keep what arrived before a failure: the next attempt resumes
                        await asyncio.to_thread(f.write, bytes(buf))
                    await asyncio.to_thread(_sync, f)
            if total is not None and have != total:
                raise _TransientError(f"short body: {have} of {total} bytes")
            return True

        failures = 0
        while True:
            before = wrote
            try:
                if await once():
                    break
                continue
            except (httpx.TransportError, _TransientError) as e:
                failures = 1 if wrote > before else failures + 1  # progress resets the count
                if failures >= attempts:
                    raise BoardError(f"GET {url}: {e!r} (gave up after {failures} attempts)") \
                        from e
                await asyncio.sleep(self._delay(failures))
        have = tmp.stat().st_size
        if size is not None and have != size:
            raise reject(f"got {have} bytes, expected {size}")
        tmp.replace(dest)

    async def put(self, key: str, src: bytes | Path, *, sha256: str | None = None) -> None:
        raise ReadOnlyBoardError(f"HTTP board {self.url} is read-only; publish to the board "
                                 f"directory it serves (or a local/NATS board) instead")

    async def move_latest(self, run: str, expected: int | None, new: Latest) -> None:
        raise ReadOnlyBoardError(f"HTTP board {self.url} is read-only; cannot move latest of {run}")

    async def list_versions(self, run: str) -> list[int] | None:
        return None

    async def delete(self, key: str) -> None:
        raise ReadOnlyBoardError(f"HTTP board {self.url} is read-only; cannot delete {key} (run "
                            f"`stitch gc` on the board directory it serves, or a NATS board)")


def _sync(f) -> None:
    f.flush()
    os.fsync(f.fileno())
