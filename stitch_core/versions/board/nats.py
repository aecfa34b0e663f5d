"""A board on NATS JetStream: objects in an object store bucket, `latest` in a KV bucket.

Size: about 520 lines, one job: the `Board` interface on NATS JetStream. Its create-only
chunked upload, digest-checked reads, `latest` CAS and bucket lookup share one connection, one
set of JetStream error codes and the object store's layout; split, each piece would re-derive
them.

URL: `nats://host:port/<bucket>` (or `tls://`; bucket defaults to "stitch"). Objects live in the
JetStream object store `<bucket>` under their board key; each run's `latest` is the key `<run>` of
the KV bucket `<bucket>_latest`. Both buckets are created by the first write; reads only look them
up, so a reader needs no JetStream admin rights (docs/nats-security.md lists the subjects), and a
write the server's permissions refuse fails with the server's reason, not a bare timeout.

Objects are stored in the standard object store layout (chunks on `$O.<bucket>.C.<nuid>`, metadata
on `$O.<bucket>.M.<name>`), so `nats object get` and other clients can read them; but writes are
create-only: the metadata is published with `Nats-Expected-Last-Subject-Sequence: 0`, so two
writers racing on one key cannot replace each other's object. `put` returns only after JetStream
acknowledged every chunk and the metadata, i.e. the object is stored (with file storage, on disk
per the server's sync policy; replicated to a quorum on a clustered stream). `move_latest` is a
KV compare-and-swap on the entry's revision."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import logging
import re
import time
import urllib.parse
import uuid
from collections.abc import Awaitable, Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext, api
from nats.js.kv import KeyValue
from nats.js.object_store import ObjectStore

from stitch_core.versions.board.base import (
    BadCopyError,
    Board,
    BoardError,
    LatestConflictError,
    NotFoundError,
    check_copy,
    check_key,
    open_part,
    part_path,
    too_large,
)
from stitch_core.versions.manifest import MANIFEST, MAX_LATEST_BYTES, Latest, check_run
from stitch_core.versions.nats_conn import NatsConfigError, connect, denied_since

log = logging.getLogger("stitch.nats")

DEFAULT_BUCKET = "stitch"
CHUNK = 512 * 1024  # bytes per chunk message (fewer, larger messages: faster in Python)
WINDOW = 32  # chunks in flight while uploading (16 MiB)
_BUCKET_RE = re.compile(r"^[A-Za-z0-9_-]+$")
_WRONG_LAST_SEQ = (10071, 10164)
_STREAM_IN_USE = 10058
_DIGEST = "SHA-256="


def split_url(url: str) -> tuple[str, str]:
    """`nats://host:port/bucket` -> (`nats://host:port`, `bucket`)."""
    u = urllib.parse.urlsplit(url)
    if u.scheme not in ("nats", "tls") or not u.netloc:
        raise BoardError(f"not a NATS board URL: {url!r} (want nats://host:port/bucket)")
    bucket = u.path.strip("/") or DEFAULT_BUCKET
    if not _BUCKET_RE.match(bucket):
        raise BoardError(f"invalid bucket {bucket!r} in {url!r} (letters, digits, '_', '-')")
    return f"{u.scheme}://{u.netloc}", bucket


def _digest_bytes(digest: str | None) -> bytes:
    d = (digest or "").removeprefix(_DIGEST).removeprefix(_DIGEST.upper())
    return base64.urlsafe_b64decode(d + "=" * (-len(d) % 4))


def _known_digest(sha256: str | None) -> bytes | None:
    """A caller's hex SHA-256 as bytes (None stays None); anything else is a caller's bug."""
    if sha256 is None:
        return None
    if len(sha256) != 64:
        raise ValueError(f"sha256 must be 64 hex digits, got {sha256!r}")
    return bytes.fromhex(sha256)


def _sha256(src: bytes | Path) -> tuple[bytes, int]:
    h = hashlib.sha256()
    if isinstance(src, Path):
        with open(src, "rb") as f:
            while block := f.read(1 << 20):
                h.update(block)
        return h.digest(), src.stat().st_size
    h.update(src)
    return h.digest(), len(src)


class _Acks:
    """Counts JetStream acks for pipelined publishes (replies on `<inbox>.<n>`)."""

    def __init__(self) -> None:
        self.acked = 0
        self.error: Exception | None = None
        self.changed = asyncio.Event()

    async def on_reply(self, msg: Msg) -> None:
        if msg.headers and msg.headers.get("Status") == "503":
            self.error = BoardError("no JetStream stream answered (bucket deleted?)")
        else:
            try:
                resp = json.loads(msg.data)
                if "error" in resp:
                    self.error = BoardError(f"JetStream refused a chunk: {resp['error']}")
                else:
                    self.acked += 1
            except ValueError:
                self.error = BoardError(f"bad JetStream ack {msg.data[:200]!r}")
        self.changed.set()

    async def wait(self, sent: int, upto: int, timeout: float) -> None:
        """Wait until at most `upto` of `sent` publishes are unacknowledged."""
        while self.error is None and sent - self.acked > upto:
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(), timeout)
            except TimeoutError:
                raise BoardError(f"no JetStream ack within {timeout:g} s") from None
        if self.error is not None:
            raise self.error


class NatsBoard(Board):
    """Board on a NATS server. Connects lazily; `timeout` bounds each request (and the initial
    connect), `stall_timeout` the wait for the next chunk while downloading."""

    def __init__(self, url: str, *, timeout: float = 10.0, stall_timeout: float = 60.0):
        self.server_url, self.bucket = split_url(url)
        u = urllib.parse.urlsplit(self.server_url)  # the public name: no user:password@
        self.url = f"{u.scheme}://{u.netloc.rpartition('@')[2]}/{self.bucket}"
        self.timeout = timeout
        self.stall_timeout = stall_timeout
        self._nc: NATS | None = None
        self._js: JetStreamContext | None = None
        self._obj: ObjectStore | None = None
        self._kv: KeyValue | None = None
        self._lock: asyncio.Lock | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def __repr__(self) -> str:
        return f"NatsBoard({self.url!r})"

    # -- connection ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _errors(self, what: str) -> Iterator[None]:
        t0 = time.monotonic()
        try:
            yield
        except (LatestConflictError, NotFoundError):
            raise
        except Exception as e:
            # the server drops a request its permissions refuse (no reply: a timeout, or no
            # ack) and says why on the connection: report that
            if (why := denied_since(self._nc, t0)) is not None:
                raise BoardError(f"NATS board {self.url}: {what} refused by the server: {why} "
                                 "(this NATS user lacks the right; see "
                                 "docs/nats-security.md)") from e
            if isinstance(e, BoardError):
                raise
            if isinstance(e, TimeoutError | nats.errors.TimeoutError):
                raise BoardError(f"NATS board {self.url}: {what} timed out after "
                                 f"{self.timeout:g} s (is the server up?)") from e
            if isinstance(e, nats.errors.Error | OSError):
                raise BoardError(f"NATS board {self.url}: {what} failed: "
                                 f"{e or type(e).__name__}") from e
            raise

    async def connection(self) -> NATS:
        """The board's NATS connection (e.g. to publish announcements on the same one)."""
        await self._ready()
        assert self._nc is not None
        return self._nc

    async def _ready(self) -> JetStreamContext:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # first use, or reused under a new event loop (asyncio.run)
            self._loop, self._lock = loop, asyncio.Lock()
            self._nc = self._js = self._obj = self._kv = None
        if self._js is not None:
            return self._js
        assert self._lock is not None
        async with self._lock:
            if self._js is None:
                with self._errors("connect"):
                    try:
                        nc = await connect(self.server_url, name="stitch-board",
                                           connect_timeout=self.timeout)
                    except (ConnectionError, NatsConfigError) as e:
                        raise BoardError(f"NATS board {self.url}: {e}") from e
                    self._nc, self._js = nc, nc.jetstream(timeout=self.timeout)
        assert self._js is not None
        return self._js

    async def _objects(self, create: bool = False) -> ObjectStore | None:
        """The object store bucket: looked up (None if it does not exist yet), or, for a
        write, created if missing. Reads never create, so they need no admin rights."""
        js = await self._ready()
        if self._obj is None:
            with contextlib.suppress(nats.js.errors.BucketNotFoundError):
                self._obj = await js.object_store(self.bucket)
            if self._obj is None and create:
                self._obj = await self._create_object_store(js)
        return self._obj

    async def _latest_kv(self, create: bool = False) -> KeyValue | None:
        """The KV bucket of `latest`, like `_objects`."""
        js = await self._ready()
        if self._kv is None:
            with contextlib.suppress(nats.js.errors.BucketNotFoundError):
                self._kv = await js.key_value(f"{self.bucket}_latest")
            if self._kv is None and create:
                self._kv = await self._create_key_value(js)
        return self._kv

    async def _create_object_store(self, js: JetStreamContext) -> ObjectStore:
        try:
            log.info("creating object store bucket %s on %s", self.bucket, self.server_url)
            return await js.create_object_store(
                self.bucket, storage=api.StorageType.FILE,
                description="stitch board: immutable version objects")
        except nats.js.errors.BadRequestError as e:  # created concurrently with another config
            if e.err_code != _STREAM_IN_USE:
                raise
            return await js.object_store(self.bucket)

    async def _create_key_value(self, js: JetStreamContext) -> KeyValue:
        name = f"{self.bucket}_latest"
        try:
            log.info("creating KV bucket %s on %s", name, self.server_url)
            return await js.create_key_value(
                bucket=name, history=16, storage=api.StorageType.FILE,
                description="stitch board: latest version of each run")
        except nats.js.errors.BadRequestError as e:
            if e.err_code != _STREAM_IN_USE:
                raise
            return await js.key_value(name)

    async def close(self) -> None:
        nc, self._nc, self._js, self._obj, self._kv = self._nc, None, None, None, None
        if nc is None or nc.is_closed:
            return
        try:
            await asyncio.wait_for(nc.drain(), self.timeout)
        except Exception:  # reconnecting, timed out, ...: just close
            with contextlib.suppress(Exception):
                await nc.close()

    # -- objects ---------------------------------------------------------------------------------

    @property
    def _stream(self) -> str:
        return f"OBJ_{self.bucket}"

    def _meta_subject(self, key: str) -> str:
        return f"$O.{self.bucket}.M.{base64.urlsafe_b64encode(key.encode()).decode()}"

    async def _info(self, key: str) -> api.ObjectInfo | None:
        obj = await self._objects()
        if obj is None:  # no bucket yet: nothing written
            return None
        try:
            return await obj.get_info(key)
        except nats.js.errors.NotFoundError:
            return None

    async def _read(self, key: str, sink: Callable[[bytes], Awaitable[None]]) -> str | None:
        """Stream `key` into `sink`, checked against NATS's own size and digest; returns the
        hex SHA-256 of what was streamed (None for a link nats-py followed)."""
        js = await self._ready()
        info = await self._info(key)
        if info is None:
            raise NotFoundError(f"{key} not on board {self.url}")
        if info.is_link():  # not written by us; let nats-py follow it
            assert self._obj is not None
            await sink((await self._obj.get(key)).data or b"")
            return None
        size = info.size or 0
        h, got = hashlib.sha256(), 0
        if size:
            sub = await js.subscribe(f"$O.{self.bucket}.C.{info.nuid}", stream=self._stream,
                                     ordered_consumer=True)
            try:
                while True:
                    try:
                        msg = await sub.next_msg(timeout=self.stall_timeout)
                    except nats.errors.TimeoutError:
                        raise BoardError(
                            f"NATS board {self.url}: download of {key} stalled for "
                            f"{self.stall_timeout:g} s at {got}/{size} bytes") from None
                    h.update(msg.data)
                    got += len(msg.data)
                    await sink(msg.data)
                    if msg.metadata.num_pending == 0 or got >= size:
                        break
            finally:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
        if got != size or h.digest() != _digest_bytes(info.digest):
            raise BoardError(f"{key} on {self.url}: got {got} bytes with sha256 "
                             f"{h.hexdigest()}, metadata says {size} bytes, {info.digest}")
        return h.hexdigest()

    async def get(self, key: str, max_bytes: int | None = None) -> bytes:
        check_key(key)
        parts: list[bytes] = []
        got = 0

        async def sink(data: bytes) -> None:
            nonlocal got
            got += len(data)
            if max_bytes is not None and got > max_bytes:
                raise too_large(key, None, max_bytes)
            parts.append(data)

        with self._errors(f"get {key}"):
            if max_bytes is not None:
                info = await self._info(key)
                if info is not None and (info.size or 0) > max_bytes:
                    raise too_large(key, info.size, max_bytes)
            await self._read(key, sink)
        return b"".join(parts)

    async def get_verified(self, key: str, dest: Path, size: int, sha256: str) -> None:
        """`get_file`, checked against the manifest's `size` and `sha256` with the digest
        computed while streaming (no second pass over the file); BadCopyError (nothing left at
        `dest`) if it differs."""
        streamed = await self._get_file(key, dest)
        if streamed is None:  # a followed link: not hashed while streaming
            await asyncio.to_thread(check_copy, dest, key, size, sha256, self.url)
            return
        got = dest.stat().st_size
        if got != size or streamed != sha256:
            dest.unlink(missing_ok=True)
            raise BadCopyError(f"{key} from {self.url}: {got} bytes, sha256 {streamed[:12]}…; "
                               f"the manifest says {size}, {sha256[:12]}…")

    async def get_file(self, key: str, dest: Path, size: int | None = None) -> None:
        """Stream `key` into `dest.part` (chunk by chunk, digest checked), then rename."""
        await self._get_file(key, dest)

    async def _get_file(self, key: str, dest: Path) -> str | None:
        check_key(key)
        dest = Path(dest)
        tmp = part_path(dest)
        buf = bytearray()
        f = await asyncio.to_thread(open_part, tmp)
        try:
            async def sink(data: bytes) -> None:
                buf.extend(data)
                if len(buf) >= 8 << 20:
                    await asyncio.to_thread(f.write, bytes(buf))
                    buf.clear()

            with self._errors(f"get {key}"):
                digest = await self._read(key, sink)
            await asyncio.to_thread(f.write, bytes(buf))
        except BaseException:
            f.close()
            tmp.unlink(missing_ok=True)
            raise
        f.close()
        tmp.replace(dest)
        return digest

    async def exists(self, key: str) -> bool:
        check_key(key)
        with self._errors(f"exists {key}"):
            return await self._info(key) is not None

    async def put(self, key: str, src: bytes | Path, *, sha256: str | None = None) -> None:
        """Upload `src` as `key`. The object store keeps a SHA-256 of the content in the
        object's metadata: `sha256` (the digest the patch writer computed as it wrote, listed
        in the manifest) is used as that digest instead of hashing the content again while it
        streams; a wrong one is caught by every reader, which checks the streamed digest
        against the manifest."""
        check_key(key)
        known = _known_digest(sha256)
        with self._errors(f"put {key}"):
            info = await self._info(key)
            if info is None:
                if await self._upload(key, src, known):
                    return
                info = await self._info(key)  # lost a race to another writer: compare
                assert info is not None
            if known is not None:
                size = src.stat().st_size if isinstance(src, Path) else len(src)
                digest = known
            else:
                digest, size = await asyncio.to_thread(_sha256, src)
            if info.size != size or _digest_bytes(info.digest) != digest:
                raise BoardError(f"{key} already exists with other content "
                                 "(versions are immutable)")

    async def _upload(self, key: str, src: bytes | Path, known: bytes | None = None) -> bool:
        """Write a new object; False (and nothing written) if `key` appeared meanwhile. `known`:
        the content's SHA-256 (not computed again), else it is computed as the chunks go."""
        await self._objects(create=True)
        js = await self._ready()
        nc = self._nc
        assert nc is not None
        nuid = uuid.uuid4().hex
        chunk_subject = f"$O.{self.bucket}.C.{nuid}"
        inbox = nc.new_inbox()
        acks = _Acks()
        sub = await nc.subscribe(f"{inbox}.*", cb=acks.on_reply)
        chunk = min(CHUNK, nc.max_payload)
        h = hashlib.sha256() if known is None else None
        size = sent = 0
        f = await asyncio.to_thread(open, src, "rb") if isinstance(src, Path) else None
        try:
            view = memoryview(src) if isinstance(src, bytes) else None
            while True:
                if f is not None:
                    data = await asyncio.to_thread(f.read, chunk)
                else:
                    assert view is not None
                    data = bytes(view[size:size + chunk])
                if not data:
                    break
                if h is not None:
                    h.update(data)
                await nc.publish(chunk_subject, data, reply=f"{inbox}.{sent}")
                sent += 1
                size += len(data)
                await acks.wait(sent, WINDOW, self.timeout)
            await acks.wait(sent, 0, self.timeout)
            info = api.ObjectInfo(
                name=key, bucket=self.bucket, nuid=nuid, size=size, chunks=sent,
                mtime=datetime.now(UTC).isoformat(),
                digest=_DIGEST + base64.urlsafe_b64encode(
                    known if h is None else h.digest()).decode(),
                options=api.ObjectMetaOptions(max_chunk_size=chunk))
            headers = {api.Header.ROLLUP: "sub", api.Header.EXPECTED_LAST_SUBJECT_SEQUENCE: "0"}
            try:
                await js.publish(self._meta_subject(key), json.dumps(info.as_dict()).encode(),
                                 headers=headers)
            except nats.js.errors.APIError as e:
                if e.err_code not in _WRONG_LAST_SEQ:
                    raise
                await self._purge(chunk_subject)
                return False
        except BaseException:
            await self._purge(chunk_subject)
            raise
        finally:
            if f is not None:
                f.close()
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        log.debug("put %s: %d bytes in %d chunks", key, size, sent)
        return True

    async def delete(self, key: str) -> None:
        """Purge the object's metadata subject (no reader finds it from then on, and no
        deleted-object marker is left behind to be listed), then its chunks."""
        check_key(key)
        with self._errors(f"delete {key}"):
            if await self._objects() is None:  # no bucket: nothing was ever written
                return
            info = await self._info(key)
            js = await self._ready()
            await js.purge_stream(self._stream, subject=self._meta_subject(key))
            if info is not None and info.nuid:
                await js.purge_stream(self._stream, subject=f"$O.{self.bucket}.C.{info.nuid}")

    async def _purge(self, chunk_subject: str) -> None:
        js = self._js
        if js is None:
            return
        try:
            await asyncio.wait_for(js.purge_stream(self._stream, subject=chunk_subject),
                                   self.timeout)
        except Exception as e:
            log.warning("could not purge orphaned chunks %s: %s", chunk_subject, e)

    async def _names(self, what: str) -> list[str]:
        """The keys of every stored object (from the bucket's metadata subjects: a deleted
        object's subject is purged, so it is not listed)."""
        with self._errors(what):
            js = await self._ready()
            try:
                si = await js.stream_info(self._stream, subjects_filter=f"$O.{self.bucket}.M.>")
            except nats.js.errors.NotFoundError:  # no bucket yet
                return []
        out = []
        for subject in si.state.subjects or {}:
            token = subject.rsplit(".", 1)[-1]
            try:
                out.append(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)).decode())
            except ValueError:
                continue
        return out

    async def list_versions(self, run: str) -> list[int]:
        """Versions of `run` with a manifest object (from the bucket's metadata subjects)."""
        check_run(run)
        pat = re.compile(rf"^{re.escape(run)}/versions/(\d+)/{re.escape(MANIFEST)}$")
        found = {int(m.group(1)) for name in await self._names(f"list versions of {run}")
                 if (m := pat.match(name))}
        return sorted(found)

    async def list_keys(self, prefix: str) -> list[str]:
        """The keys of the objects under the directory `prefix`."""
        start = check_key(prefix) + "/"
        return sorted(n for n in await self._names(f"list {prefix}") if n.startswith(start))

    # -- latest ----------------------------------------------------------------------------------

    async def _latest_entry(self, run: str) -> tuple[Latest | None, int]:
        kv = await self._latest_kv()
        if kv is None:  # no bucket yet: no run has a latest
            return None, 0
        try:
            entry = await kv.get(check_run(run))
        except nats.js.errors.KeyNotFoundError:
            return None, 0
        if len(entry.value or b"") > MAX_LATEST_BYTES:
            raise too_large(f"latest of {run}", len(entry.value or b""), MAX_LATEST_BYTES)
        try:
            return Latest.model_validate_json(entry.value or b""), entry.revision or 0
        except ValueError as e:
            raise BoardError(f"latest of {run} on {self.url} is malformed: {e}") from e

    async def read_latest(self, run: str) -> Latest | None:
        with self._errors(f"read latest of {run}"):
            return (await self._latest_entry(run))[0]

    async def move_latest(self, run: str, expected: int | None, new: Latest) -> None:
        with self._errors(f"move latest of {run}"):
            cur, revision = await self._latest_entry(run)
            cur_v = cur.version if cur else None
            if cur_v != expected:
                raise LatestConflictError(f"latest of {run} is {cur_v}, expected {expected}")
            if cur_v is not None and new.version <= cur_v:
                raise LatestConflictError(f"latest of {run} would move back from {cur_v} to "
                                     f"{new.version}")
            kv = await self._latest_kv(create=True)
            assert kv is not None
            data = new.model_dump_json().encode()
            try:
                if revision:
                    await kv.update(run, data, last=revision)
                else:
                    await kv.create(run, data)
            except nats.js.errors.KeyWrongLastSequenceError as e:
                raise LatestConflictError(f"latest of {run} moved concurrently (expected "
                                     f"{expected})") from e
