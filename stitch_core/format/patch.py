"""diff(base, new) -> Patch and apply(base, patch) -> new, over dicts of tensors in HF layout.

Size: about 595 lines, one job: the patch codec over dicts of tensors (`diff` and
`PatchBuilder` write a patch, `apply`, `apply_entry` and `PatchSet` read one). The builder and
the appliers share the chunk layout, the decoder and the whole-state checks, which must stay one
definition, and every public name is pinned at this path (tests/test_architecture.py).

Every tensor of both versions appears in the patch header with its fingerprints, so `apply`
proves the whole result, not just the changed tensors: a wrong base, a wrong model or a corrupt
payload is rejected with a PatchError and nothing is returned (or, in place, everything undone)."""

from __future__ import annotations

import io
import math
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch

from stitch_core.distribution import PRODUCER
from stitch_core.format import codec, dtypes
from stitch_core.format import fingerprint as fpr
from stitch_core.format.codec import CodecError
from stitch_core.format.header import Chunk, PatchHeader, TensorEntry
from stitch_core.format.stp import PatchError, PatchReader, PatchWriter

# positions per chunk the encoder writes: at most 2**20 changed elements per chunk, so an engine
# decoding one chunk at a time stays within its default apply budget (64 MiB at 48 bytes per
# element, stitch_core.engine.coordinator); readers accept spans up to header.MAX_CHUNK_SPAN
DEFAULT_CHUNK_SPAN = 1 << 20


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def _spans(numel: int, span: int) -> Iterable[tuple[int, int]]:
    return ((s, min(s + span, numel)) for s in range(0, numel, span))


