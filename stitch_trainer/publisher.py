"""Publisher: turns training steps into versions on a board, without blocking the step.

`publish(step, tensors_or_module)` projects the masters to the served view (the only work done
on the caller's thread, plus a device-to-host copy), assigns the version number and returns a
`VersionInfo` at once. A background thread diffs against the previous view, encodes the patch,
writes a snapshot every K versions, uploads, moves `latest` and announces on NATS. The queue is
bounded (`queue_size`): when uploads fall behind, `publish` waits instead of piling up memory.
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
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from stitch_core.format import dtypes
from stitch_core.format import fingerprint as fpr
from stitch_core.format.checkpoint import save_shard, write_index
from stitch_core.format.patch import PatchBuilder
from stitch_core.format.views import project
from stitch_core.versions.board import Board, open_board
from stitch_core.versions.manifest import (
    Manifest,
    TensorInfo,
    announcement,
    check_run,
    version_dir,
)
from stitch_core.versions.store import now, object_ref, write_version

from ._io import IOLoop

log = logging.getLogger("stitch.publisher")
SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "added_tokens.json",
)


@dataclass
class VersionInfo:
    run: str
    version: int
    step: int
    kind: str
    parent: int | None
    blocked_seconds: float = 0.0  # time publish() held the caller
    _future: cf.Future = field(default_factory=cf.Future, repr=False)

    def result(self, timeout: float | None = None) -> Manifest:
        """Wait until this version is on the board (and announced); its manifest."""
        return self._future.result(timeout)

    def done(self) -> bool:
        return self._future.done()


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


class Publisher:
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
    ):
        self.run = check_run(run)
        self.view = view
        self.snapshot_every = snapshot_every
        self.config_dir = Path(config_dir) if config_dir else None
        self.nats_url = nats
        self.max_shard_bytes = max_shard_bytes
        self._spool = Path(spool_dir or tempfile.mkdtemp(prefix="stitch-publish-"))
        self._spool.mkdir(parents=True, exist_ok=True)
        self._board_arg = board
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, queue_size))
        self._io = IOLoop("stitch-publisher-io")
        self._call = self._io.call
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

    def resume_from(self, version: int, view: Mapping[str, torch.Tensor],
                    fingerprints: Mapping[str, int]) -> None:
        """Continue a run whose `latest` is `version` with this view: the next publish is a patch
        against it (and fp8 scales stay pinned to it)."""
        if self._published != version:
            raise ValueError(f"board latest is {self._published}, not {version}")
        self._prev_view = dict(view)
        self._call(self._set_base((version, dict(view), dict(fingerprints))))

    async def _set_base(self, base) -> None:
        self._base = base

    def publish(
        self, step: int, tensors: Mapping[str, torch.Tensor] | torch.nn.Module
    ) -> VersionInfo:
        if self._closed:
            raise RuntimeError("publisher is closed")
        t0 = time.perf_counter()
        masters = named_tensors(tensors)
        with torch.no_grad():
            view = project(masters, self.view, previous=self._prev_view)
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
        self._worker.join()
        self._io.stop()
        shutil.rmtree(self._spool, ignore_errors=True)

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -------------------------------------------------------------- worker side

    def _drain(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                self._call(self._shutdown())
                return
            info, payload = job
            if info is None:
                payload.set()
                continue
            try:
                m = self._call(self._publish(info, payload))
                info._future.set_result(m)
            except BaseException as e:  # the next version becomes a snapshot from scratch
                log.error("publishing %s v%d failed: %s", self.run, info.version, e)
                self._base = None
                info._future.set_exception(e)

    async def _init(self):
        self.board = (
            open_board(self._board_arg) if isinstance(self._board_arg, str) else self._board_arg
        )
        self._base: tuple[int, dict[str, torch.Tensor], dict[str, int]] | None = None
        self._js = self._nc = None
        if self.nats_url:
            from stitch_core.versions.announce import connect, ensure_streams

            self._nc = await connect(self.nats_url, name=f"stitch-publisher-{self.run}")
            self._js = self._nc.jetstream()
            await ensure_streams(self._js, self.run)
        return await self.board.read_latest(self.run)

    async def _first_free(self, version: int) -> int:
        """Skip numbers where a publish that died before moving `latest` left objects behind
        (versions are immutable, so they cannot be rewritten)."""
        while any([await self.board.exists(f"{version_dir(self.run, version)}/{name}")
                   for name in ("manifest.json", "patch.stp", "model.safetensors")]):
            log.warning("%s v%d holds objects of a failed publish: skipping it", self.run, version)
            version += 1
        return version

    async def _shutdown(self) -> None:
        if self._nc is not None:
            await self._nc.drain()
        if isinstance(self._board_arg, str):
            await self.board.close()

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
            objects.append(await asyncio.to_thread(object_ref, path, "patch"))
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
        tensors = [
            TensorInfo(
                name=n,
                dtype=dtypes.info(t.dtype).name,
                shape=list(t.shape),
                fingerprint=fpr.fmt(fps[n]),
            )
            for n, t in sorted(view.items())
        ]
        m = Manifest(
            run=self.run,
            version=info.version,
            parent=parent,
            kind=kind,
            view=self.view,
            step=info.step,
            created=now(),
            producer="stitch-rl publisher",
            digest=fpr.digest((t.name, t.dtype, tuple(t.shape), fps[t.name]) for t in tensors),
            tensors=tensors,
            objects=objects,
            changed_elements=changed,
            total_elements=sum(t.numel() for t in view.values()),
        )
        info.kind, info.parent = kind, m.parent
        await write_version(self.board, m, files, expected_latest=self._published)
        self._published = info.version
        self._base = (info.version, view, fps)
        if self._js is not None:
            from stitch_core.versions.announce import announce

            await announce(self._js, announcement(m, self.board.url))
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
        meta = {"stitch.run": self.run, "stitch.version": str(version), "format": "pt"}
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
        out: list[Path] = []
        if len(shards) == 1:
            p = d / "model.safetensors"
            save_shard(shards[0], p, meta)
            out.append(p)
        else:
            where = {}
            for i, sh in enumerate(shards, 1):
                p = d / f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                save_shard(sh, p, meta)
                out.append(p)
                where.update({n: p.name for n in sh})
            write_index(d, where, sum(t.numel() * t.element_size() for t in view.values()))
            out.append(d / "model.safetensors.index.json")
        if self.config_dir:
            for name in SIDE_FILES:
                src = self.config_dir / name
                if src.is_file():
                    shutil.copy2(src, d / name)
                    out.append(d / name)
        return out
