"""What every publisher shares: the run's board and NATS connection, free version numbers, the
manifest of a version and snapshot files in HF layout.

`PublisherBase` holds them; `Publisher` (one process, a background thread) and `FSDPPublisher` /
`MegatronPublisher` (every rank of a sharded model, synchronous collectives) differ only in where
the view comes from and who writes which part. Their common steps are public hooks here, so a new
publisher (and the signing of manifests, made where a manifest is assembled) has one place to
change: `connect_nats`, `announce`, `taken`, `build_manifest`, `write_snapshot_files`, `close_io`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

from stitch_core.format.checkpoint import save_shard, write_index
from stitch_core.versions.board import Board, open_board
from stitch_core.versions.manifest import (
    Manifest,
    ObjectRef,
    announcement,
    check_run,
    version_dir,
)
from stitch_core.versions.store import now
from stitch_core.versions.trust import SigningKey

from ._io import IOLoop

log = logging.getLogger("stitch.publisher")
ANNOUNCE_TIMEOUT = 2.0  # seconds an announcement may take before the publisher moves on

# HF side files a snapshot carries next to the weights (config, tokenizer, templates)
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

# (name, dtype name, shape, fingerprint): one tensor of a version, as manifests and digests list it
Row = tuple[str, str, tuple[int, ...], int]

__all__ = ["PublisherBase", "Row", "SIDE_FILES", "rows_of"]


def rows_of(view: Mapping[str, torch.Tensor], fps: Mapping[str, int]) -> list[Row]:
    """The rows of a whole view whose fingerprints are `fps`."""
    from stitch_core.format import dtypes

    return [(n, dtypes.info(t.dtype).name, tuple(t.shape), fps[n]) for n, t in view.items()]


class PublisherBase:
    """The board side of a publisher of run `run` in served view `view`.

    `board`: a URL (opened, and closed by `close_io`) or a Board (left open). Board and NATS I/O
    run on one background event loop (`call(coro)` from the caller's thread). `signing_key`: a
    private key file (`stitch keys new`) or a SigningKey; every manifest and `latest` pointer
    this publisher writes is then signed with it."""

    producer = "stitch-rl publisher"

    def __init__(self, board: str | Board, run: str, view: str, *,
                 config_dir: str | Path | None, io_name: str,
                 signing_key: str | Path | SigningKey | None = None):
        self.run = check_run(run)
        self.signer: SigningKey | None = (
            signing_key if isinstance(signing_key, SigningKey) or signing_key is None
            else SigningKey.load(signing_key))
        self.view = view
        self.config_dir = Path(config_dir) if config_dir else None
        self._own_board = isinstance(board, str)
        self.board: Board = open_board(board) if isinstance(board, str) else board
        self._io = IOLoop(io_name)
        self._call = self._io.call
        self._nc = self._js = None

    def call(self, coro):
        """Run a coroutine on the publisher's I/O loop; its result."""
        return self._call(coro)

    def close(self) -> None:  # subclasses finish their own work, then call release()
        raise NotImplementedError

    def release(self, spool: Path | None) -> None:
        """Stop the I/O loop and remove the spool directory (after `close_io` ran on it)."""
        self._io.stop()
        if spool is not None:
            shutil.rmtree(spool, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -------------------------------------------------------------- NATS
    async def connect_nats(self, url: str, name: str) -> None:
        """Connect to NATS and make sure the run's streams exist (announcements)."""
        from stitch_core.versions.nats_conn import connect
        from stitch_core.versions.streams import ensure_streams

        self._nc = await connect(url, name=name)
        self._js = self._nc.jetstream()
        await ensure_streams(self._js, self.run)

    async def announce(self, m: Manifest) -> None:
        """Announce a version on NATS (nothing without a connection). The version is on the
        board already and followers poll it, so an announcement that fails or takes longer than
        ANNOUNCE_TIMEOUT is logged, never the version's failure (NATS down must neither fail a
        publish nor hold the trainer)."""
        if self._js is None:
            return
        from stitch_core.versions.announce import announce

        try:
            await asyncio.wait_for(announce(self._js, announcement(m, self.board.url)),
                                   ANNOUNCE_TIMEOUT)
        except Exception as e:  # noqa: BLE001 - NATS down, slow, refused: followers poll
            log.warning("announcement of %s v%d failed (%s: %s); it is on the board, followers "
                        "will see it when they poll", m.run, m.version, type(e).__name__, e)

    async def close_io(self) -> None:
        """Drain NATS and close a board this publisher opened."""
        if self._nc is not None:  # bounded, and never an error: NATS may be down by now
            try:
                await asyncio.wait_for(self._nc.drain(), 5.0)
            except Exception:  # noqa: BLE001 - reconnecting, timed out, closed: just close
                with contextlib.suppress(Exception):
                    await self._nc.close()
        if self._own_board:
            await self.board.close()

    # -------------------------------------------------------------- versions
    async def taken(self, version: int, names: Iterable[str]) -> bool:
        """Does `version` of the run hold any of these objects (left by a publish that died before
        moving `latest`: versions are immutable, so such a number is skipped, never rewritten)?"""
        vdir = version_dir(self.run, version)
        return any([await self.board.exists(f"{vdir}/{name}") for name in names])

    def build_manifest(self, *, version: int, parent: int | None, kind: str, step: int | None,
                       rows: Iterable[Row], objects: list[ObjectRef], changed: int | None,
                       producer: str | None = None, created: str | None = None) -> Manifest:
        """The manifest of one version from its tensors' rows and its objects (signed when this
        publisher has a signing key: one signature per version, made here, where it is
        assembled)."""
        m = Manifest.from_rows(run=self.run, version=version, parent=parent, kind=kind,
                               view=self.view, step=step, created=created or now(),
                               producer=producer or self.producer, rows=rows, objects=objects,
                               changed=changed)
        return self.signer.sign(m, "manifest") if self.signer is not None else m

    def write_snapshot_files(self, shards: Iterable[tuple[str, Mapping[str, torch.Tensor]]],
                             d: Path, version: int, side_from: Path | None = None,
                             n_shards: int | None = None) -> dict[str, Path]:
        """Write a snapshot in HF layout into `d`: each (file name, tensors) shard, the index when
        there are several, and the side files from `config_dir` (else `side_from`). Shards may be
        produced lazily (one in memory at a time). Returns {file name: path}."""
        meta = {"stitch.run": self.run, "stitch.version": str(version), "format": "pt"}
        files: dict[str, Path] = {}
        where: dict[str, str] = {}
        total = 0
        for fname, tensors in shards:
            save_shard(dict(tensors), d / fname, meta)
            files[fname] = d / fname
            for n, t in tensors.items():
                where[n] = fname
                total += t.numel() * t.element_size()
        if len(files) > 1:
            write_index(d, where, total)
            files["model.safetensors.index.json"] = d / "model.safetensors.index.json"
        side = self.config_dir or side_from
        for name in SIDE_FILES if side else ():
            if (side / name).is_file():
                shutil.copy2(side / name, d / name)
                files[name] = d / name
        return files


def shard_names(n: int) -> list[str]:
    """HF file names of a snapshot in `n` shards."""
    if n == 1:
        return ["model.safetensors"]
    return [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
