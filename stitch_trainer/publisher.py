"""Publisher: turns training steps into versions on a board, without blocking the step.

`publish(step, tensors_or_module)` projects the masters to the served view (the only work done
on the caller's thread, plus a device-to-host copy), assigns the version number and returns a
`VersionInfo` at once. A background thread diffs against the previous view, encodes the patch,
writes a snapshot every K versions, uploads, moves `latest` and announces on NATS. The queue is
bounded (`queue_size`): when uploads fall behind, `publish` waits instead of piling up memory.
With `keep_snapshots=K` the same thread runs the board's retention (`stitch gc`) after each
snapshot it publishes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import logging
import queue
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from stitch_core.errors import StitchError
from stitch_core.format import fingerprint as fpr
from stitch_core.format.patch import PatchBuilder
from stitch_core.format.views import project
from stitch_core.versions.board import Board
from stitch_core.versions.manifest import Manifest
from stitch_core.versions.retention import gc
from stitch_core.versions.store import object_ref, write_version

from .base import SIDE_FILES, PublisherBase, rows_of, shard_names

log = logging.getLogger("stitch.publisher")
__all__ = ["BaseProofError", "Publisher", "VersionInfo", "named_tensors", "SIDE_FILES"]


class BaseProofError(StitchError, RuntimeError):
    """The proof given to `resume_from` failed: the version made from that base was not
    uploaded (the cause is chained)."""


@dataclass
class VersionInfo:
    """A version `publish` has numbered; `result()` waits until it is on the board."""

    run: str
    version: int
    step: int
    kind: str
    parent: int | None
    blocked_seconds: float = 0.0  # time publish() held the caller
    # resolved with the manifest once the version is on the board (announced), or its error: set
    # by the publishers (publisher.py, fsdp.py); callers may add callbacks (benchmarks do)
    future: cf.Future = field(default_factory=cf.Future, repr=False)

    def result(self, timeout: float | None = None) -> Manifest:
        """Wait until this version is on the board (and announced); its manifest."""
        return self.future.result(timeout)

    def done(self) -> bool:
        return self.future.done()


def named_tensors(src: Mapping[str, torch.Tensor] | torch.nn.Module) -> dict[str, torch.Tensor]:
    """A module's state dict (tied duplicates dropped, as HF checkpoints do) or a mapping."""
    sd = src.state_dict() if isinstance(src, torch.nn.Module) else dict(src)
    out: dict[str, torch.Tensor] = {}
    seen: dict[tuple[int, tuple[int, ...]], str] = {}
    for name, t in sd.items():
        t = t.detach()
        if hasattr(t, "full_tensor"):  # DTensor: the sharded adapter avoids this gather
            t = t.full_tensor()
        key = (t.data_ptr(), tuple(t.shape))
        if t.numel() and key in seen:
            continue
        seen[key] = name
        out[name] = t
    return out