class PatchBuilder:
    """Streams a patch to a binary file one tensor at a time (bounded memory)."""

    def __init__(
        self,
        f: BinaryIO,
        *,
        run: str | None = None,
        base_version: int | None = None,
        target_version: int | None = None,
        view: str | None = None,
        chunk_span: int = DEFAULT_CHUNK_SPAN,
    ):
        self._w = PatchWriter(f)
        self._meta = dict(
            run=run, base_version=base_version, target_version=target_version, view=view
        )
        self._span = chunk_span
        self.entries: list[TensorEntry] = []
        self._base_fps: list[tuple[str, str, tuple[int, ...], int]] = []
        self._target_fps: list[tuple[str, str, tuple[int, ...], int]] = []
        self.sha256: str | None = None  # the whole file's SHA-256, set by finish()


    @property
    def target_fingerprints(self) -> dict[str, int]:
        """{tensor name: fingerprint of its target (new) value}, for the tensors added so far."""
        return {n: fp for n, _, _, fp in self._target_fps}

    def _chunk(self, e: codec.EncodedChunk) -> Chunk:
        off, crc = self._w.add_payload(e.pos_bytes, e.val_bytes)
        return Chunk(
            start=e.start,
            stop=e.stop,
            count=e.count,
            pos=e.pos,
            val=e.val,
            ctx=e.ctx.to_list() if e.ctx else None,
            offset=off,
            pos_bytes=len(e.pos_bytes),
            val_bytes=len(e.val_bytes),
            crc32=crc,
        )

    def _changes(self, name: str, pos: torch.Tensor, old: torch.Tensor, new: torch.Tensor,
                 dt: dtypes.DTypeInfo, lo: int, hi: int, fp: int,
                 delta: int | None = None) -> tuple[list[Chunk], int]:
        """The one chunk loop: changes at sorted global positions `pos` (old and new int64
        bits), in windows of `chunk_span` clamped to the range [lo, hi) the producer holds, and
        the fingerprint `fp` moved by them (by `delta` when the compare pass summed it)."""
        if not pos.numel():
            return [], fp
        if delta is None:
            fp = fpr.update(fp, name, pos, old, new, dt.itemsize)
        else:
            fp = (fp + delta) & fpr.MASK64
        p = pos.cpu().numpy()
        first, end = int(p[0]) // self._span, int(p[-1]) // self._span + 1
        cuts = np.searchsorted(p, np.arange(first, end + 1) * self._span).tolist()
        chunks = []
        for w, a, b in zip(range(first, end), cuts, cuts[1:], strict=False):
            s, e = max(w * self._span, lo), min((w + 1) * self._span, hi)
            if b > a:
                enc = codec.encode_chunk(p[a:b], old[a:b], new[a:b], dt, s, e)
                chunks.append(self._chunk(enc))
        return chunks, fp

    def add(
        self,
        name: str,
        base: torch.Tensor | None,
        new: torch.Tensor | None,
        base_fp: int | None = None,
        *,
        shape: tuple[int, ...] | None = None,
        offset: int = 0,
    ) -> TensorEntry:
        """Add one tensor's change. base_fp, when known (the previous version's), saves a pass.

        Sharded producers (one part of a multi-part patch) pass the tensor's global `shape` and the
        flat `offset` where this contiguous local slice starts; fingerprints are then partial sums
        until `finish(totals=...)` replaces them with the all-reduced totals.
        """
        if shape is not None and tuple(shape) != tuple(new.shape if new is not None else ()):
            return self._add_shard(name, base, new, base_fp, tuple(shape), offset)
        if base is not None:
            base_fp = fpr.fingerprint(name, base) if base_fp is None else base_fp
            self._base_fps.append((name, dtypes.info(base.dtype).name, tuple(base.shape), base_fp))
        if new is None:
            if base is None:
                raise PatchError(f"{name}: neither base nor new given")
            entry = TensorEntry(name=name, dtype=dtypes.info(base.dtype).name,
                                shape=list(base.shape), kind="removed", changed=0,
                                base_fp=fpr.fmt(base_fp))
            self.entries.append(entry)
            return entry
        dt = dtypes.info(new.dtype)
        nv = dtypes.int_view(new)
        chunks: list[Chunk] = []
        note = None
        if base is None or base.dtype != new.dtype or tuple(base.shape) != tuple(new.shape):
            note = ("added" if base is None
                    else ("dtype changed" if base.dtype != new.dtype else "reshaped"))
            for s, e in _spans(nv.numel(), self._span):
                pos = np.arange(s, e, dtype=np.int64)
                chunks.append(
                    self._chunk(codec.encode_chunk(pos, None, nv[s:e].to(torch.int64), dt, s, e))
                )
            target_fp = fpr.fingerprint(name, new)
            kind = "full"
        else:
            pos, old, nb, delta = codec.compare(dtypes.int_view(base), nv, 0, fpr.seed_of(name))
            chunks, target_fp = self._changes(name, pos, old, nb, dt, 0, nv.numel(), base_fp, delta)
            kind = "patch"
        entry = TensorEntry(
            name=name,
            dtype=dt.name,
            shape=list(new.shape),
            kind=kind,
            note=note,
            base_fp=None
            if kind == "full" and base is None
            else (fpr.fmt(base_fp) if base_fp is not None else None),
            target_fp=fpr.fmt(target_fp),
            changed=sum(c.count for c in chunks),
            chunks=chunks,
        )
        self._target_fps.append((name, dt.name, tuple(new.shape), target_fp))
        self.entries.append(entry)
        return entry

    def _add_shard(
        self,
        name: str,
        base: torch.Tensor | None,
        new: torch.Tensor | None,
        base_fp: int | None,
        shape: tuple[int, ...],
        offset: int,
    ) -> TensorEntry:
        if base is None or new is None or base.dtype != new.dtype or base.shape != new.shape:
            raise PatchError(f"{name}: a shard part needs base and new of the same local shape")
        dt = dtypes.info(new.dtype)
        bv, nv = dtypes.int_view(base), dtypes.int_view(new)
        lo, hi = offset, offset + nv.numel()
        if base_fp is None:
            base_fp = fpr.fingerprint(name, base, offset=offset)
        pos, old, nb, delta = codec.compare(bv, nv, lo, fpr.seed_of(name))
        chunks, target_fp = self._changes(name, pos, old, nb, dt, lo, hi, base_fp, delta)
        entry = TensorEntry(
            name=name,
            dtype=dt.name,
            shape=list(shape),
            kind="patch",
            base_fp=fpr.fmt(base_fp),
            target_fp=fpr.fmt(target_fp),
            changed=sum(c.count for c in chunks),
            chunks=chunks,
        )
        self._base_fps.append((name, dt.name, tuple(shape), base_fp))
        self._target_fps.append((name, dt.name, tuple(shape), target_fp))
        self.entries.append(entry)
        return entry

    def add_positions(self, name: str, positions, old, new, *, dtype: torch.dtype,
                      shape: tuple[int, ...], base_fp: int) -> TensorEntry:
        """Add changes a producer holds at scattered global positions (e.g. a row-parallel TP
        shard): sorted unique int64 `positions`, the `old`/`new` bits there, and `base_fp`, the
        partial fingerprint of every element this producer holds. Part of a multi-part patch."""
        dt = dtypes.info(dtype)
        pos = torch.as_tensor(positions, dtype=torch.int64).reshape(-1).cpu()
        old = torch.as_tensor(old).reshape(-1).to(torch.int64).cpu()
        new = torch.as_tensor(new).reshape(-1).to(torch.int64).cpu()
        if not (pos.numel() == old.numel() == new.numel()) or (
                pos.numel() > 1 and bool((pos[1:] <= pos[:-1]).any())):
            raise PatchError(f"{name}: positions must be sorted, unique and match old/new")
        numel = math.prod(shape)
        if pos.numel() and (int(pos[0]) < 0 or int(pos[-1]) >= numel):
            raise PatchError(f"{name}: position out of range")
        chunks, target_fp = self._changes(name, pos, old, new, dt, 0, numel, base_fp)
        entry = TensorEntry(name=name, dtype=dt.name, shape=list(shape), kind="patch",
                            base_fp=fpr.fmt(base_fp), target_fp=fpr.fmt(target_fp),
                            changed=sum(c.count for c in chunks), chunks=chunks)
        self._base_fps.append((name, dt.name, tuple(shape), base_fp))
        self._target_fps.append((name, dt.name, tuple(shape), target_fp))
        self.entries.append(entry)
        return entry

    def partial_fingerprints(self) -> dict[str, tuple[int, int]]:
        """name -> (base, target) fingerprints as added (partial sums for shard parts)."""
        base = {n: fp for n, _, _, fp in self._base_fps}
        return {n: (base.get(n, 0), fp) for n, _, _, fp in self._target_fps}

    def finish(
        self,
        metadata: Mapping[str, str] | None = None,
        *,
        totals: Mapping[str, tuple[int, int]] | None = None,
        part: tuple[int, int] | None = None,
    ) -> PatchHeader:
        """Write header and footer. Parts pass the summed (base, target) fingerprints of every
        tensor in `totals` and their (index, count) in `part`."""
        if totals is not None:
            for e in self.entries:
                b, t = totals[e.name]
                e.base_fp, e.target_fp = fpr.fmt(b), fpr.fmt(t)
            self._base_fps = [(n, d, s, totals[n][0]) for n, d, s, _ in self._base_fps]
            self._target_fps = [(n, d, s, totals[n][1]) for n, d, s, _ in self._target_fps]
        header = PatchHeader(
            **self._meta,
            created=_now(),
            producer=PRODUCER,
            base_digest=fpr.digest(self._base_fps),
            target_digest=fpr.digest(self._target_fps),
            tensors=self.entries,
            metadata=dict(metadata or {}),
            part=list(part) if part else None,
        )
        self.size = self._w.finish(header)
        self.sha256 = self._w.sha256  # the whole file's, hashed as it was written
        return header


