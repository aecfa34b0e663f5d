"""HttpBoard against a real `stitch board serve` server on 127.0.0.1 (no mocks).

The server's handler is subclassed to record requests and to inject failures: 503s, bodies cut
mid-stream, ignored Range headers. The board directory is written with LocalBoard.
"""

from __future__ import annotations

import asyncio
import http.client
import os
import threading

import pytest

from stitch_core.versions.board import BoardError, NotFoundError, ReadOnlyBoardError, open_board
from stitch_core.versions.board.http import HttpBoard
from stitch_core.versions.board.local import LocalBoard
from stitch_core.versions.board.serve import (
    IMMUTABLE,
    BoardHandler,
    cache_control,
    parse_range,
    serve,
)
from stitch_core.versions.manifest import Latest, latest_key, manifest_key
from stitch_dev.ports import free_port

RUN = "run-a"
BIG = f"{RUN}/versions/000001/model.safetensors"
MANIFEST = manifest_key(RUN, 1)
PREFIX = "boards"  # the board lives under the served root: keys are appended to a URL prefix
SECRET = b"secret outside the root"


class FaultyHandler(BoardHandler):
    """Records (method, path, Range) and misbehaves on demand via the server's `faults`."""

    def _serve(self, body: bool) -> None:
        srv = self.server
        srv.log.append((self.command, self.path, self.headers.get("Range")))
        if srv.faults["fail"] > 0:
            srv.faults["fail"] -= 1
            return self._status(503)
        if srv.faults["ignore_range"]:
            del self.headers["Range"]
        if self.command == "GET" and self.path.endswith(".safetensors"):
            if srv.faults["cut"]:
                cut, srv.faults["cut"] = srv.faults["cut"], 0
                return self._raw(cut, length=True)
            if srv.faults["no_length"]:
                return self._raw(None, length=False)
        return super()._serve(body)

    def _raw(self, n: int | None, length: bool) -> None:
        """Send the file's first `n` bytes (all: None), with or without Content-Length, and
        drop the connection."""
        _, path = self._resolve()
        data = path.read_bytes()
        self.send_response(200)
        if length:
            self.send_header("Content-Length", str(len(data)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data[:n])
        self.close_connection = True


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    top = tmp_path_factory.mktemp("http")
    (top / "secret.txt").write_bytes(SECRET)
    www = top / "www"
    root = www / PREFIX
    data = os.urandom(3 << 20) + b"tail"
    latest = Latest(run=RUN, version=1, kind="snapshot", updated="2026-01-01T00:00:00Z")

    async def populate() -> None:
        b = LocalBoard(root)
        await b.put(BIG, data)
        await b.put(MANIFEST, b'{"hello": 1}')
        await b.move_latest(RUN, None, latest)

    asyncio.run(populate())
    server = serve(www, "127.0.0.1", 0, handler=FaultyHandler)
    server.log, server.faults = [], {}
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{server.server_port}"
    yield {"server": server, "base": base, "url": f"{base}/{PREFIX}", "root": root,
           "data": data, "latest": latest}
    server.shutdown()
    server.server_close()
    thread.join(5)


@pytest.fixture
def srv(site):
    server = site["server"]
    server.log.clear()
    server.faults.update(fail=0, ignore_range=False, cut=0, no_length=False)
    return server


@pytest.fixture
async def board(site, srv):
    b = HttpBoard(site["url"] + "/", backoff=0.001, timeout=5)
    yield b
    await b.close()


def ranges(srv) -> list[str | None]:
    return [r for m, p, r in srv.log if m == "GET" and p.endswith(".safetensors")]


async def test_get_and_not_found(board, site, srv):
    assert board.url == site["url"]
    assert await board.get(MANIFEST) == b'{"hello": 1}'
    assert await board.get(BIG) == site["data"]
    with pytest.raises(NotFoundError):
        await board.get(f"{RUN}/versions/000002/manifest.json")
    assert len(srv.log) == 3  # a 404 is not retried
    with pytest.raises(BoardError):
        await board.get("../secret.txt")  # rejected before any request
    assert len(srv.log) == 3


async def test_exists(board, srv):
    assert await board.exists(MANIFEST)
    assert await board.exists(latest_key(RUN))
    assert not await board.exists(f"{RUN}/versions/000009/manifest.json")
    assert not await board.exists(f"{RUN}/versions")  # directories are not objects
    assert [m for m, _, _ in srv.log] == ["HEAD"] * 4


async def test_read_latest(board, site):
    assert await board.read_latest(RUN) == site["latest"]
    assert await board.read_latest("other-run") is None
    assert await board.list_versions(RUN) is None


async def test_read_only(board, site, srv):
    assert board.readonly
    with pytest.raises(ReadOnlyBoardError, match="read-only"):
        await board.put(f"{RUN}/versions/000002/x", b"x")
    with pytest.raises(ReadOnlyBoardError):
        await board.move_latest(RUN, 1, site["latest"].model_copy(update={"version": 2}))
    assert srv.log == []


async def test_get_file_full(board, site, srv, tmp_path):
    dest = tmp_path / "model.safetensors"
    await board.get_file(BIG, dest, size=len(site["data"]))
    assert dest.read_bytes() == site["data"]
    assert not (tmp_path / "model.safetensors.part").exists()
    assert ranges(srv) == [None]


async def test_get_file_resumes_part(board, site, srv, tmp_path):
    data, n = site["data"], 1_000_003
    dest = tmp_path / "model.safetensors"
    (tmp_path / "model.safetensors.part").write_bytes(data[:n])
    await board.get_file(BIG, dest, size=len(data))
    assert dest.read_bytes() == data
    assert ranges(srv) == [f"bytes={n}-"]


async def test_get_file_complete_part(board, site, srv, tmp_path):
    data = site["data"]
    dest = tmp_path / "model.safetensors"
    (tmp_path / "model.safetensors.part").write_bytes(data)
    await board.get_file(BIG, dest)  # the server answers 416 */size: nothing left to fetch
    assert dest.read_bytes() == data
    assert ranges(srv) == [f"bytes={len(data)}-"]


async def test_get_file_stale_part_too_long(board, site, srv, tmp_path):
    data = site["data"]
    dest = tmp_path / "model.safetensors"
    (tmp_path / "model.safetensors.part").write_bytes(b"x" * (len(data) + 10))
    await board.get_file(BIG, dest)  # 416 with another size: start over
    assert dest.read_bytes() == data
    assert ranges(srv) == [f"bytes={len(data) + 10}-", None]


async def test_get_file_server_ignores_range(board, site, srv, tmp_path):
    data = site["data"]
    srv.faults["ignore_range"] = True
    dest = tmp_path / "model.safetensors"
    (tmp_path / "model.safetensors.part").write_bytes(b"garbage")
    await board.get_file(BIG, dest, size=len(data))  # a 200 answer restarts from zero
    assert dest.read_bytes() == data
    assert ranges(srv) == ["bytes=7-"]


async def test_get_file_resumes_after_cut(board, site, srv, tmp_path):
    data = site["data"]
    srv.faults["cut"] = 777_777
    dest = tmp_path / "model.safetensors"
    await board.get_file(BIG, dest, size=len(data))
    assert dest.read_bytes() == data
    assert ranges(srv) == [None, "bytes=777777-"]


async def test_get_file_too_large(board, site, srv, tmp_path):
    dest = tmp_path / "model.safetensors"
    with pytest.raises(BoardError, match="expected 1000"):
        await board.get_file(BIG, dest, size=1000)
    assert list(tmp_path.iterdir()) == []
    srv.faults["ignore_range"] = True  # a 200 answer to a resume, of the wrong length
    (tmp_path / "model.safetensors.part").write_bytes(b"x" * 10)
    with pytest.raises(BoardError, match="expected"):
        await board.get_file(BIG, dest, size=len(site["data"]) - 1)
    assert list(tmp_path.iterdir()) == []


async def test_get_file_body_limit_without_length(board, site, srv, tmp_path):
    srv.faults["no_length"] = True  # no Content-Length: only the streamed byte count can tell
    dest = tmp_path / "model.safetensors"
    with pytest.raises(BoardError, match="larger than the expected 1000 bytes"):
        await board.get_file(BIG, dest, size=1000)
    assert list(tmp_path.iterdir()) == []
    await board.get_file(BIG, dest, size=len(site["data"]))
    assert dest.read_bytes() == site["data"]


async def test_get_file_too_small(board, site, tmp_path):
    dest = tmp_path / "model.safetensors"
    with pytest.raises(BoardError, match="expected"):
        await board.get_file(BIG, dest, size=len(site["data"]) + 1)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(NotFoundError):
        await board.get_file(f"{RUN}/versions/000001/missing", dest)
    assert list(tmp_path.iterdir()) == []


async def test_retries_5xx(board, site, srv, tmp_path):
    srv.faults["fail"] = 2
    assert await board.get(MANIFEST) == b'{"hello": 1}'
    assert len(srv.log) == 3
    srv.faults["fail"] = 2
    assert await board.read_latest(RUN) == site["latest"]
    srv.faults["fail"] = 2
    assert await board.exists(MANIFEST)
    srv.faults["fail"] = 2
    await board.get_file(BIG, tmp_path / "m", size=len(site["data"]))
    assert (tmp_path / "m").read_bytes() == site["data"]
    srv.log.clear()
    srv.faults["fail"] = 100
    with pytest.raises(BoardError, match="5 attempts"):
        await board.get(MANIFEST)
    assert len(srv.log) == 5


async def test_retries_connection_refused(site):
    b = HttpBoard(f"http://127.0.0.1:{free_port()}", attempts=3, backoff=0.001, timeout=2)
    try:
        with pytest.raises(BoardError, match="3 attempts"):
            await b.get(MANIFEST)
    finally:
        await b.close()


def raw(site, path: str, method: str = "GET", headers: dict | None = None):
    conn = http.client.HTTPConnection("127.0.0.1", site["server"].server_port, timeout=5)
    try:
        conn.request(method, path, headers=headers or {})
        r = conn.getresponse()
        return r.status, dict(r.getheaders()), r.read()
    finally:
        conn.close()


@pytest.mark.parametrize("path", [
    "/../secret.txt", "/%2e%2e/secret.txt", "/boards/../../secret.txt",
    "/boards/%2e%2e/%2e%2e/secret.txt", "/boards/..%2f..%2fsecret.txt", "/%2E%2E%2Fsecret.txt",
    "//secret.txt", "/boards/run-a/.latest.lock", "/boards/run-a/latest%00", "/", "/boards/",
    "/boards/run-a/versions", "/boards\\..\\secret.txt",
])
def test_server_refuses_traversal_and_listing(site, srv, path):
    status, _, body = raw(site, path)
    assert status in (400, 404)
    assert SECRET not in body and b"run-a" not in body


def test_server_symlink_out_of_root(site, srv):
    link = site["root"] / RUN / "escape"
    link.symlink_to(site["root"].parent.parent / "secret.txt")
    try:
        status, _, body = raw(site, f"/{PREFIX}/{RUN}/escape")
        assert status == 404 and SECRET not in body
    finally:
        link.unlink()


def test_server_headers_and_ranges(site, srv):
    data, url = site["data"], f"/{PREFIX}/{BIG}"
    status, h, body = raw(site, url)
    assert status == 200 and body == data and h["Cache-Control"] == IMMUTABLE
    assert h["Content-Length"] == str(len(data)) and h["Accept-Ranges"] == "bytes"
    status, h, body = raw(site, url, "HEAD")
    assert status == 200 and body == b"" and h["Content-Length"] == str(len(data))
    status, h, body = raw(site, url + "?cache=bust", headers={"Range": "bytes=10-19"})
    assert status == 206 and body == data[10:20]
    assert h["Content-Range"] == f"bytes 10-19/{len(data)}" and h["Content-Length"] == "10"
    status, h, body = raw(site, url, headers={"Range": "bytes=-4"})
    assert status == 206 and body == b"tail"
    status, h, body = raw(site, url, headers={"Range": f"bytes={len(data)}-"})
    assert status == 416 and h["Content-Range"] == f"bytes */{len(data)}"
    status, h, body = raw(site, url, headers={"Range": "bytes=0-1,5-6"})
    assert status == 200 and body == data  # multi-range: whole file
    status, h, body = raw(site, url, headers={"Range": "bytes=0-1", "If-Range": '"other"'})
    assert status == 200 and body == data
    status, h, body = raw(site, f"/{PREFIX}/{latest_key(RUN)}")
    assert status == 200 and h["Cache-Control"] == "no-cache"
    assert Latest.model_validate_json(body) == site["latest"]


def test_cache_control():
    assert cache_control("r/versions/000001/manifest.json") == IMMUTABLE
    assert cache_control("cdn/r/versions/000001/w.safetensors") == IMMUTABLE
    assert cache_control("r/latest") == "no-cache"
    assert cache_control("versions/latest") == "no-cache"  # a run named "versions"


def test_parse_range():
    assert parse_range("bytes=0-9", 100) == (0, 9)
    assert parse_range("bytes=90-200", 100) == (90, 99)
    assert parse_range("bytes=5-", 100) == (5, 99)
    assert parse_range("bytes=-10", 100) == (90, 99)
    assert parse_range("bytes=-500", 100) == (0, 99)
    assert parse_range("bytes=100-", 100) is False
    assert parse_range("bytes=-0", 100) is False
    assert parse_range("bytes=9-5", 100) is None
    assert parse_range("bytes=0-1,3-4", 100) is None
    assert parse_range("items=0-1", 100) is None


async def test_open_board_http(site):
    b = open_board(site["url"])
    assert isinstance(b, HttpBoard) and b.url == site["url"]
    async with b:
        assert await b.read_latest(RUN) == site["latest"]
    assert isinstance(open_board("https://cdn.example/prefix"), HttpBoard)


def test_serve_rejects_missing_dir(tmp_path):
    with pytest.raises(NotADirectoryError):
        serve(tmp_path / "nope", "127.0.0.1", 0)


async def test_get_with_a_size_limit_refuses_before_reading_whole(board, site, srv):
    """A reader's limit (manifests 64 MiB, `latest` 64 KiB): refused from Content-Length, or
    while streaming when the server sends none, never buffered whole; the local board checks
    the file's size first."""
    from stitch_core.versions.board.base import TooLargeError

    with pytest.raises(TooLargeError, match="over the 1,000-byte limit"):
        await board.get(BIG, max_bytes=1000)
    srv.faults["no_length"] = True
    with pytest.raises(TooLargeError, match="over the 1,000-byte limit"):
        await board.get(BIG, max_bytes=1000)
    srv.faults["no_length"] = False
    assert await board.get(BIG, max_bytes=len(site["data"])) == site["data"]
    local = LocalBoard(site["root"])
    with pytest.raises(TooLargeError):
        await local.get(BIG, max_bytes=1000)
    assert await local.get(MANIFEST, max_bytes=12) == b'{"hello": 1}'


async def test_a_huge_latest_or_manifest_is_refused(tmp_path, monkeypatch):
    from stitch_core.versions import store
    from stitch_core.versions.board.base import TooLargeError

    b = LocalBoard(tmp_path)
    (tmp_path / RUN).mkdir()
    (tmp_path / latest_key(RUN)).write_bytes(b" " * (65 << 10) + b"{}")
    with pytest.raises(TooLargeError):
        await b.read_latest(RUN)
    await b.put(manifest_key(RUN, 3), b"{" + b" " * 5000 + b"}")
    monkeypatch.setattr(store, "MAX_MANIFEST_BYTES", 4096)
    with pytest.raises(store.VersionError, match="refused: .* over the 4,096-byte limit"):
        await store.read_manifest(b, RUN, 3)  # unusable, like a malformed one


def test_bounded_workers_survive_slow_clients_and_absurd_ranges(site):
    """9 clients that never finish their request headers (slow loris) hold at most
    `max_workers` threads, each dropped after the handler timeout; a real request is still
    served; a 5,000-digit Range is ignored (the whole file), an unsatisfiable one is a 416."""
    import socket
    import time

    class Quick(BoardHandler):
        timeout = 1

    server = serve(site["root"].parent, "127.0.0.1", 0, handler=Quick, max_workers=3)
    server.log, server.faults = [], {}
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    port = server.server_port
    slow = []
    try:
        for _ in range(9):
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(b"GET /" + PREFIX.encode() + b"/")  # never finished
            slow.append(s)
        t0 = time.monotonic()
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.request("GET", f"/{PREFIX}/{MANIFEST}")
        r = conn.getresponse()
        assert r.status == 200 and r.read() == b'{"hello": 1}'
        assert time.monotonic() - t0 < 30  # queued behind the slow ones, not starved
        assert server.peak <= 3
        conn.request("GET", f"/{PREFIX}/{BIG}", headers={"Range": "bytes=" + "9" * 5000 + "-"})
        r = conn.getresponse()
        assert r.status == 200 and len(r.read()) == len(site["data"])
        conn.request("GET", f"/{PREFIX}/{BIG}", headers={"Range": f"bytes={10 ** 15}-"})
        r = conn.getresponse()
        assert r.status == 416
        r.read()
        conn.close()
    finally:
        for s in slow:
            s.close()
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_etags_304_and_what_is_revalidated(site, srv):
    """ETags: the digest a manifest lists (no hashing), else the content's; If-None-Match is a
    304 with the same cache headers. `spans.json` is rewritten in place by the squasher: it is
    `no-cache` like `latest` and its ETag is its content's even where a manifest lists it."""
    import hashlib
    import json

    vdir = site["root"] / RUN / "versions" / "000002"
    vdir.mkdir(parents=True, exist_ok=True)
    listed = "ab" * 32
    spans = b'{"run": "run-a", "version": 2, "bases": [0]}'
    (vdir / "w.bin").write_bytes(b"weights")
    (vdir / "spans.json").write_bytes(spans)
    (vdir / "manifest.json").write_text(json.dumps({"objects": [
        {"path": "w.bin", "size": 7, "sha256": listed},
        {"path": "spans.json", "size": len(spans), "sha256": "cd" * 32}]}))
    w, s = f"/{PREFIX}/{RUN}/versions/000002/w.bin", f"/{PREFIX}/{RUN}/versions/000002/spans.json"
    status, h, body = raw(site, w)
    assert status == 200 and body == b"weights" and h["ETag"] == f'"sha256:{listed}"'
    assert h["Cache-Control"] == IMMUTABLE and h["Content-Type"] == "application/octet-stream"
    status, h, body = raw(site, w, headers={"If-None-Match": f'"x", "sha256:{listed}"'})
    assert status == 304 and body == b"" and h["Cache-Control"] == IMMUTABLE
    status, h, body = raw(site, s)
    assert status == 200 and body == spans and h["Cache-Control"] == "no-cache"
    assert h["ETag"] == f'"sha256:{hashlib.sha256(spans).hexdigest()}"'
    assert h["Content-Type"] == "application/json"
    status, h, _ = raw(site, s, headers={"If-None-Match": h["ETag"]})
    assert status == 304 and h["Cache-Control"] == "no-cache"
    assert cache_control(f"{RUN}/versions/000002/spans.json") == "no-cache"
    assert cache_control(f"{RUN}/versions/000002/span-000000.json") == IMMUTABLE
    status, h, body = raw(site, f"/{PREFIX}/{RUN}/versions/000009/spans.json")
    assert status == 404 and h["Cache-Control"] == "no-store"
    status, h, body = raw(site, f"/{PREFIX}/{latest_key(RUN)}", "HEAD")
    assert status == 200 and body == b"" and h["Cache-Control"] == "no-cache"
    status, h, _ = raw(site, f"/{PREFIX}/{latest_key(RUN)}",
                       headers={"If-None-Match": h["ETag"]})
    assert status == 304 and h["Cache-Control"] == "no-cache"
