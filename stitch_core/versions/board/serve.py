"""A small read-only HTTP server for a board directory (`stitch board serve DIR`).

Serves GET and HEAD for board keys only (no listings, no dot files, nothing outside the root),
single byte ranges (`bytes=a-b`, `bytes=a-`, `bytes=-n`) so followers can resume downloads, and
cache headers a CDN in front can use: `<run>/latest` is `no-cache`, objects under `versions/`
(manifests included: written once, never changed) are immutable, every answer carries a strong
ETag of the content (`"sha256:<hex>"`, from the version's manifest where it lists the object,
else hashed once and remembered) and `If-None-Match` is answered 304, and errors (404 included:
a version or a span manifest may appear later at a key that was missing) are `no-store`.
Bodies go out with sendfile in chunks, never read whole into memory. At most
`MAX_WORKERS` (256; `--workers`) connections are served at once (more wait in the listen
queue), a connection idle or stalled for 10 s is dropped, and malformed or absurd `Range`
headers are ignored (the whole file) or answered 416. For a fleet, put a real HTTP cache or
CDN in front (objects are immutable).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import threading
from email.utils import formatdate
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

from stitch_core.versions.board.base import KEY_RE

IMMUTABLE = "public, max-age=31536000, immutable"
RANGE_RE = re.compile(r"^bytes=(\d{0,19})-(\d{0,19})$")  # longer numbers: ignored (whole file)
# connections served at once (a thread each; more wait in the listen queue). Each follower
# keeps one keep-alive connection: 64 made a burst of 100 followers wait (benchmarks/
# fleet_load.py, p99 announce -> current 6.7 s vs 2.0 s with 256); idle ones are dropped after
# `BoardHandler.timeout`, so threads are not held between polls
MAX_WORKERS = 256
CHUNK = 1 << 20
MAX_LISTED = 1 << 20  # a manifest read for its object digests (ETags) at most this big
_ETAGS: dict[tuple, str] = {}  # (path, inode, mtime, size) -> strong ETag, bounded
_ETAGS_MAX = 4096
_ETAGS_LOCK = threading.Lock()


class BoardServer(ThreadingHTTPServer):
    """The threaded HTTP server of `stitch board serve`, serving the directory `root`."""

    daemon_threads = True
    # the listen queue: socketserver's default of 5 makes a fleet that wakes at once on an
    # announcement (100 followers) lose SYNs and wait 1, 3, 7, 15 s for retransmits
    # (benchmarks/fleet_load.py: p99 announce -> current 19 s with 5, 1.8 s with 1024)
    request_queue_size = 1024

    def __init__(self, addr: tuple[str, int], handler: type[BoardHandler], root: Path,
                 verbose: bool = False, max_workers: int = MAX_WORKERS):
        if ":" in addr[0]:
            self.address_family = socket.AF_INET6
        self.root = root
        self.verbose = verbose
        # a bounded pool: at most `max_workers` handler threads; the accept loop waits for a
        # free one, so a flood of (slow) clients queues in the backlog instead of spawning a
        # thread each. A client idle for `BoardHandler.timeout` seconds is dropped.
        self.max_workers = max_workers
        self._slots = threading.BoundedSemaphore(max_workers)
        self.active = 0  # handler threads running now (status, tests)
        self.peak = 0
        self._count = threading.Lock()
        super().__init__(addr, handler)

    def process_request(self, request, client_address) -> None:
        self._slots.acquire()
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        with self._count:
            self.active += 1
            self.peak = max(self.peak, self.active)
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._count:
                self.active -= 1
            self._slots.release()

    def handle_error(self, request, client_address) -> None:
        if self.verbose:
            super().handle_error(request, client_address)


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
    """`latest` must be revalidated every time; published version objects never change."""
    parts = key.split("/")
    if parts[-1] != "latest" and "versions" in parts[:-1]:
        return IMMUTABLE
    return "no-cache"


def _listed_sha256(path: Path, size: int) -> str | None:
    """The sha256 the version's manifest (beside `path`) lists for `path`, if it lists it with
    this size: a snapshot's ETag costs no hashing of its weights."""
    if path.name == "manifest.json":
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


class BoardHandler(BaseHTTPRequestHandler):
    """Answers GET and HEAD for board keys under the server's root (byte ranges, cache headers)."""

    server: BoardServer
    server_version = "stitch-board"
    protocol_version = "HTTP/1.1"
    timeout = 10  # seconds a connection may be idle or stalled (slow clients) before it is dropped
    disable_nagle_algorithm = True  # headers and body are separate writes: no 40 ms ACK stalls

    def do_GET(self) -> None:
        self._serve(body=True)

    def do_HEAD(self) -> None:
        self._serve(body=False)

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
                self.connection.sendfile(f, offset=start, count=length)

    def log_message(self, format: str, *args) -> None:
        if self.server.verbose:
            super().log_message(format, *args)


def serve(root: str | os.PathLike, host: str = "127.0.0.1", port: int = 8000, *,
          verbose: bool = False, handler: type[BoardHandler] = BoardHandler,
          max_workers: int = MAX_WORKERS) -> BoardServer:
    """A bound server for the board directory `root`; the caller runs `serve_forever()`."""
    root = Path(root).expanduser().resolve()
    if not root.is_dir():
        raise NotADirectoryError(f"board directory {root} does not exist")
    return BoardServer((host, port), handler, root, verbose, max_workers)


def run_server(root: str | os.PathLike, host: str = "127.0.0.1", port: int = 8000, *,
               verbose: bool = False, max_workers: int = MAX_WORKERS) -> None:
    """Serve `root` until interrupted, printing the board URL."""
    server = serve(root, host, port, verbose=verbose, max_workers=max_workers)
    shown = f"[{host}]" if ":" in host else host
    print(f"serving board {server.root} at http://{shown}:{server.server_port}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