@dataclass
class Patch:
    """An encoded patch held in memory (use PatchBuilder/PatchReader for streaming)."""

    data: bytes

    @property
    def header(self) -> PatchHeader:
        with PatchReader(self.data) as r:
            return r.header

    def to_bytes(self) -> bytes:
        return self.data

    def write(self, path: str | os.PathLike) -> None:
        Path(path).write_bytes(self.data)

    @classmethod
    def read(cls, path: str | os.PathLike) -> Patch:
        return cls(Path(path).read_bytes())


def diff(
    base: Mapping[str, torch.Tensor],
    new: Mapping[str, torch.Tensor],
    *,
    run: str | None = None,
    base_version: int | None = None,
    target_version: int | None = None,
    view: str | None = None,
    base_fingerprints: Mapping[str, int] | None = None,
    chunk_span: int = DEFAULT_CHUNK_SPAN,
) -> Patch:
    """The lossless patch that turns `base` into `new` (tensors present in either)."""
    buf = io.BytesIO()
    b = PatchBuilder(
        buf,
        run=run,
        base_version=base_version,
        target_version=target_version,
        view=view,
        chunk_span=chunk_span,
    )
    fps = base_fingerprints or {}
    for name in sorted(set(base) | set(new)):
        b.add(name, base.get(name), new.get(name), fps.get(name))
    b.finish()
    return Patch(buf.getvalue())


