"""FSDP2 adapter: publish versions of a model sharded with `fully_shard`, never gathering it.

Size: about 500 lines, one job: publishing versions from FSDP2-sharded ranks. The sharded
publisher and its per-rank protocol (which rows each rank diffs and uploads, the fingerprint
all-reduce, rank 0's manifest and `latest`) read as one; the local-rows helpers above it
(`local_slice`, `read_rows`) exist for it and raise its `PublishError`.

Every rank projects and diffs only its local shard (`DTensor.to_local()`), writes its part of the
version's multi-part patch (`part-<rank>.stp`, chunk positions in each tensor's *global* flat
index space) and uploads it itself. The ranks then exchange metadata only: one all-reduce of the
partial fingerprints (16 bytes per tensor), one all-gather of each part's size and SHA-256, and a
broadcast of rank 0's status. Rank 0 writes the manifest, moves `latest` (CAS) and announces;
every rank builds the same manifest locally.

    pub = FSDPPublisher("file:///boards", run="grpo", view="bf16", nats="nats://host:4222")
    pub.start_from(hf_dir)             # v0: snapshot of the starting checkpoint (rank 0 writes it)
    for step in ...:
        ...; optimizer.step()
        info = pub.publish(step, model)   # on every rank; synchronous; info.result() -> Manifest

Limits (docs/adapters/fsdp2.md): bf16/fp16 views only (fp8 raises NotImplementedError), only the
first version is a snapshot (followers catch up through chains of patches), publish is synchronous,
placements must be Shard(0) or Replicate (FSDP2, HSDP)."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import shutil
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from stitch_core.errors import StitchError
from stitch_core.format import dtypes
from stitch_core.format import fingerprint as fpr
from stitch_core.format.checkpoint import Checkpoint, open_checkpoint
from stitch_core.format.patch import PatchBuilder
from stitch_core.format.views import parse_view, project
from stitch_core.versions.board import Board
from stitch_core.versions.manifest import (
    Latest,
    Manifest,
    ObjectRef,
    manifest_key,
    version_dir,
)
from stitch_core.versions.store import now, object_ref, read_manifest, write_version

from .base import SIDE_FILES, PublisherBase, Row, shard_names
from .publisher import VersionInfo

log = logging.getLogger("stitch.fsdp")


class PublishError(StitchError, RuntimeError):
    """A version could not be published; raised on every rank alike (nothing moved `latest`)."""


@dataclass(frozen=True)
class LocalSlice:
    """The rows [start, stop) of one tensor that this rank publishes, as a contiguous tensor."""

    tensor: torch.Tensor  # empty where another rank publishes these rows (replicas, empty shards)
    shape: tuple[int, ...]  # global shape
    start: int
    stop: int

    @property
    def offset(self) -> int:
        """Flat position of the slice's first element in the global tensor."""
        return self.start * math.prod(self.shape[1:])


def local_slice(t: torch.Tensor, rank: int) -> LocalSlice:
    """This rank's rows of `t`: a DTensor's local shard (Shard(0) / Replicate placements, with the
    global row offset computed as DTensor splits), or all rows of a plain tensor on rank 0."""
    t = t.detach()
    if isinstance(t, DTensor):
        for p in t.placements:
            if not (p.is_replicate() or (type(p) is Shard and p.dim == 0)):
                raise NotImplementedError(f"placement {p}: only Shard(0) and Replicate (FSDP2)")
        shape = tuple(t.shape)
        local_shape, offsets = compute_local_shape_and_global_offset(
            shape, t.device_mesh, t.placements
        )
        local = t.to_local()
        if tuple(local.shape) != tuple(local_shape):
            raise PublishError(f"local shard {tuple(local.shape)} != {tuple(local_shape)} expected")
        coord = t.device_mesh.get_coordinate() or []
        # a replicated mesh dimension holds the same rows several times: its index 0 publishes them
        owner = all(c == 0 for c, p in zip(coord, t.placements, strict=True) if p.is_replicate())
        start = int(offsets[0]) if shape else 0
    else:
        shape, local, owner, start = tuple(t.shape), t, rank == 0, 0
    if not shape:
        return LocalSlice(local if owner else local.reshape(-1)[:0], (), 0, int(owner))
    rows = local.shape[0] if owner else 0
    return LocalSlice(local[:rows].contiguous(), shape, start, start + rows)


