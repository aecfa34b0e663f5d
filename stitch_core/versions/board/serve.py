"""A small read-only HTTP server for a board directory (`stitch board serve DIR`).

Serves GET and HEAD for board keys only (no listings, no dot files, nothing outside the root;
other methods are 405), single byte ranges (`bytes=a-b`, `bytes=a-`, `bytes=-n`) so followers
can resume downloads, and cache headers a CDN in front can use: `<run>/latest` and a version's
`spans.json` (rewritten in place by the squasher) are `no-cache`, every other object under
`versions/` (manifests included: written once, never changed) is immutable, every answer carries
a strong ETag of the content (`"sha256:<hex>"`, from the version's manifest where it lists the
object, else hashed once and remembered) and `If-None-Match` is answered 304, and errors (404
included: a version or a span manifest may appear later at a key that was missing) are
`no-store`. Malformed or absurd `Range` headers are ignored (the whole file) or answered 416.

It is an ASGI app (`BoardApp`) under uvicorn, with the connection handling of `serve_conns`: a
deadline for each whole request head (`--head-timeout`, 10 s: a slow loris is closed, however
it dribbles), caps on connections per client address and in all, and asynchronous sends (a slow
reader holds only its own connection; one stalled `SEND_TIMEOUT` s on a chunk is dropped). The
thread-per-connection server it replaces let 4 dribbling connections (256 with the default
pool) make every follower wait. Deciding an answer (resolving the key, stat, the ETag) runs in a
small thread pool, as `BoardHandler._serve` with the request-handler surface the old server had
(tests and benchmarks subclass it to count or inject faults); bodies are read from the file in
chunks off the event loop, never whole. For a fleet, put a real HTTP cache or CDN in front.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import sys
import threading
import traceback
from email.utils import formatdate
from http import HTTPStatus
from http.client import HTTPMessage
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from stitch_core.versions.board.base import KEY_RE
from stitch_core.versions.board.serve_conns import (
    HEAD_TIMEOUT,
    MAX_CONNS,
    MAX_CONNS_PER_CLIENT,
    SEND_TIMEOUT,
    BoardApp,
    BoardServer,
    Connection,
)

__all__ = ["HEAD_TIMEOUT", "IMMUTABLE", "MAX_CONNS", "MAX_CONNS_PER_CLIENT", "MAX_WORKERS",
           "BoardApp", "BoardHandler", "BoardServer", "cache_control", "content_etag",
           "parse_range", "run_server", "serve"]

IMMUTABLE = "public, max-age=31536000, immutable"
RANGE_RE = re.compile(r"^bytes=(\d{0,19})-(\d{0,19})$")  # longer numbers: ignored (whole file)
MUTABLE_NAMES = frozenset({"latest", "spans.json"})  # rewritten in place: revalidated each time
MAX_WORKERS = MAX_CONNS  # the old name of the connection cap (`--workers`)
CHUNK = 1 << 20  # hashing
MAX_LISTED = 1 << 20  # a manifest read for its object digests (ETags) at most this big
_ETAGS: dict[tuple, str] = {}  # (path, inode, mtime, size) -> strong ETag, bounded
_ETAGS_MAX = 4096
_ETAGS_LOCK = threading.Lock()


def _key_of(raw_path: str) -> str | None:
    """The board key a request path names, or None if it is not a plain safe key."""
    path = unquote(urlsplit(raw_path).path)
    key = path.removeprefix("/")
    if "\x00" in key or not KEY_RE.match(key) or ".." in key.split("/"):
        return None
    return key


def parse_range(header: str, size: int) -> tuple[int, int] | None | bool:
    """(start, end) inclusive for one satisfiable range; None: ignore it; False: unsatisfiable."""
    m = RANGE_RE.match(header.strip())
    if not m or (not m[1] and not m[2]):
        return None  # malformed or multi-range: serve the whole file (RFC 9110 allows this)
    if not m[1]:  # suffix: the last n bytes
        n = int(m[2])
        return (max(size - n, 0), size - 1) if n and size else False
    start = int(m[1])
    end = min(int(m[2]), size - 1) if m[2] else size - 1
    if m[2] and int(m[2]) < start:
        return None
    return (start, end) if start < size else False


def cache_control(key: str) -> str:
    """`latest` and `spans.json` must be revalidated every time; other published version objects
    never change."""
    parts = key.split("/")
    if parts[-1] not in MUTABLE_NAMES and "versions" in parts[:-1]:
        return IMMUTABLE
    return "no-cache"


def _listed_sha256(path: Path, size: int) -> str | None:
    """The sha256 the version's manifest (beside `path`) lists for `path`, if it lists it with
    this size: a snapshot's ETag costs no hashing of its weights. Never for a file rewritten in
    place (its listed digest may be stale at the same size)."""
    if path.name == "manifest.json" or path.name in MUTABLE_NAMES:
        return None
    try:
        m = path.with_name("manifest.json")
        if m.stat().st_size > MAX_LISTED:
            return None
        objs = json.loads(m.read_bytes()).get("objects") or []
        for o in objs:
            if o.get("path") == path.name and o.get("size") == size:
                sha = str(o.get("sha256", ""))
                return sha if re.fullmatch(r"[0-9a-f]{64}", sha) else None
    except (OSError, ValueError, AttributeError):
        return None
    return None


def content_etag(path: Path, st: os.stat_result, f) -> str:
    """A strong ETag naming the content: `"sha256:<hex>"` of the file's bytes (the manifest's
    listed digest for a version object, else the file hashed once; remembered per inode, mtime
    and size, so a rewritten `latest` gets a new one)."""
    k = (str(path), st.st_ino, st.st_mtime_ns, st.st_size)
    with _ETAGS_LOCK:
        tag = _ETAGS.get(k)
    if tag is not None:
        return tag
    sha = _listed_sha256(path, st.st_size)
    if sha is None:
        h = hashlib.sha256()
        f.seek(0)
        while b := f.read(CHUNK):
            h.update(b)
        f.seek(0)
        sha = h.hexdigest()
    tag = f'"sha256:{sha}"'
    with _ETAGS_LOCK:
        if len(_ETAGS) >= _ETAGS_MAX:
            _ETAGS.clear()
        _ETAGS[k] = tag
    return tag


def _content_type(key: str) -> str:
    name = key.rsplit("/", 1)[-1]
    return "application/json" if name.endswith(".json") or name == "latest" \
        else "application/octet-stream"


class BoardHandler:
    """One request: answers GET and HEAD for board keys under the server's root (byte ranges,
    cache headers). Runs in the app's thread pool and keeps the request-handler surface of
    `http.server` that subclasses use (`command`, `path`, `headers`, `client_address`, `server`,
    `do_GET`, `_serve`, `send_response`/`send_header`/`end_headers`, `wfile`,
    `close_connection`); the answer is recorded here and sent by `BoardApp`. The body of a file
    is attached with `send_file`. `timeout`: the request-head deadline unless `serve()` is given
    one."""

    server_version = "stitch-board"
    protocol_version = "HTTP/1.1"
    timeout = HEAD_TIMEOUT

    def __init__(self, server: BoardServer, scope: dict[str, Any]):
        self.server = server
        self.command: str = scope["method"]
        query = scope.get("query_string") or b""
        self.path = scope["raw_path"].decode("latin-1") + ("?" + query.decode("latin-1")
                                                           if query else "")
        self.request_version = "HTTP/" + scope.get("http_version", "1.1")
        self.requestline = f"{self.command} {self.path} {self.request_version}"
        self.headers = HTTPMessage()
        for k, v in scope["headers"]:
            self.headers[k.decode("latin-1")] = v.decode("latin-1")
        self.client_address = tuple(scope.get("client") or ("", 0))
        self.close_connection = False
        self._reset()

    def _reset(self) -> None:
        self.code = 0
        self.response_headers: list[tuple[str, str]] = []
        self.wfile = io.BytesIO()
        self.file: tuple[int, int, int] | None = None  # (fd, offset, count) to send after wfile

    @property
    def connection(self) -> Connection:
        """The client's connection (`shutdown()` cuts it), as far as a subclass needs one."""
        return Connection(self.server, self.client_address)

    def run(self) -> None:
        """Decide the answer (in a pool thread): a failure is a 500, never a hung client."""
        try:
            self.setup()
            try:
                self.handle()
            finally:
                self.finish()
        except Exception:  # noqa: BLE001 - any bug in a handler: answered, logged if verbose
            if self.server.verbose:
                traceback.print_exc()
            self._drop_file()
            self._reset()
            self.close_connection = True
            self._status(500)

    def setup(self) -> None:
        """Called before each request (a hook for subclasses)."""

    def finish(self) -> None:
        """Called after each request (a hook for subclasses)."""

    def handle(self) -> None:
        method = getattr(self, "do_" + self.command, None) if self.command.isalpha() else None
        if method is None:
            return self._status(405, {"Allow": "GET, HEAD"})
        method()

    def do_GET(self) -> None:
        self._serve(body=True)

    def do_HEAD(self) -> None:
        self._serve(body=False)

    # ---------------------------------------------------------------- the answer, recorded

    def send_response(self, code: int, message: str | None = None) -> None:
        self.log_request(code)
        self.code = code

    def send_header(self, keyword: str, value: str) -> None:
        if keyword.lower() == "connection" and value.lower() == "close":
            self.close_connection = True
        self.response_headers.append((keyword, str(value)))

    def end_headers(self) -> None:
        """Nothing to flush: `BoardApp` sends the recorded answer when the handler returns."""

    def send_file(self, f, offset: int, count: int) -> None:
        """Send `count` bytes of the open file `f` from `offset` as the body (after `wfile`)."""
        self._drop_file()
        self.file = (os.dup(f.fileno()), offset, count)

    def _drop_file(self) -> None:
        if getattr(self, "file", None) is not None:
            os.close(self.file[0])
            self.file = None

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        self.log_message('"%s" %s %s', self.requestline, str(code), str(size))

    def log_message(self, format: str, *args) -> None:
        if self.server.verbose:
            sys.stderr.write(f"{self.client_address[0]} - - [{formatdate(usegmt=True)}] "
                             f"{format % args}\n")

    # ---------------------------------------------------------------- board keys

    def _resolve(self) -> tuple[str, Path] | None:
        key = _key_of(self.path)
        if key is None:
            return None
        root = self.server.root
        path = (root / key).resolve()
        if not path.is_relative_to(root) or not path.is_file():
            return None
        return key, path

    def _status(self, code: int, headers: dict[str, str] | None = None) -> None:
        body = f"{code} {HTTPStatus(code).phrase}\n".encode()
        self.send_response(code)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        # never cached (a CDN may hold a 404 by heuristics otherwise): the key may exist later
        self.send_header("Cache-Control", "no-store")
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _serve(self, body: bool) -> None:
        found = self._resolve()
        if found is None:
            return self._status(404)
        key, path = found
        try:
            f = open(path, "rb")  # noqa: SIM115 - closed below
        except OSError:
            return self._status(404)
        with f:
            st = os.fstat(f.fileno())
            size = st.st_size
            etag = content_etag(path, st, f)
            inm = self.headers.get("If-None-Match")
            if inm and (inm.strip() == "*" or etag in [t.strip() for t in inm.split(",")]):
                self.send_response(304)
                self.send_header("ETag", etag)
                self.send_header("Cache-Control", cache_control(key))
                self.end_headers()
                return
            start, end, code = 0, size - 1, 200
            rng = self.headers.get("Range")
            if rng and self.headers.get("If-Range", etag) == etag:
                r = parse_range(rng, size)
                if r is False:
                    return self._status(416, {"Content-Range": f"bytes */{size}"})
                if r is not None:
                    (start, end), code = r, 206
            length = end - start + 1
            self.send_response(code)
            self.send_header("Content-Type", _content_type(key))
            self.send_header("Content-Length", str(length))
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("ETag", etag)
            self.send_header("Last-Modified", formatdate(st.st_mtime, usegmt=True))
            self.send_header("Cache-Control", cache_control(key))
            if code == 206:
                self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
            self.end_headers()
            if body and length > 0:
                self.send_file(f, start, length)


