"""The `.stp` container: preamble, chunk payloads, JSON header, footer with a BLAKE2b checksum.

    preamble  8 B magic b"\\x89STP\\r\\n\\x1a\\n" | u32 format version (1) | u32 flags (0)
    payloads  chunk payloads back to back (positions stream, then values stream)
    header    UTF-8 JSON (PatchHeader)
    footer    u64 header offset | u64 header length | 32 B BLAKE2b-256 of every byte before the
              digest | 8 B end magic b"STPEND\\x00\\x01"
All integers little-endian. Readers verify the digest before trusting anything, so a patch is read
twice from disk (once hashing, once decoding) but never held in memory whole.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from pydantic import ValidationError

from stitch_core.errors import StitchError
from stitch_core.format.header import FORMAT_VERSION, READ_VERSIONS, Chunk, PatchHeader

MAGIC = b"\x89STP\r\n\x1a\n"
END_MAGIC = b"STPEND\x00\x01"
PREAMBLE = struct.Struct("<8sII")
FOOTER = struct.Struct("<QQ32s8s")
MAX_HEADER_BYTES = 256 << 20
_READ = 8 << 20


class PatchError(StitchError, ValueError):
    """A patch that cannot be used: malformed, corrupt, or not for this base. One-line message."""


class PatchWriter:
    """Streams chunk payloads to a binary file, then the header and footer. In the same pass it
    computes the whole file's SHA-256 (`sha256` after `finish`: what a manifest lists for the
    object), so a publisher never reads the file back to hash it."""

    def __init__(self, f: BinaryIO):
        self._f = f
        self._h = hashlib.blake2b(digest_size=32)
        self._sha = hashlib.sha256()
        self._pos = 0
        self.sha256: str | None = None
        self._write(PREAMBLE.pack(MAGIC, FORMAT_VERSION, 0))

    def _write(self, b: bytes) -> None:
        self._f.write(b)
        self._h.update(b)
        self._sha.update(b)
        self._pos += len(b)

    def add_payload(self, pos_bytes: bytes, val_bytes: bytes) -> tuple[int, int]:
        """Write one chunk payload; returns (offset, crc32)."""
        off = self._pos
        self._write(pos_bytes)
        self._write(val_bytes)
        return off, zlib.crc32(val_bytes, zlib.crc32(pos_bytes))

    def finish(self, header: PatchHeader) -> int:
        """Write header and footer; returns the file size."""
        blob = header.model_dump_json(exclude_none=True).encode()
        off = self._pos
        self._write(blob)
        self._write(struct.pack("<QQ", off, len(blob)))
        tail = self._h.digest() + END_MAGIC
        self._f.write(tail)
        self._sha.update(tail)
        self.sha256 = self._sha.hexdigest()
        return self._pos + 40


def _err(msg: str) -> PatchError:
    return PatchError(msg)


class PatchReader:
    """Opens a patch (path, bytes or binary file), verifies it whole, then serves its chunks.

    `sha256`: the SHA-256 the file must have (a manifest's object hash). It is computed in one
    pass through the same descriptor every later read uses: the bytes hashed are the bytes
    applied, whatever happens to the path. It covers the footer's own checksum, so with it the
    file is hashed once (SHA-256 only); without it, the footer's BLAKE2b is checked instead."""

    def __init__(self, src: str | os.PathLike | bytes | bytearray | memoryview | BinaryIO,
                 sha256: str | None = None,
                 verified: tuple[int, int, int, int, int] | None = None):
        self._want_sha256 = sha256
        # (dev, inode, size, mtime_ns, ctime_ns) under which the caller verified `sha256` in
        # this process (stitch_core.versions.verified): skip the hash pass only if this
        # descriptor's file has exactly that identity
        self._verified = verified if sha256 is not None else None
        if isinstance(src, (bytes, bytearray, memoryview)):
            self._f: BinaryIO = io.BytesIO(bytes(src))
            self._own = True
        elif isinstance(src, (str, os.PathLike)):
            try:
                self._f = open(Path(src), "rb")  # noqa: SIM115 - closed by close()
            except OSError as e:
                raise _err(f"cannot open patch: {e.strerror}") from None
            self._own = True
        else:
            self._f, self._own = src, False
        try:
            self.header = self._open()
        except Exception:
            self.close()
            raise

    def _open(self) -> PatchHeader:
        f = self._f
        size = f.seek(0, io.SEEK_END)
        self.size = size
        if size < PREAMBLE.size + FOOTER.size:
            raise _err(f"not a stitch patch: {size} bytes is too short (truncated?)")
        f.seek(0)
        magic, version, flags = PREAMBLE.unpack(f.read(PREAMBLE.size))
        if magic != MAGIC:
            raise _err("not a stitch patch (bad magic)")
        if version not in READ_VERSIONS:
            raise _err(
                f"unsupported patch format version {version} (this build reads "
                f"{', '.join(map(str, READ_VERSIONS))})"
            )
        self.version = version
        if flags != 0:
            raise _err(f"unsupported patch flags {flags:#x}")
        f.seek(size - FOOTER.size)
        hoff, hlen, digest, end = FOOTER.unpack(f.read(FOOTER.size))
        if end != END_MAGIC:
            raise _err("patch footer missing (truncated or not a stitch patch)")
        if hlen > MAX_HEADER_BYTES or hoff < PREAMBLE.size or hoff + hlen != size - FOOTER.size:
            raise _err("patch header location is inconsistent (corrupt or truncated)")
        if self._verified is not None and self._identity() == self._verified:
            return self._read_header(hoff, hlen)  # verified once already, unchanged since
        # one hash per open: the manifest's SHA-256 when given (it covers the footer's digest,
        # which the publisher computed over the same bytes), else the footer's BLAKE2b
        whole = hashlib.sha256() if self._want_sha256 is not None else None
        h = hashlib.blake2b(digest_size=32) if whole is None else None
        f.seek(0)
        left = size - 40
        while left:
            b = f.read(min(_READ, left))
            if not b:
                raise _err("patch shrank while reading")
            (h if whole is None else whole).update(b)
            left -= len(b)
        if whole is not None:
            whole.update(f.read(40))
            if whole.hexdigest() != self._want_sha256:
                raise _err(f"patch bytes are not the ones the manifest lists (sha256 "
                           f"{whole.hexdigest()[:12]}…, want {self._want_sha256[:12]}…): "
                           "changed on disk after download?")
        elif h.digest() != digest:
            raise _err("patch checksum mismatch (corrupted in transit or on disk)")
        return self._read_header(hoff, hlen)

    def _identity(self) -> tuple[int, int, int, int, int] | None:
        try:
            st = os.fstat(self._f.fileno())
        except (OSError, AttributeError, io.UnsupportedOperation):
            return None
        return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    def _read_header(self, hoff: int, hlen: int) -> PatchHeader:
        f = self._f
        f.seek(hoff)
        try:
            header = PatchHeader.model_validate(json.loads(f.read(hlen)))
        except (ValueError, ValidationError, RecursionError) as e:  # deep nesting: RecursionError
            first = str(e).splitlines()
            raise _err(f"malformed patch header: {' '.join(first[:3])}") from None
        if header.format_version != self.version:
            raise _err(f"patch header says format version {header.format_version}, its "
                       f"preamble {self.version} (corrupt or forged)")
        self.data_end = hoff
        for t in header.tensors:
            for c in t.chunks:
                if c.offset < PREAMBLE.size or c.offset + c.nbytes > hoff:
                    raise _err(f"{t.name}: chunk lies outside the payload area")
        return header

    def read_chunk(self, c: Chunk) -> tuple[memoryview, memoryview]:
        self._f.seek(c.offset)
        b = self._f.read(c.nbytes)
        if len(b) != c.nbytes or zlib.crc32(b) != c.crc32:
            raise _err("chunk checksum mismatch")
        m = memoryview(b)
        return m[: c.pos_bytes], m[c.pos_bytes :]

    def chunks(self, name: str) -> Iterator[tuple[Chunk, memoryview, memoryview]]:
        entry = self.entry(name)
        for c in entry.chunks:
            yield (c, *self.read_chunk(c))

    def entry(self, name: str):
        if not hasattr(self, "_by_name"):
            self._by_name = {t.name: t for t in self.header.tensors}
        return self._by_name[name]

    def close(self) -> None:
        if self._own:
            self._f.close()

    def __enter__(self) -> PatchReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