def local_slices(
    src: torch.nn.Module | Mapping[str, torch.Tensor], rank: int
) -> dict[str, LocalSlice]:
    """Every tensor of a module's state dict (tied duplicates dropped, first name kept)."""
    sd = src.state_dict(keep_vars=True) if isinstance(src, torch.nn.Module) else dict(src)
    out: dict[str, LocalSlice] = {}
    seen: set[int] = set()
    for name, t in sd.items():
        if id(t) not in seen:
            seen.add(id(t))
            out[name] = local_slice(t, rank)
    return out


def read_rows(ck: Checkpoint, slices: Mapping[str, LocalSlice]) -> dict[str, torch.Tensor]:
    """This rank's rows of every tensor of a safetensors checkpoint (only those rows are read)."""
    differ = sorted(set(slices) ^ set(ck.where))
    if differ:
        raise ValueError(
            f"{ck.path} and the model differ in tensor {differ[0]!r} ({len(differ)} names differ)"
        )
    out: dict[str, torch.Tensor] = {}
    for shard, names in ck.shards.items():
        with safe_open(ck.file(shard), framework="pt") as f:
            for name in names:
                s, sl = slices[name], f.get_slice(name)
                if tuple(sl.get_shape()) != s.shape:
                    raise ValueError(f"{name}: {sl.get_shape()} in {ck.path}, {s.shape} in model")
                if s.shape:
                    out[name] = sl[s.start : s.stop]
                else:
                    t = f.get_tensor(name)
                    out[name] = t if s.stop else t.reshape(-1)[:0]
    return out


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


