"""NatsBoard, announcements and heartbeats against a real nats-server process."""

from __future__ import annotations

import asyncio
import gc
import os
import socket
import time
import uuid
from pathlib import Path

import pytest

from stitch_core.versions import announce as an
from stitch_core.versions import nats_conn, streams
from stitch_core.versions.board import BoardError, LatestConflictError, NotFoundError, open_board
from stitch_core.versions.board.nats import CHUNK, NatsBoard, split_url
from stitch_core.versions.manifest import Announcement, Heartbeat, Latest, manifest_key
from stitch_core.versions.natsserver import NatsServer, NatsServerError, find_nats_server

WAIT = 5.0  # upper bound for anything that should be immediate


def _name(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:10]}"


def _latest(run: str, version: int) -> Latest:
    return Latest(run=run, version=version, kind="patch", updated="2025-01-01T00:00:00Z")


def _ann(run: str, version: int) -> Announcement:
    return Announcement(run=run, version=version, parent=version - 1 if version else None,
                        kind="patch", board="nats://x/stitch", manifest=manifest_key(run, version))


@pytest.fixture
async def board(nats_server):
    b = NatsBoard(f"{nats_server.url}/{_name('b')}", timeout=5)
    yield b
    await b.close()


@pytest.fixture
def doomed_server(tmp_path):
    """A server of its own, for tests that stop it."""
    server = NatsServer(tmp_path / "nats").start()
    yield server
    server.stop()


# -- the server ----------------------------------------------------------------------------------

def test_server_is_a_separate_process(nats_server):
    assert nats_server.running and nats_server.pid not in (None, os.getpid())
    host, port = nats_server.url.removeprefix("nats://").split(":")
    assert host == "127.0.0.1" and int(port) > 0
    with socket.create_connection((host, int(port)), timeout=2) as s:
        assert s.recv(4096).startswith(b"INFO ")  # the NATS protocol greeting
    assert os.access(find_nats_server(), os.X_OK)


def test_find_nats_server_env(monkeypatch, tmp_path):
    real = find_nats_server()
    monkeypatch.setenv("STITCH_NATS_SERVER", real)
    assert find_nats_server() == real
    monkeypatch.setenv("STITCH_NATS_SERVER", str(tmp_path / "nope"))
    with pytest.raises(NatsServerError, match="STITCH_NATS_SERVER"):
        find_nats_server()