# ---------------------------------------------------------------- apply


def _fail(msg: str) -> PatchError:
    return PatchError(msg)


def check_compatible(
    header: PatchHeader,
    base_names: Iterable[str],
    *,
    run: str | None = None,
    base_version: int | None = None,
) -> None:
    """Cheap checks before any work: model (tensor names), run and version."""
    if run is not None and header.run is not None and run != header.run:
        raise _fail(f"patch is for run {header.run!r}, not {run!r}")
    if (
        base_version is not None
        and header.base_version is not None
        and base_version != header.base_version
    ):
        raise _fail(
            f"patch applies to version {header.base_version}, base is version {base_version}"
        )
    names = set(base_names)
    expected = {t.name for t in header.tensors if t.kind != "full" or t.base_fp is not None}
    missing = sorted(expected - names)
    extra = sorted(names - {t.name for t in header.tensors})
    if missing or extra:
        what = (
            f"base lacks {missing[0]!r}"
            if missing
            else f"base has {extra[0]!r} unknown to the patch"
        )
        raise _fail(
            f"patch is for another model: {what} ({len(missing)} missing, "
            f"{len(extra)} unknown tensors)"
        )


def _identity(h: PatchHeader) -> tuple:
    tensors = [(t.name, t.dtype, t.shape, t.kind, t.base_fp, t.target_fp) for t in h.tensors]
    return (h.run, h.base_version, h.target_version, h.base_digest, h.target_digest, tensors)


class PatchSet:
    """One logical patch stored as parts (one per sharded producer), read together.

    Every part lists every tensor with the same dtype, shape and (total) fingerprints; each carries
    the chunks for the positions its producer held. Parts must agree on run, versions and digests,
    and their chunks must not overlap.
    """

    def __init__(self, readers: list[PatchReader]):
        if not readers:
            raise _fail("a patch needs at least one part")
        self.readers = readers
        h0 = readers[0].header
        self.header = h0
        n = len(readers)
        idx = sorted((r.header.part or [0, 1])[0] for r in readers)
        if idx != list(range(n)) or any((r.header.part or [0, 1])[1] != n for r in readers):
            raise _fail(f"patch parts {idx} do not form a complete set of {n}")
        if any(_identity(r.header) != _identity(h0) for r in readers[1:]):
            raise _fail("patch parts disagree on versions, tensors or fingerprints")
        self._entries = [{t.name: t for t in r.header.tensors} for r in readers]

    def chunks(self, name: str) -> list[tuple[PatchReader, Chunk]]:
        """Chunks of every part, by window. Windows of different parts may overlap (scattered
        shards such as row-parallel TP slices); their positions must not, which the target
        fingerprint proves: a position written twice decodes against the wrong old value."""
        parts = zip(self.readers, self._entries, strict=True)
        return sorted(((r, c) for r, e in parts for c in e[name].chunks),
                      key=lambda rc: rc[1].start)

    @property
    def changed_elements(self) -> int:
        return sum(r.header.changed_elements for r in self.readers)

    def close(self) -> None:
        for r in self.readers:
            r.close()