def serve(root: str | os.PathLike, host: str = "127.0.0.1", port: int = 8000, *,
          verbose: bool = False, handler: type[BoardHandler] = BoardHandler,
          max_workers: int | None = None, max_conns: int = MAX_CONNS,
          max_conns_per_client: int = MAX_CONNS_PER_CLIENT, head_timeout: float | None = None,
          send_timeout: float = SEND_TIMEOUT) -> BoardServer:
    """A bound server for the board directory `root`; the caller runs `serve_forever()`.
    `max_workers`: the old name of `max_conns`; `head_timeout`: default `handler.timeout`."""
    root = Path(root).expanduser().resolve()
    if not root.is_dir():
        raise NotADirectoryError(f"board directory {root} does not exist")
    app = BoardApp(handler, send_timeout=send_timeout)
    server = BoardServer(
        app, (host, port), max_conns=max_workers or max_conns,
        max_conns_per_client=max_conns_per_client,
        head_timeout=handler.timeout if head_timeout is None else head_timeout, verbose=verbose)
    server.root = root
    app.server = server
    return server


def run_server(root: str | os.PathLike, host: str = "127.0.0.1", port: int = 8000, *,
               verbose: bool = False, max_workers: int | None = None,
               max_conns: int = MAX_CONNS, max_conns_per_client: int = MAX_CONNS_PER_CLIENT,
               head_timeout: float | None = None) -> None:
    """Serve `root` until interrupted, printing the board URL."""
    server = serve(root, host, port, verbose=verbose, max_workers=max_workers,
                   max_conns=max_conns, max_conns_per_client=max_conns_per_client,
                   head_timeout=head_timeout)
    shown = f"[{host}]" if ":" in host else host
    print(f"serving board {server.root} at http://{shown}:{server.server_port} (at most "
          f"{server.max_conns} connections, {server.max_conns_per_client or 'any number'} per "
          f"client; request heads within {server.head_timeout:g} s)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