def test_start_failure_reports_server_output(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = s.getsockname()[1]
        server = NatsServer(tmp_path / "nats", port=busy)
        with pytest.raises(NatsServerError, match="output") as err:
            server.start(timeout=10)
    assert "address already in use" in str(err.value).lower()
    assert not server.running


# -- objects -------------------------------------------------------------------------------------

async def test_put_get_roundtrip(board, tmp_path):
    big = os.urandom(3 * CHUNK + 7)  # several chunks, the last one short
    src = tmp_path / "src.bin"
    src.write_bytes(big)
    await board.put("r/versions/000001/small.bin", b"hello")
    await board.put("r/versions/000001/empty.bin", b"")
    await board.put("r/versions/000001/big.bin", src)
    assert await board.get("r/versions/000001/small.bin") == b"hello"
    assert await board.get("r/versions/000001/empty.bin") == b""
    assert await board.get("r/versions/000001/big.bin") == big
    dest = tmp_path / "out" / "big.bin"
    dest.parent.mkdir()
    await board.get_file("r/versions/000001/big.bin", dest)
    assert dest.read_bytes() == big and not dest.with_name("big.bin.part").exists()
    # the standard object store layout: nats-py's own reader (like the nats CLI) reads it too
    store = await (await board.connection()).jetstream().object_store(board.bucket)
    assert (await store.get("r/versions/000001/big.bin")).data == big
    assert await board.exists("r/versions/000001/big.bin")
    assert not await board.exists("r/versions/000001/missing.bin")
    with pytest.raises(NotFoundError):
        await board.get("r/versions/000001/missing.bin")
    with pytest.raises(NotFoundError):
        await board.get_file("r/versions/000001/missing.bin", tmp_path / "m")
    assert not (tmp_path / "m").exists() and not (tmp_path / "m.part").exists()
    with pytest.raises(BoardError):
        await board.put("../escape", b"x")


async def test_get_verified_checks_the_manifest_digest_while_streaming(board, tmp_path,
                                                                       monkeypatch):
    """A NATS download is checked against the manifest's size and SHA-256 with the digest
    computed while streaming: the file is not read back to hash it; a wrong digest or size
    leaves nothing at `dest`."""
    import hashlib

    from stitch_core.versions.board import base
    from stitch_core.versions.board.base import BadCopyError

    data = os.urandom(2 * CHUNK + 11)
    await board.put("r/versions/000002/p.stp", data)
    sha = hashlib.sha256(data).hexdigest()
    read_back: list[Path] = []
    real = base.sha256_file
    monkeypatch.setattr(base, "sha256_file", lambda p: read_back.append(p) or real(p))
    dest = tmp_path / "p.stp"
    await board.get_verified("r/versions/000002/p.stp", dest, len(data), sha)
    assert dest.read_bytes() == data and read_back == []
    for size, digest in ((len(data), "0" * 64), (len(data) + 1, sha)):
        bad = tmp_path / f"bad-{size}.stp"
        with pytest.raises(BadCopyError, match="the manifest says"):
            await board.get_verified("r/versions/000002/p.stp", bad, size, digest)
        assert not bad.exists() and not bad.with_name(bad.name + ".part").exists()


async def test_put_with_the_writers_digest_does_not_hash_again(board, tmp_path, monkeypatch):
    """`put(..., sha256=)` (what publishing passes: the digest the patch writer computed as it
    wrote, listed in the manifest) is stored as the object store's digest without hashing the
    content again; readers check it against the manifest as it streams, so a wrong one is
    caught there; a retry of the same content with the same digest is accepted."""
    import hashlib

    from stitch_core.versions.board import nats as nats_board

    data = os.urandom(2 * CHUNK + 5)
    sha = hashlib.sha256(data).hexdigest()
    src = tmp_path / "p.stp"
    src.write_bytes(data)
    hashed: list[int] = []
    real = hashlib.sha256
    monkeypatch.setattr(nats_board.hashlib, "sha256", lambda *a: hashed.append(1) or real(*a))
    await board.put("r/versions/000003/p.stp", src, sha256=sha)
    await board.put("r/versions/000003/p.stp", src, sha256=sha)  # a retry: same content
    assert hashed == []
    monkeypatch.setattr(nats_board.hashlib, "sha256", real)
    dest = tmp_path / "got.stp"
    await board.get_verified("r/versions/000003/p.stp", dest, len(data), sha)
    assert dest.read_bytes() == data
    # a writer that names the wrong digest: the content is stored under it, and a reader
    # refuses it as it streams (the content does not match the object store's digest)
    await board.put("r/versions/000004/p.stp", src, sha256="ab" * 32)
    with pytest.raises(BoardError, match="metadata says"):
        await board.get_verified("r/versions/000004/p.stp", tmp_path / "x.stp", len(data),
                                 "ab" * 32)
    with pytest.raises(ValueError, match="64 hex digits"):
        await board.put("r/versions/000005/p.stp", src, sha256="abc")


async def test_objects_are_immutable(board, tmp_path):
    key = "r/versions/000002/a.bin"
    await board.put(key, b"content")
    await board.put(key, b"content")  # same content: fine
    p = tmp_path / "same"
    p.write_bytes(b"content")
    await board.put(key, p)
    for other in (b"CONTENT", b"content!", b""):
        with pytest.raises(BoardError, match="immutable"):
            await board.put(key, other)
    assert await board.get(key) == b"content"


async def test_racing_puts_cannot_replace_each_other(nats_server):
    url = f"{nats_server.url}/{_name('b')}"
    async with NatsBoard(url) as a, NatsBoard(url) as b:
        blobs = [os.urandom(300_000), os.urandom(300_000)]
        res = await asyncio.gather(a.put("r/x.bin", blobs[0]), b.put("r/x.bin", blobs[1]),
                                   return_exceptions=True)
        assert sum(r is None for r in res) == 1, res
        assert all(isinstance(r, BoardError) for r in res if r is not None)
        winner = blobs[res.index(None)]
        assert await a.get("r/x.bin") == winner
        assert await b.get("r/x.bin") == winner


async def test_list_versions(board):
    run = "run-1"
    assert await board.list_versions(run) == []
    for v in (3, 1, 12):
        await board.put(manifest_key(run, v), b"{}")
    await board.put(f"{run}/versions/000007/patch.stp", b"no manifest yet")
    await board.put(manifest_key("run-10", 5), b"{}")  # another run with a common prefix
    assert await board.list_versions(run) == [1, 3, 12]
    assert await board.list_versions("run-10") == [5]


# -- latest --------------------------------------------------------------------------------------

async def test_move_latest_cas(board):
    run = "r"
    assert await board.read_latest(run) is None
    with pytest.raises(LatestConflictError):
        await board.move_latest(run, 0, _latest(run, 1))  # nothing there yet
    await board.move_latest(run, None, _latest(run, 1))
    assert (await board.read_latest(run)).version == 1
    with pytest.raises(LatestConflictError):
        await board.move_latest(run, None, _latest(run, 2))  # it exists now
    await board.move_latest(run, 1, _latest(run, 5))
    with pytest.raises(LatestConflictError):
        await board.move_latest(run, 1, _latest(run, 6))  # stale expected
    with pytest.raises(LatestConflictError):
        await board.move_latest(run, 5, _latest(run, 4))  # rewind
    with pytest.raises(LatestConflictError):
        await board.move_latest(run, 5, _latest(run, 5))  # not forward
    assert await board.read_latest(run) == _latest(run, 5)
    assert await board.read_latest("other") is None


@pytest.mark.parametrize("start", [None, 3])
async def test_move_latest_race_has_one_winner(nats_server, start):
    url = f"{nats_server.url}/{_name('b')}"
    async with NatsBoard(url) as a, NatsBoard(url) as b:
        if start is not None:
            await a.move_latest("r", None, _latest("r", start))
        for i in range(5):
            cur = (await a.read_latest("r"))
            expected = cur.version if cur else None
            base = expected or 0
            res = await asyncio.gather(
                a.move_latest("r", expected, _latest("r", base + 1)),
                b.move_latest("r", expected, _latest("r", base + 2)),
                return_exceptions=True)
            assert sum(r is None for r in res) == 1, (i, res)
            assert all(isinstance(r, LatestConflictError) for r in res if r is not None)
            assert (await b.read_latest("r")).version == base + 1 + res.index(None)


@pytest.mark.filterwarnings("ignore::ResourceWarning")  # the first loop's socket is abandoned
def test_board_survives_a_new_event_loop(nats_server):
    """A CLI may call asyncio.run() per command with one board object."""
    board = NatsBoard(f"{nats_server.url}/{_name('b')}")
    asyncio.run(board.put("r/a.bin", b"x"))
    assert asyncio.run(board.get("r/a.bin")) == b"x"
    asyncio.run(board.close())
    gc.collect()


def test_open_board_url():
    b = open_board("nats://127.0.0.1:4222/mybucket")
    assert isinstance(b, NatsBoard) and b.bucket == "mybucket"
    assert b.server_url == "nats://127.0.0.1:4222"
    assert split_url("nats://h:1") == ("nats://h:1", "stitch")
    assert split_url("tls://u:p@h:1/x/") == ("tls://u:p@h:1", "x")
    with pytest.raises(BoardError):
        split_url("nats://h:1/bad.bucket")


# -- announcements and heartbeats ----------------------------------------------------------------

async def _next(q: asyncio.Queue) -> Announcement:
    return await asyncio.wait_for(q.get(), WAIT)


async def test_late_subscriber_gets_last_then_new(nc):
    run, js = _name("r"), nc.jetstream()
    assert await an.last_announcement(js, run) is None
    await streams.ensure_streams(js, run)
    await streams.ensure_streams(js, run)  # idempotent
    assert await an.last_announcement(js, run) is None
    for v in (1, 2):
        await an.announce(js, _ann(run, v))
    q: asyncio.Queue = asyncio.Queue()
    sub = await an.subscribe_versions(js, run, q.put)
    assert (await _next(q)).version == 2
    for v in (3, 4, 5):
        await an.announce(js, _ann(run, v))
    assert [(await _next(q)).version for _ in range(3)] == [3, 4, 5]
    assert (await an.last_announcement(js, run)) == _ann(run, 5)
    await sub.unsubscribe()
    await an.announce(js, _ann(run, 6))
    await asyncio.sleep(0.2)
    assert q.empty()


async def test_deliver_all_and_creates_streams(nc):
    run = _name("r")
    got: list[int] = []
    sub = await an.subscribe_versions(nc, run, lambda a: got.append(a.version), deliver="all")
    for v in (1, 2, 3):  # the subscriber created the streams; announce finds them
        await an.announce(nc, _ann(run, v))
    async with asyncio.timeout(WAIT):
        while len(got) < 3:
            await asyncio.sleep(0.01)
    assert got == [1, 2, 3]
    await sub.unsubscribe()
    q: asyncio.Queue = asyncio.Queue()
    sub = await an.subscribe_versions(nc, run, q.put, deliver="all")
    assert [(await _next(q)).version for _ in range(3)] == [1, 2, 3]
    await sub.unsubscribe()


async def test_malformed_and_failing_are_skipped(nc, caplog):
    run, js = _name("r"), nc.jetstream()
    await streams.ensure_streams(js, run)
    q: asyncio.Queue = asyncio.Queue()

    async def cb(a: Announcement) -> None:
        if a.version == 2:
            raise RuntimeError("callback bug")
        await q.put(a)

    sub = await an.subscribe_versions(js, run, cb, deliver="new")
    await asyncio.sleep(0.1)
    await js.publish(streams.versions_subject(run), b"not json")
    await js.publish(streams.versions_subject(run), b'{"run": "x"}')
    await an.announce(js, _ann(run, 1))
    await an.announce(js, _ann(run, 2))
    await an.announce(js, _ann(run, 3))
    assert [(await _next(q)).version for _ in range(2)] == [1, 3]
    assert "malformed announcement" in caplog.text and "callback failed" in caplog.text
    await sub.unsubscribe()


async def test_heartbeats_fleet(nc):
    run, js = _name("r"), nc.jetstream()
    assert await an.fleet(js, run) == []
    t = time.time()
    await an.publish_heartbeat(js, Heartbeat(id="e1", run=run, version=1, state="serving",
                                             time=t))
    await an.publish_heartbeat(js, Heartbeat(id="host.a:8000", run=run, version=1,
                                             state="applying", time=t))
    await an.publish_heartbeat(js, Heartbeat(id="e1", run=run, version=2, state="serving",
                                             time=t + 1))
    await an.publish_heartbeat(nc, Heartbeat(id="host.a:8000", run=run, version=2,
                                             state="serving", time=t + 1))  # core publish
    await nc.flush()
    await asyncio.sleep(0.1)  # the core publish is not acked
    beats = await an.fleet(js, run)
    assert [(b.id, b.version, b.state) for b in beats] == [
        ("e1", 2, "serving"), ("host.a:8000", 2, "serving")]
    assert streams.engine_token("host.a:8000") != streams.engine_token("host_a_8000")
    si = await js.stream_info(streams.engines_stream(run))
    assert si.config.max_msgs_per_subject == 1 and si.state.messages == 2


# -- failure -------------------------------------------------------------------------------------

async def test_stopped_server_gives_clear_errors(doomed_server):
    url = doomed_server.url
    board = NatsBoard(f"{url}/b", timeout=1.5)
    await board.put("r/a.bin", b"x")
    doomed_server.stop()
    t0 = time.monotonic()
    with pytest.raises(BoardError, match="NATS board"):
        await board.get("r/a.bin")
    with pytest.raises(BoardError, match="NATS board"):
        await board.move_latest("r", None, _latest("r", 1))
    await asyncio.wait_for(board.close(), WAIT)
    fresh = NatsBoard(f"{url}/b", timeout=1.5)
    with pytest.raises(BoardError, match="connect"):
        await fresh.exists("r/a.bin")
    with pytest.raises(ConnectionError, match="cannot connect"):
        await nats_conn.connect(url, connect_timeout=1)
    assert time.monotonic() - t0 < 12


async def test_server_restart_keeps_data_and_subscriptions(doomed_server):
    """JetStream file storage: objects, latest and announcements survive a server restart on the
    same store, and a live subscription resumes by itself."""
    nc = await nats_conn.connect(doomed_server.url)
    q: asyncio.Queue = asyncio.Queue()
    async with NatsBoard(f"{doomed_server.url}/b") as board:
        await board.put("r/a.bin", b"durable")
        await board.move_latest("r", None, _latest("r", 1))
        await an.announce(nc, _ann("r", 1))
        sub = await an.subscribe_versions(nc, "r", q.put, idle_heartbeat=0.5)
        assert (await _next(q)).version == 1
    port = int(doomed_server.url.rsplit(":", 1)[1])
    doomed_server.stop()
    again = NatsServer(Path(doomed_server.store_dir), port=port).start()
    try:
        async with NatsBoard(f"{again.url}/b") as board:
            assert await board.get("r/a.bin") == b"durable"
            assert (await board.read_latest("r")).version == 1
            await an.announce(await board.connection(), _ann("r", 2))
        assert (await asyncio.wait_for(q.get(), 15)).version == 2
        await sub.unsubscribe()
    finally:
        await nc.close()
        again.stop()


async def test_get_with_a_size_limit_is_refused_from_the_object_info(board):
    from stitch_core.versions.board.base import TooLargeError

    await board.put("r/versions/000001/manifest.json", b"x" * 5000)
    with pytest.raises(TooLargeError, match="5,000 bytes"):
        await board.get("r/versions/000001/manifest.json", max_bytes=4096)
    assert len(await board.get("r/versions/000001/manifest.json", max_bytes=5000)) == 5000


async def test_oversized_announcements_are_skipped_and_logged_sparingly(nc, caplog):
    run, js = _name("r"), nc.jetstream()
    await streams.ensure_streams(js, run)
    q: asyncio.Queue = asyncio.Queue()
    sub = await an.subscribe_versions(js, run, q.put, deliver="new")
    await asyncio.sleep(0.1)
    for _ in range(20):  # a flood of 100 KB messages: skipped, logged 5 times (1, 2, 4, 8, 16)
        await js.publish(streams.versions_subject(run), b"{" + b" " * (100 << 10) + b"}")
    await an.announce(js, _ann(run, 1))
    assert (await _next(q)).version == 1
    assert caplog.text.count("oversized announcement") == 5
    await sub.unsubscribe()