def chunk_list(patch: PatchReader | PatchSet, entry: TensorEntry):
    """[(reader, chunk)] of one tensor in order (a multi-part patch: chunks from every part)."""
    if isinstance(patch, PatchSet):
        return patch.chunks(entry.name)
    return [(patch, c) for c in entry.chunks]


def apply_entry(
    reader: PatchReader | PatchSet,
    entry: TensorEntry,
    base: torch.Tensor | None,
    *,
    base_fp: int | None = None,
    inplace: bool = False,
    undo: list[Callable[[], None]] | None = None,
) -> torch.Tensor | None:
    """Apply one tensor entry; returns the new tensor (None if removed). Verifies fingerprints."""
    name = entry.name
    if entry.kind == "full" and entry.base_fp is None:
        base = None
    if base is not None and entry.base_fp is not None:
        if entry.kind == "patch" and (
            dtypes.info(base.dtype).name != entry.dtype or list(base.shape) != entry.shape
        ):
            raise _fail(
                f"{name}: base is {dtypes.info(base.dtype).name}{list(base.shape)}, patch "
                f"expects {entry.dtype}{entry.shape} (another model?)"
            )
        have = fpr.fingerprint(name, base) if base_fp is None else base_fp
        if fpr.fmt(have) != entry.base_fp:
            raise _fail(
                f"{name}: base fingerprint {fpr.fmt(have)} != {entry.base_fp} expected "
                "(wrong base version?)"
            )
    if entry.kind == "removed":
        return None
    dt = dtypes.info(entry.dtype)
    if entry.kind == "full":
        try:
            flat = torch.empty(
                entry.numel, dtype=dt.int_dtype, device=base.device if base is not None else "cpu"
            )
        except (RuntimeError, MemoryError):
            raise _fail(
                f"{name}: cannot allocate {entry.numel:,} elements (absurd size?)"
            ) from None
        for c, _pb, vb in _chunks(reader, entry):
            new = decode_chunk(name, c, vb, None, dt, flat.device)
            flat[c.start : c.stop] = new.to(dt.int_dtype)
        out = dtypes.from_int(flat, dt.torch_dtype, tuple(entry.shape))
        got = fpr.fingerprint(name, out)
    else:
        assert base is not None
        # contiguous: int_view of a strided clone would be a copy, and writes would be lost
        out = base if inplace else base.clone(memory_format=torch.contiguous_format)
        flat = dtypes.int_view(out)
        if inplace and not out.is_contiguous():
            raise _fail(f"{name}: in-place apply needs a contiguous tensor")
        got = fpr.parse(entry.base_fp)
        fused = flat.device.type == "cpu" and dt.itemsize <= 4  # one pass per chunk, in numba
        for c, pb, vb in _chunks(reader, entry):
            if fused:
                try:
                    ctx = codec.Context.from_list(c.ctx) if c.ctx else None
                    p, o, d = codec.apply_cpu(flat.numpy(), c.pos, pb, c.val, ctx, vb, c.start,
                                              c.stop, c.count, dt, fpr.seed_of(name))
                except CodecError as e:
                    raise _fail(f"{name}: corrupt patch data: {e}") from None
                pos, old, got = torch.from_numpy(p), torch.from_numpy(o), (got + d) & fpr.MASK64
            else:
                pos = torch.from_numpy(codec.decode_positions(c.pos, pb, c.start, c.stop, c.count))
                pos = pos.to(flat.device)
                old = flat[pos].to(torch.int64)
                new = decode_chunk(name, c, vb, old, dt, flat.device)
                flat[pos] = new.to(dt.int_dtype)
                got = fpr.update(got, name, pos, old, new, dt.itemsize)
            if undo is not None:
                undo.append(lambda f=flat, p=pos, o=old: f.__setitem__(p, o.to(f.dtype)))
    if fpr.fmt(got) != entry.target_fp:
        raise _fail(
            f"{name}: result fingerprint {fpr.fmt(got)} != {entry.target_fp} (corrupt patch?)"
        )
    return out


def _chunks(patch: PatchReader | PatchSet, entry: TensorEntry):
    for reader, c in chunk_list(patch, entry):
        pb, vb = reader.read_chunk(c)
        yield c, pb, vb