class Publisher(PublisherBase):
    """Publishes every training step of a single-process model as a version (see the module
    docstring); the board side is `PublisherBase`'s."""

    def __init__(
        self,
        board: str | Board,
        run: str,
        view: str = "bf16",
        *,
        nats: str | None = None,
        snapshot_every: int = 0,
        queue_size: int = 2,
        config_dir: str | Path | None = None,
        spool_dir: str | Path | None = None,
        max_shard_bytes: int = 5 << 30,
        signing_key: str | Path | None = None,
        keep_snapshots: int | None = None,
        keep_patch: bool = False,
    ):
        if keep_snapshots is not None and keep_snapshots < 1:
            raise ValueError(f"keep_snapshots must be at least 1 (got {keep_snapshots})")
        super().__init__(board, run, view, config_dir=config_dir, io_name="stitch-publisher-io",
                         signing_key=signing_key)
        self.snapshot_every = snapshot_every
        self.keep_snapshots = keep_snapshots  # None: no retention (the board keeps everything)
        self.nats_url = nats
        self.max_shard_bytes = max_shard_bytes
        self.keep_patch = keep_patch
        # the patch of the newest version published (with keep_patch; None after a snapshot)
        self.last_patch: bytes | None = None
        self._spool = Path(spool_dir or tempfile.mkdtemp(prefix="stitch-publish-"))
        self._spool.mkdir(parents=True, exist_ok=True)
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, queue_size))
        self._prev_view: dict[str, torch.Tensor] | None = None  # projection's pinning source
        self._error: BaseException | None = None
        latest = self._call(self._init())
        self._next_version = self._call(self._first_free(0 if latest is None else
                                                         latest.version + 1))
        self._published: int | None = None if latest is None else latest.version
        self._closed = False
        self._worker = threading.Thread(target=self._drain, daemon=True, name="stitch-publisher")
        self._worker.start()

    # -------------------------------------------------------------- caller side

    @property
    def published(self) -> int | None:
        """The newest version of the run on the board as this publisher knows it (None: none)."""
        return self._published

    @property
    def last_view(self) -> dict[str, torch.Tensor] | None:
        """The served view of the newest version `publish` queued (or `resume_from` gave): the
        base of the next patch. Its tensors are never changed in place (`stitch publish` keeps
        it as its local state)."""
        return self._prev_view

    def resume_from(self, version: int, view: Mapping[str, torch.Tensor],
                    fingerprints: Mapping[str, int], *,
                    proof: Callable[[], None] | None = None) -> None:
        """Continue a run whose `latest` is `version` with this view: the next publish is a patch
        against it (and fp8 scales stay pinned to it). `proof`, when the view's `fingerprints`
        are still being checked (e.g. on another thread while the patch is made): called before
        the patch goes to the board; raising stops that publish (nothing is uploaded)."""
        if self._published != version:
            raise ValueError(f"board latest is {self._published}, not {version}")
        self._prev_view = dict(view)
        self._call(self._set_base((version, dict(view), dict(fingerprints)), proof))

    async def _set_base(self, base, proof: Callable[[], None] | None = None) -> None:
        self._base = base
        self._base_proof = proof

    def publish(
        self, step: int, tensors: Mapping[str, torch.Tensor] | torch.nn.Module, *,
        copy: bool = True,
    ) -> VersionInfo:
        """Number the next version and queue it (see the module docstring). `copy=False`: the
        caller never changes `tensors` again (e.g. a checkpoint read from disk), so masters
        already in the served dtype are published as they are, not copied."""
        if self._closed:
            raise RuntimeError("publisher is closed")
        t0 = time.perf_counter()
        masters = named_tensors(tensors)
        with torch.no_grad():
            view = project(masters, self.view, previous=self._prev_view, copy=copy)
        view = {k: v.to("cpu", non_blocking=True) for k, v in view.items()}
        if any(v.device.type != "cpu" for v in masters.values()):
            torch.cuda.synchronize()
        version = self._next_version
        self._next_version += 1
        first = self._prev_view is None
        kind = (
            "snapshot"
            if first or (self.snapshot_every and version % self.snapshot_every == 0)
            else "patch"
        )
        info = VersionInfo(self.run, version, step, kind, None)
        self._prev_view = view
        self._queue.put((info, view))  # blocks when the bounded queue is full
        info.blocked_seconds = time.perf_counter() - t0
        return info

    def flush(self, timeout: float | None = None) -> None:
        """Wait until everything published so far is on the board."""
        done = threading.Event()
        self._queue.put((None, done))
        if not done.wait(timeout):
            raise TimeoutError("publisher flush timed out")

    def close(self) -> None:
        if self._closed:
            return
        self.flush()
        self._closed = True
        self._queue.put(None)
        self._worker.join()  # it ran close_io() last
        self.release(self._spool)

    # -------------------------------------------------------------- worker side

    def _drain(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                self._call(self.close_io())
                return
            info, payload = job
            if info is None:
                payload.set()
                continue
            try:
                m = self._call(self._publish(info, payload))
                info.future.set_result(m)
                if self.keep_snapshots is not None and m.kind == "snapshot":
                    self._call(self._gc())
            except BaseException as e:  # the next version becomes a snapshot from scratch
                if isinstance(e, BaseProofError):  # the caller decides (e.g. another base)
                    log.warning("%s", e)
                else:
                    log.error("publishing %s v%d failed: %s", self.run, info.version, e)
                self._base, self._base_proof = None, None
                info.future.set_exception(e)

    async def _gc(self) -> None:
        """The board's retention after a snapshot: a failure is logged, never a publish error."""
        assert self.keep_snapshots is not None
        try:
            r = await gc(self.board, self.run, self.keep_snapshots)
        except Exception as e:  # noqa: BLE001 - e.g. a board that cannot delete
            log.warning("gc of %s (keep %d snapshots) failed: %s", self.run, self.keep_snapshots,
                        e)
            return
        if r.deleted:
            log.info("gc of %s: deleted %d versions below v%s (%d bytes)", self.run,
                     len(r.deleted), r.cut, r.bytes_freed)

    async def _init(self):
        self._base: tuple[int, dict[str, torch.Tensor], dict[str, int]] | None = None
        self._base_proof: Callable[[], None] | None = None
        if self.nats_url:
            await self.connect_nats(self.nats_url, f"stitch-publisher-{self.run}")
        return await self.board.read_latest(self.run)

    async def _first_free(self, version: int) -> int:
        """The first version number from `version` that no failed publish left objects in (each
        version's first object is one of these: the patch, a single shard or the index of a
        sharded snapshot, uploaded before its shards; see `_write_snapshot`)."""
        while await self.taken(version, ("manifest.json", "patch.stp", "model.safetensors",
                                         "model.safetensors.index.json")):
            log.warning("%s v%d holds objects of a failed publish: skipping it", self.run, version)
            version += 1
        return version

    async def _publish(self, info: VersionInfo, view: dict[str, torch.Tensor]) -> Manifest:
        d = self._spool / f"{info.version:06d}"
        d.mkdir(parents=True, exist_ok=True)
        try:
            return await self._publish_in(info, view, d)
        finally:
            shutil.rmtree(d, ignore_errors=True)

    async def _publish_in(
        self, info: VersionInfo, view: dict[str, torch.Tensor], d: Path
    ) -> Manifest:
        files: dict[str, Path] = {}
        objects = []
        changed = None
        base = self._base
        parent = self._published
        if base is not None:
            base_version, base_view, base_fps = base
            path = d / "patch.stp"
            with open(path, "wb") as f:
                b = PatchBuilder(
                    f,
                    run=self.run,
                    base_version=base_version,
                    target_version=info.version,
                    view=self.view,
                )
                for name in sorted(set(base_view) | set(view)):
                    await asyncio.to_thread(
                        b.add, name, base_view.get(name), view.get(name), base_fps.get(name)
                    )
                header = b.finish()
            fps = b.target_fingerprints
            changed = header.changed_elements
            files["patch.stp"] = path
            objects.append(object_ref(path, "patch", sha256=b.sha256))  # hashed as written
            kind = info.kind
        else:
            fps = await asyncio.to_thread(fpr.state_fingerprints, view)
            kind = "snapshot"
        if kind == "snapshot":
            for p in await asyncio.to_thread(self._write_snapshot, view, d, info.version):
                files[p.name] = p
                objects.append(
                    await asyncio.to_thread(
                        object_ref,
                        p,
                        "weights"
                        if p.suffix == ".safetensors" or p.name.endswith(".index.json")
                        else "side",
                    )
                )
        if base is not None and self._base_proof is not None:  # the base is what it claims
            try:
                await asyncio.to_thread(self._base_proof)
            except Exception as e:
                raise BaseProofError(f"{self.run} v{info.version} not published: its base "
                                     f"v{base[0]} did not prove ({e})") from e
            self._base_proof = None
        m = self.build_manifest(version=info.version, parent=parent, kind=kind, step=info.step,
                                rows=rows_of(view, fps), objects=objects, changed=changed)
        info.kind, info.parent = kind, m.parent
        await write_version(self.board, m, files, expected_latest=self._published,
                            signer=self.signer)
        if self.keep_patch:
            self.last_patch = files["patch.stp"].read_bytes() if "patch.stp" in files else None
        self._published = info.version
        self._base = (info.version, view, fps)
        await self.announce(m)
        log.info(
            "published %s v%d (%s, step %s, %s bytes)",
            self.run,
            m.version,
            m.kind,
            info.step,
            m.patch_bytes or m.full_bytes,
        )
        return m

    def _write_snapshot(self, view: dict[str, torch.Tensor], d: Path, version: int) -> list[Path]:
        """The whole view as a snapshot in `d`, in shards of at most `max_shard_bytes`."""
        shards: list[dict[str, torch.Tensor]] = [{}]
        size = 0
        for name in sorted(view):
            t = view[name]
            nb = t.numel() * t.element_size()
            if shards[-1] and size + nb > self.max_shard_bytes:
                shards.append({})
                size = 0
            shards[-1][name] = t
            size += nb
        files = self.write_snapshot_files(zip(shard_names(len(shards)), shards, strict=True),
                                          d, version)
        # the index (a name `_first_free` knows) first: a publish killed after the first object
        # of a sharded snapshot still marks the number as taken
        return sorted(files.values(), key=lambda p: p.name != "model.safetensors.index.json")