class FSDPPublisher(PublisherBase):
    """Publishes versions of an FSDP2-sharded model from every rank of `group` (default: world).

    Call `start_from(checkpoint)` once, then `publish(step, model)` on every rank after each
    optimizer step. Each rank holds its shard of the previous view in (host) memory.

    Subclasses publish other shardings by overriding `_local_plan` and `_diff_local` (see
    `stitch_trainer.megatron_publisher.MegatronPublisher`).
    """

    collective = True  # publish() is called on every rank (StitchCallback honours this)

    _producer = "fsdp"

    def __init__(
        self,
        board: str | Board,
        run: str,
        view: str = "bf16",
        *,
        nats: str | None = None,
        group: dist.ProcessGroup | None = None,
        config_dir: str | Path | None = None,
        spool_dir: str | Path | None = None,
        signing_key: str | Path | None = None,
    ):
        v = parse_view(view)
        if v.quantized:  # fp8 and fp4: scales (and fp4 global scales) span a rank's shards
            raise NotImplementedError(
                f"view {v.name!r} for {type(self).__name__}: the scales of a quantized view are "
                "computed over whole tensors, not a rank's shard; use 'bf16' or 'fp16' (or the "
                "single-process Publisher)"
            )
        if not dist.is_initialized():
            raise PublishError(
                f"{type(self).__name__} needs an initialised torch.distributed process group"
            )
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self._src = dist.get_global_rank(group, 0) if group is not None else 0
        backend = str(dist.get_backend(group))
        cuda = "gloo" not in backend  # gloo reduces host tensors, NCCL device tensors
        self._device = (
            torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        )
        # board and NATS I/O on one loop, kept alive between calls
        super().__init__(board, run, v.name, config_dir=config_dir, io_name="stitch-fsdp-io",
                         signing_key=signing_key if self.rank == 0 else None)
        self._spool = Path(tempfile.mkdtemp(prefix=f"stitch-fsdp-{self.rank}-", dir=spool_dir))
        if nats and self.rank == 0:
            self._call(self.connect_nats(nats, f"stitch-fsdp-{self.run}"))
        self._published: int | None = None  # last version on the board
        self._next_version = 0
        self._base_ck: Checkpoint | None = None  # where the base rows come from (first publish)
        self._base_fps: dict[str, int] = {}  # total fingerprints of the base version
        self._prev: dict[str, torch.Tensor] | None = None  # this rank's rows of the base view
        self._prev_fps: dict[str, int] = {}  # their partial fingerprints
        self._closed = False

    # -------------------------------------------------------------- public API

    def start_from(self, source: str | Path | None = None, *, step: int | None = None) -> Manifest:
        """Set the version the first `publish` diffs against; returns its manifest (every rank).

        On an empty run, rank 0 publishes `source` (an HF directory or .safetensors file: the
        weights training starts from) projected to the view as snapshot v0. On a run with versions,
        publishing continues from `latest`: `source` may be a directory `stitch pull` made of it
        (e.g. on shared storage); otherwise every rank materialises it into its spool directory.
        """
        if self._published is not None:
            raise PublishError("start_from() was already called")
        res: tuple[str | None, str | None, bool] = (None, None, False)
        if self.rank == 0:
            try:
                latest = self._call(self.board.read_latest(self.run))
                if latest is None:
                    if source is None:
                        raise ValueError(f"run {self.run!r} is empty: start_from needs a source")
                    m = self._call(self._publish_snapshot(open_checkpoint(source), step))
                else:
                    m = self._call(read_manifest(self.board, self.run, latest.version))
                res = (None, m.model_dump_json(), latest is None)
            except Exception as e:
                res = (f"{type(e).__name__}: {e}", None, False)
        res = self._broadcast(res)
        if res[0] is not None:
            raise PublishError(f"start_from: {res[0]}")
        m = Manifest.model_validate_json(res[1])
        ck, err = None, None
        try:  # where this rank reads its rows of the base version at the first publish
            ck = open_checkpoint(source) if source is not None else None
            if not res[2] and not _is_pull_of(ck, m):
                log.info(
                    "rank %d: materialising %s v%d to diff against", self.rank, m.run, m.version
                )
                ck = self._pull(m.version)
        except Exception as e:
            err = e
        failed = self._count(err is not None)
        if failed:
            raise PublishError(f"start_from: failed on {failed} rank(s)") from err
        self._base_ck, self._base_fps = ck, m.fingerprints
        self._published, self._next_version = m.version, self._first_free(m.version + 1)
        return m

    def publish(
        self, step: int, module: torch.nn.Module | Mapping[str, torch.Tensor]
    ) -> VersionInfo:
        """Publish the module's current weights as the next version (a patch). Call on every rank.

        Synchronous: returns once the version is on the board and announced (`info.result()` is
        the manifest on every rank). Raises PublishError on every rank if any rank failed; that
        version number is then skipped and the next publish diffs against the last good version.
        """
        if self._closed or self._published is None:
            raise PublishError("call start_from() first" if not self._closed else "closed")
        t0 = time.perf_counter()
        version, parent = self._next_version, self._published
        self._next_version += 1
        shapes, plan = self._local_plan(module)
        names = sorted(shapes)
        path = self._spool / f"part-{self.rank:05d}.stp"
        f, builder, partial, new, kinds, err = None, None, {}, {}, {}, None
        try:  # phase 1, local: project this rank's share, diff it, write the chunks
            f = open(path, "wb")  # noqa: SIM115 - closed in phase 2
            builder = PatchBuilder(
                f, run=self.run, base_version=parent, target_version=version, view=self.view
            )
            new, kinds = self._diff_local(builder, plan)
            partial = builder.partial_fingerprints()
            if sorted(partial) != names:
                raise PublishError("this rank's part does not list every tensor of the model")
        except Exception as e:
            err = e
        totals, failed = self.reduce_fingerprints(names, partial, err is not None)
        wrong = [n for n in names if totals[n][0] != self._base_fps.get(n)]
        if failed or wrong:
            if f is not None:
                f.close()
            path.unlink(missing_ok=True)
        if failed:
            raise PublishError(f"v{version}: phase 1 failed on {failed} rank(s)") from err
        if wrong:
            raise PublishError(
                f"v{version}: the ranks' base rows do not add up to v{parent} "
                f"({wrong[0]!r} and {len(wrong) - 1} more): another model or layout?"
            )
        rows = [(n, kinds[n], shapes[n], totals[n][1]) for n in names]
        meta: dict = {"error": None, "created": now(), "layout": fpr.digest(rows)}
        assert f is not None and builder is not None
        try:  # phase 2, local: header with the totals, upload this rank's part
            header = builder.finish(totals=totals, part=(self.rank, self.world))
            f.close()
            ref = object_ref(path, "patch", f"part-{self.rank:05d}.stp", sha256=builder.sha256)
            self._call(self.board.put(f"{version_dir(self.run, version)}/{ref.path}", path))
            meta.update(ref=ref.model_dump(), changed=header.changed_elements)
        except Exception as e:
            meta["error"] = f"rank {self.rank}: {type(e).__name__}: {e}"
        finally:
            f.close()
            path.unlink(missing_ok=True)
        metas: list = [None] * self.world
        dist.all_gather_object(metas, meta, group=self.group)
        errors = [x["error"] for x in metas if x["error"]]
        if not errors and len({x["layout"] for x in metas}) != 1:
            errors.append("ranks disagree on the model's tensors")
        if errors:
            raise PublishError(f"v{version}: {'; '.join(errors)}")
        m = self._manifest(version, parent, "patch", step, rows,
                           [ObjectRef(**x["ref"]) for x in metas],
                           sum(x["changed"] for x in metas), metas[0]["created"])
        status: tuple[str | None, str] = (None, _sha(m))
        if self.rank == 0:
            try:
                self._call(self._write_patch_version(m))
            except Exception as e:
                status = (f"{type(e).__name__}: {e}", "")
        status = self._broadcast(status)
        if status[0] is not None:
            raise PublishError(f"v{version}: rank 0 could not write the manifest: {status[0]}")
        if status[1] != _sha(m):
            raise PublishError(f"v{version}: rank {self.rank} built another manifest than rank 0")
        self._prev, self._prev_fps = new, {n: partial[n][1] for n in names}
        self._base_fps, self._base_ck = {n: totals[n][1] for n in names}, None
        self._published = version
        info = VersionInfo(self.run, version, step, "patch", parent)
        info.blocked_seconds = time.perf_counter() - t0
        info.future.set_result(m)
        log.info(
            "published %s v%d (%d parts, %d bytes)", self.run, version, self.world, m.patch_bytes
        )
        return info

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._call(self.close_io())
        self.release(self._spool)

    # -------------------------------------------------------------- what this rank publishes

    def _local_plan(self, module) -> tuple[dict[str, tuple[int, ...]], object]:
        """Hook (no I/O, no collectives): every published tensor's name and *global* shape (the
        same on every rank), and what `_diff_local` needs. FSDP2: the rank's DTensor rows."""
        slices = local_slices(module, self.rank)
        return {n: s.shape for n, s in slices.items()}, slices

    def _diff_local(
        self, builder: PatchBuilder, plan
    ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """Hook: project this rank's share of the weights to the view, add its part of every
        tensor to `builder` (diffed against `self._prev`, read from `self._base_ck` at the first
        publish), and return (the new host state, kept as `self._prev` if the version succeeds;
        dtype name of every published tensor)."""
        slices: dict[str, LocalSlice] = plan
        with torch.no_grad():
            new = project({n: s.tensor for n, s in slices.items()}, self.view)
        new = {n: t.to("cpu") for n, t in new.items()}  # host copy of this rank's rows only
        if self._prev is None:
            assert self._base_ck is not None
            self._prev = project(read_rows(self._base_ck, slices), self.view)
        for n in sorted(slices):
            s, base = slices[n], self._prev.get(n)
            if base is None or base.shape != new[n].shape:
                raise PublishError(f"{n}: this rank's rows changed since the last version")
            builder.add(n, base, new[n], self._prev_fps.get(n), shape=s.shape, offset=s.offset)
        return new, {n: dtypes.info(t.dtype).name for n, t in new.items()}

    # -------------------------------------------------------------- collectives (metadata only)

    def _count(self, flag: bool) -> int:
        """On how many ranks `flag` is true (an 8-byte all-reduce)."""
        x = torch.tensor([int(flag)], dtype=torch.int64, device=self._device)
        dist.all_reduce(x, group=self.group)
        return int(x.item())

    def _first_free(self, version: int) -> int:
        """Skip version numbers where a failed publish left this run objects (the board keeps
        them immutable): each rank probes its own part (rank 0 the manifest too)."""
        while True:
            names = [f"part-{self.rank:05d}.stp"] + (["manifest.json"] if self.rank == 0 else [])
            if not self._count(self._call(self.taken(version, names))):
                return version
            log.warning("%s v%d holds objects of a failed publish: skipping it", self.run, version)
            version += 1

    def _broadcast(self, obj):
        box = [obj]
        dist.broadcast_object_list(box, src=self._src, group=self.group)
        return box[0]

    def reduce_fingerprints(
        self, names: list[str], partial: Mapping[str, tuple[int, int]], failed: bool
    ) -> tuple[dict[str, tuple[int, int]], int]:
        """Sum (mod 2^64) of every rank's partial (base, target) fingerprints: one int64 tensor
        of 1 + 2 * len(names) values (two's complement wraps as the fingerprint sum does)."""
        vals = [int(failed)]
        for n in names:
            b, t = partial.get(n, (0, 0))
            vals += [_signed(b), _signed(t)]
        x = torch.tensor(vals, dtype=torch.int64, device=self._device)
        dist.all_reduce(x, group=self.group)
        out = x.tolist()
        totals = {
            n: (out[1 + 2 * i] & fpr.MASK64, out[2 + 2 * i] & fpr.MASK64)
            for i, n in enumerate(names)
        }
        return totals, out[0]

    # -------------------------------------------------------------- board side

    def _pull(self, version: int) -> Checkpoint:
        from stitch_core.versions.materialize import pull

        out = self._spool / f"pulled-{version:06d}"
        coro = pull(
            self.board, self.run, version, out, self._spool / "cache", force=True, quiet=True
        )
        self._call(coro)
        return open_checkpoint(out)

    def _manifest(self, version: int, parent: int | None, kind: str, step: int | None,
                  rows: list[Row], objects: list[ObjectRef], changed: int | None,
                  created: str) -> Manifest:
        return self.build_manifest(
            version=version, parent=parent, kind=kind, step=step, rows=rows,
            objects=sorted(objects, key=lambda o: o.path), changed=changed, created=created,
            producer=f"stitch-rl {self._producer} publisher ({self.world} parts)")

    async def _write_patch_version(self, m: Manifest) -> None:
        """Rank 0, after every part is on the board: the manifest, then `latest`, then NATS."""
        await self.board.put(manifest_key(m.run, m.version), m.model_dump_json(indent=1).encode())
        latest = Latest(run=m.run, version=m.version, kind=m.kind, updated=now())
        if self.signer is not None:
            latest = self.signer.sign(latest, "latest")
        await self.board.move_latest(m.run, m.parent, latest)
        await self.announce(m)

    async def _publish_snapshot(self, ck: Checkpoint, step: int | None) -> Manifest:
        """Rank 0: v0 = the starting checkpoint projected to the view, one source shard at a
        time, in HF layout (config/tokenizer files copied from `config_dir` or the source)."""
        d = self._spool / "snapshot"
        d.mkdir()
        try:
            files, rows = await asyncio.to_thread(self._write_snapshot, ck, d)
            roles = {p: "side" if p.name in SIDE_FILES else "weights" for p in files.values()}
            objects = [await asyncio.to_thread(object_ref, p, r) for p, r in roles.items()]
            m = self._manifest(0, None, "snapshot", step, rows, objects, None, now())
            await write_version(self.board, m, files, expected_latest=None, signer=self.signer)
            await self.announce(m)
            return m
        finally:
            shutil.rmtree(d, ignore_errors=True)

    def _write_snapshot(self, ck: Checkpoint, d: Path) -> tuple[dict[str, Path], list[Row]]:
        rows: list[Row] = []

        def shards():  # one source shard in memory at a time
            for fname, (shard, names) in zip(shard_names(len(ck.shards)), ck.shards.items(),
                                             strict=True):
                with safe_open(ck.file(shard), framework="pt") as f:
                    view = project({n: f.get_tensor(n) for n in names}, self.view)
                rows.extend((n, dtypes.info(t.dtype).name, tuple(t.shape), fpr.fingerprint(n, t))
                            for n, t in view.items())
                yield fname, view

        files = self.write_snapshot_files(shards(), d, 0,
                                          side_from=ck.path if ck.is_dir else None)
        return files, rows


def _sha(m: Manifest) -> str:
    """What every rank must agree on: the manifest without its signature (rank 0 signs)."""
    return hashlib.sha256(
        m.model_dump_json(exclude={"signed_by", "signature"}).encode()).hexdigest()


def _is_pull_of(ck: Checkpoint | None, m: Manifest) -> bool:
    """Whether `ck` is a directory `stitch pull` made of exactly this version."""
    from stitch_core.versions.manifest import PULLED_MANIFEST

    if ck is None or not ck.is_dir or not (ck.path / PULLED_MANIFEST).is_file():
        return False
    got = Manifest.model_validate_json((ck.path / PULLED_MANIFEST).read_text())
    return (got.run, got.version, got.digest) == (m.run, m.version, m.digest)