def decode_chunk(
    name: str,
    c: Chunk,
    vb: bytes,
    old: torch.Tensor | None,
    dt: dtypes.DTypeInfo,
    device: torch.device,
) -> torch.Tensor:
    """New integer bits of one chunk's `c.count` elements, from its value stream `vb` and, for
    ULP values, the elements' `old` bits. Codec failures become PatchError naming the tensor."""
    try:
        ctx = codec.Context.from_list(c.ctx) if c.ctx else None
        return codec.decode_values(c.val, ctx, vb, c.count, old, dt, device)
    except CodecError as e:
        raise _fail(f"{name}: corrupt patch data: {e}") from None


def row(name: str, t: torch.Tensor, fp: int) -> tuple[str, str, tuple[int, ...], int]:
    """One `digest` entry of tensor `t`: (name, dtype name, shape, fingerprint)."""
    return (name, dtypes.info(t.dtype).name, tuple(t.shape), fp)


def check_digests(header: PatchHeader, base_rows, target_rows) -> None:
    """Names, dtypes, shapes and fingerprints of both versions, as a whole, match the header."""
    if fpr.digest(base_rows) != header.base_digest:
        raise _fail("base digest mismatch: the header does not describe this base (forged?)")
    if fpr.digest(target_rows) != header.target_digest:
        raise _fail("target digest mismatch: dtypes/shapes in the header were altered (forged?)")


def apply(
    base: Mapping[str, torch.Tensor],
    patch: Patch | PatchReader | bytes | str | os.PathLike | list,
    *,
    base_fingerprints: Mapping[str, int] | None = None,
    base_version: int | None = None,
    run: str | None = None,
    inplace: bool = False,
) -> dict[str, torch.Tensor]:
    """Reconstruct the target version from `base`. Raises PatchError; never returns a wrong result.

    With inplace=True the base tensors are modified and the same dict is updated; on any error
    every write is undone before the exception propagates.
    """
    srcs = patch if isinstance(patch, list) else [patch]
    readers: list[PatchReader] = []
    try:
        for p in srcs:
            readers.append(p if isinstance(p, PatchReader)
                           else PatchReader(p.data if isinstance(p, Patch) else p))
        reader: PatchReader | PatchSet = (
            readers[0]
            if len(readers) == 1 and readers[0].header.part is None
            else PatchSet(readers)
        )
        return _apply(base, reader, base_fingerprints, base_version, run, inplace)
    finally:
        for r in readers:
            r.close()


def _apply(
    base: Mapping[str, torch.Tensor],
    reader: PatchReader | PatchSet,
    base_fingerprints: Mapping[str, int] | None,
    base_version: int | None,
    run: str | None,
    inplace: bool,
) -> dict[str, torch.Tensor]:
    header = reader.header
    check_compatible(header, base.keys(), run=run, base_version=base_version)
    fps = base_fingerprints or {}
    out: dict[str, torch.Tensor] = {}
    undo: list[Callable[[], None]] = []
    base_rows: list[tuple[str, str, tuple[int, ...], int]] = []
    target_rows: list[tuple[str, str, tuple[int, ...], int]] = []
    try:
        for entry in header.tensors:
            b = base.get(entry.name)
            try:
                t = apply_entry(
                    reader,
                    entry,
                    b,
                    base_fp=fps.get(entry.name),
                    inplace=inplace,
                    undo=undo if inplace else None,
                )
            except CodecError as e:
                raise _fail(f"{entry.name}: corrupt patch data: {e}") from None
            if t is not None:
                out[entry.name] = t
                target_rows.append(row(entry.name, t, fpr.parse(entry.target_fp)))
            if b is not None and entry.base_fp is not None:
                base_rows.append(row(entry.name, b, fpr.parse(entry.base_fp)))
        check_digests(header, base_rows, target_rows)
    except BaseException:
        for u in reversed(undo):
            u()
        raise
    if inplace and isinstance(base, dict):
        base.clear()
        base.update(out)
        return base
    return out
