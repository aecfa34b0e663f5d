"""Squashed spans: patches from each recent version straight to the newest (`stitch squash`).

A follower k versions behind would download and apply k patches; under Adam at RL learning
rates many of the flips they carry flip back, so the net difference between v and v+k grows
much more slowly than k (docs/versions.md, "Squashed catch-up"). The squasher follows a run on
its board (it needs nothing else: no trainer, no engine) and, for every new version L, writes a
span from each of the `horizon` versions before L straight to L, carrying exactly the net
difference: a follower up to `horizon` versions behind then downloads one span of about the
size of a direct diff, and applies it in one pause.

How it stays cheap: it holds the newest version's tensors (their integer bit views) and, for
every version v of the window, the sparse set of positions where v differs from the newest,
with v's bits there. When version L+1 arrives, the positions its patch changed are merged into
every set (a position already in a set keeps its older bits), positions that are back to v's
bits drop out, and the span v -> L+1 is exactly that set. Memory: one copy of the weights plus
the window's net differences (positions and bits), never `horizon` copies of the weights.
Each span is built with the ordinary patch builder, its fingerprints are proven against both
manifests before it is uploaded, and it is signed like any version object.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

from stitch_core.distribution import PRODUCER
from stitch_core.format import dtypes
from stitch_core.format import fingerprint as fpr
from stitch_core.format.patch import PatchBuilder, apply_entry, chunk_list
from stitch_core.versions.board.base import Board, NotFoundError
from stitch_core.versions.manifest import (
    Manifest,
    Span,
    span_key,
    span_object,
    version_dir,
)
from stitch_core.versions.materialize import open_patch
from stitch_core.versions.span_index import delete_spans, span_targets, write_span_index
from stitch_core.versions.store import (
    VersionError,
    fetch_object,
    fetch_patch,
    now,
    object_ref,
    plan,
    read_latest,
    read_manifest,
    write_span,
)
from stitch_core.versions.trust import SigningKey, TrustSet

log = logging.getLogger("stitch.squash")

DEFAULT_HORIZON = 32
KEEP_TARGETS = 2  # span sets kept on the board: the newest target's and the one before


class SquashError(VersionError):
    """The squasher cannot go on from what the board holds (structural change, no path)."""


@dataclass
class _Diff:
    """Where a version differs from the newest one: sorted flat positions and its bits there."""

    pos: torch.Tensor
    bits: torch.Tensor

    @property
    def count(self) -> int:
        return int(self.pos.numel())


@dataclass
class SquashReport:
    """What one round of `Squasher.step` did."""

    version: int
    spans: list[dict] = field(default_factory=list)  # {"base", "bytes", "changed", "chain_bytes"}
    skipped: list[dict] = field(default_factory=list)  # {"base", "why"}
    deleted: int = 0  # span objects of older targets removed


def _merge(old: _Diff, pos: torch.Tensor, bits: torch.Tensor, new_iv: torch.Tensor) -> _Diff:
    """`old` after a step that changed `pos` (sorted; their bits before the step were `bits`)
    and left the newest bits `new_iv`: a position already in `old` keeps its older bits, then
    positions whose bits are back to the newest drop out. A merge of two sorted lists by
    binary search (no sort of the union)."""
    if not pos.numel():
        return old
    if not old.count:
        mpos, mbits = pos, bits
    else:
        at = torch.searchsorted(old.pos, pos)
        hit = at < old.count
        hit[hit.clone()] = old.pos[at[hit]] == pos[hit]
        add_pos, add_bits = pos[~hit], bits[~hit]
        n = old.count + add_pos.numel()
        # final index of each element: its rank in its own list + the other list's elements
        # before it (positions are unique across the two lists now)
        i_old = torch.arange(old.count) + torch.searchsorted(add_pos, old.pos)
        i_add = torch.arange(add_pos.numel()) + torch.searchsorted(old.pos, add_pos)
        mpos = torch.empty(n, dtype=torch.int64)
        mbits = torch.empty(n, dtype=old.bits.dtype)
        mpos[i_old], mbits[i_old] = old.pos, old.bits
        mpos[i_add], mbits[i_add] = add_pos, add_bits
    keep = mbits != new_iv[mpos]
    return _Diff(mpos[keep], mbits[keep])


class Squasher:
    """Follows `run` on `board` and writes spans to each new version from the `horizon`
    versions before it (see the module doc). `step()` does one round; `run()` loops."""

    def __init__(self, board: Board, run: str, cache: Path, *, horizon: int = DEFAULT_HORIZON,
                 signer: SigningKey | None = None, trust: TrustSet | None = None,
                 keep_targets: int = KEEP_TARGETS, workers: int | None = None):
        if horizon < 2:
            raise ValueError("horizon must be at least 2 (a span of one version is its patch)")
        self.board, self.run, self.cache = board, run, Path(cache)
        self.horizon, self.signer, self.trust = horizon, signer, trust
        self.keep_targets = max(1, keep_targets)
        self.workers = workers or min(4, os.cpu_count() or 1)
        self.version: int | None = None
        self.manifests: dict[int, Manifest] = {}  # the window's and the newest one's
        self.state: dict[str, torch.Tensor] = {}  # newest version's integer bit views (flat)
        self.dtypes: dict[str, torch.dtype] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.window: dict[int, dict[str, _Diff]] = {}  # version -> its difference from newest
        self.chain_bytes: dict[int, int] = {}  # version -> patch bytes from it to the newest
        self.targets: list[int] = []  # versions this squasher wrote spans to, oldest first

    # ---------------------------------------------------------------- state

    async def _load(self, version: int) -> None:
        """Start over at `version`: materialise it in memory (snapshot + chain, every tensor
        proven against the manifest), with an empty window."""
        steps = await plan(self.board, self.run, None, version, trust=self.trust, spans=False)
        snap = steps[0]
        tensors: dict[str, torch.Tensor] = {}
        for ref in snap.manifest.weights:
            p = await fetch_object(self.board, snap.manifest, ref, self.cache)
            if p.suffix == ".safetensors":
                tensors.update(load_file(p))
        if fpr.state_fingerprints(tensors) != snap.manifest.fingerprints:
            raise SquashError(f"{self.run} v{snap.version}: snapshot fingerprints do not match "
                              "its manifest")
        self._set_state(tensors, snap.manifest)
        for s in steps[1:]:
            await self._advance(s.manifest, record=False)
        log.info("squash %s: holding v%d (%d tensors)", self.run, version, len(self.state))

    def _set_state(self, tensors: dict[str, torch.Tensor], m: Manifest) -> None:
        self.state = {n: dtypes.int_view(t.contiguous()).reshape(-1).clone()
                      for n, t in tensors.items()}
        self.dtypes = {n: t.dtype for n, t in tensors.items()}
        self.shapes = {n: tuple(t.shape) for n, t in tensors.items()}
        self.window, self.chain_bytes = {}, {}
        self.manifests = {m.version: m}
        self.version = m.version

    def _tensor(self, name: str) -> torch.Tensor:
        return dtypes.from_int(self.state[name], self.dtypes[name], self.shapes[name])

    async def _advance(self, m: Manifest, *, record: bool = True) -> None:
        """Apply `m`'s patch (from the held version) in memory and update the window."""
        parts = await fetch_patch(self.board, m, self.cache)
        reader = open_patch(parts, m)
        held = self.manifests[self.version].fingerprints
        try:
            entries = {e.name: e for e in reader.header.tensors}
            if set(entries) != set(self.state) or any(
                    e.kind != "patch" for e in entries.values()):
                raise SquashError(f"{self.run} v{m.version} changes the set, shape or dtype of "
                                  "tensors: spans cannot cross it")
            if reader.header.base_version != self.version:
                raise SquashError(f"{self.run} v{m.version}'s patch is from v"
                                  f"{reader.header.base_version}, not the held v{self.version}")
            new_state: dict[str, torch.Tensor] = {}
            changed: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
            for name, e in entries.items():
                old_iv = self.state[name]
                if not chunk_list(reader, e):
                    new_state[name] = old_iv
                    continue
                # proves the base and the result against the patch's fingerprints
                out = apply_entry(reader, e, self._tensor(name), base_fp=held[name])
                new_iv = dtypes.int_view(out.contiguous()).reshape(-1)
                pos = torch.nonzero(old_iv != new_iv).reshape(-1)
                changed[name] = (pos, old_iv[pos].clone())
                new_state[name] = new_iv
        finally:
            reader.close()
        got = {e.name: fpr.parse(e.target_fp) for e in entries.values() if e.target_fp}
        if got != m.fingerprints:
            raise SquashError(f"{self.run} v{m.version}: its patch does not produce the "
                              "manifest's fingerprints")
        prev = self.version
        if record:
            assert prev is not None
            for diff in self.window.values():
                for name, (pos, bits) in changed.items():
                    d = diff.get(name)
                    diff[name] = _merge(d if d is not None else _Diff(pos[:0], bits[:0]),
                                        pos, bits, new_state[name])
            self.window[prev] = {n: _Diff(p, b) for n, (p, b) in changed.items()}
            for v in self.chain_bytes:
                self.chain_bytes[v] += m.patch_bytes
            self.chain_bytes[prev] = m.patch_bytes
            for v in sorted(self.window)[:-self.horizon]:
                del self.window[v]
                self.chain_bytes.pop(v, None)
        else:
            self.window, self.chain_bytes = {}, {}
        self.state = new_state
        old = self.manifests
        self.manifests = {v: old[v] for v in self.window if v in old}
        self.manifests[m.version] = m
        self.version = m.version

    # ---------------------------------------------------------------- spans

    def _build(self, base: int, out: Path) -> tuple[int, int, str | None]:
        """Write the span `base` -> held version to `out`; (bytes, changed elements, SHA-256). The
        target fingerprints the builder computes from the base's are checked against the
        target's manifest (and both digests) before anything is uploaded."""
        target = self.manifests[self.version]
        base_m = self.manifests[base]
        base_fps = base_m.fingerprints
        diff = self.window[base]
        with open(out, "wb") as f:
            b = PatchBuilder(f, run=self.run, base_version=base, target_version=self.version,
                             view=target.view)
            for t in target.tensors:
                name = t.name
                d = diff.get(name)
                pos = d.pos if d is not None else torch.zeros(0, dtype=torch.int64)
                old = d.bits if d is not None else self.state[name][:0]
                b.add_positions(name, pos, old, self.state[name][pos],
                                dtype=self.dtypes[name], shape=self.shapes[name],
                                base_fp=base_fps[name])
            header = b.finish({"stitch.span": f"{base}-{self.version}"})
        got = {e.name: fpr.parse(e.target_fp) for e in header.tensors if e.target_fp}
        if got != target.fingerprints or header.target_digest != target.digest or \
                header.base_digest != base_m.digest:
            raise SquashError(f"span {self.run} v{base}->v{self.version} does not prove "
                              "(fingerprints or digests differ from the manifests)")
        return out.stat().st_size, sum(e.changed for e in header.tensors), b.sha256

    async def _write_spans(self, report: SquashReport) -> None:
        """Build and upload the spans to the held version, `workers` at a time (the codec's
        kernels release the GIL). A span already on the board (a restarted squasher) is kept;
        an object left without its document by a killed one is replaced."""
        target = self.manifests[self.version]
        bases = [b for b in sorted(self.window, reverse=True)
                 if b != target.parent and b in self.manifests]  # not the version's own patch
        gate = asyncio.Semaphore(self.workers)
        written: list[int] = []
        builds: list[asyncio.Future] = []  # the codec's threads: awaited before `tmp` goes

        async def one(base: int, tmp: Path) -> None:
            if await self.board.exists(span_key(self.run, self.version, base)):
                written.append(base)
                return
            chain = self.chain_bytes.get(base, 0)
            path = tmp / span_object(base)
            async with gate:
                build = asyncio.ensure_future(asyncio.to_thread(self._build, base, path))
                builds.append(build)
                size, changed, sha = await asyncio.shield(build)  # a cancel leaves the thread be
            if size >= chain:
                report.skipped.append({"base": base, "why": f"{size} bytes, not smaller "
                                       f"than the chain's {chain}"})
                return
            obj = f"{version_dir(self.run, self.version)}/{path.name}"
            if not self.board.readonly and await self.board.exists(obj):
                await self.board.delete(obj)  # a killed squasher's, without its document
            sp = Span(run=self.run, base=base, version=self.version,
                      base_digest=self.manifests[base].digest, digest=target.digest,
                      objects=[object_ref(path, "patch", sha256=sha)], changed_elements=changed,
                      created=now(), producer=f"{PRODUCER} squash")
            await write_span(self.board, sp, {path.name: path}, self.signer)
            path.unlink()
            written.append(base)
            report.spans.append({"base": base, "bytes": size, "changed": changed,
                                 "chain_bytes": chain})

        with tempfile.TemporaryDirectory(prefix="stitch-squash-") as tmp:
            tasks = [asyncio.create_task(one(b, Path(tmp))) for b in bases]
            try:
                await asyncio.gather(*tasks)
            finally:
                # one span failed (or the step was cancelled): stop the others, and let no
                # build thread still write into `tmp` (or anything reach the board) after this
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, *builds, return_exceptions=True)
        report.spans.sort(key=lambda r: r["base"])
        # the index last, derived from the documents now on the board (a hint for readers
        # that cannot list; retention lists the documents themselves)
        await write_span_index(self.board, self.run, self.version, written)
        self.targets.append(self.version)

    async def _delete_old(self, report: SquashReport) -> None:
        """Delete the spans of targets older than the `keep_targets` newest (they only ever
        lead to a version that is not the newest). The targets are found by listing the board,
        so the spans of targets an earlier (killed, restarted) squasher wrote go too; a board
        that cannot list falls back on the targets this squasher wrote."""
        if self.board.readonly:
            return
        listed = await span_targets(self.board, self.run)
        if listed is None:
            while len(self.targets) > self.keep_targets:
                t = self.targets.pop(0)
                report.deleted += await delete_spans(self.board, self.run, t)
            return
        keep = set(sorted(set(listed) | set(self.targets))[-self.keep_targets:])
        keep.add(self.version)
        for t in listed:
            if t not in keep:
                report.deleted += await delete_spans(self.board, self.run, t)
        self.targets = [t for t in self.targets if t in keep]

    # ---------------------------------------------------------------- loop

    async def _window_start(self, latest: int) -> int:
        """The oldest version within `horizon` patches of `latest` on its chain."""
        v, start = latest, latest
        for _ in range(self.horizon):
            try:
                m = await read_manifest(self.board, self.run, v, self.trust)
            except (NotFoundError, VersionError):
                break
            if m.patch is None or m.parent is None:
                break
            start = v = m.parent
        return start

    async def step(self) -> SquashReport | None:
        """One round: follow `latest` one version at a time and write the spans to each new
        version. Returns the report of the last version handled (None: nothing new)."""
        latest = await read_latest(self.board, self.run, self.trust)
        if latest is None or (self.version is not None and latest.version <= self.version):
            return None
        report = None
        if self.version is None:  # start `horizon` versions back: spans to latest at once
            await self._load(await self._window_start(latest.version))
            if self.version == latest.version:
                return SquashReport(version=latest.version)
        # the versions between the held one and latest, oldest first (walked back from latest)
        todo: list[Manifest] = []
        v: int | None = latest.version
        while v is not None and v > self.version:
            m = await read_manifest(self.board, self.run, v, self.trust)
            todo.append(m)
            v = m.parent if m.patch is not None else None
        if v != self.version:  # no patch chain from what is held: start over at latest
            log.warning("squash %s: no patch chain from v%s to v%d; starting over there",
                        self.run, self.version, latest.version)
            await self._load(latest.version)
            return SquashReport(version=latest.version)
        todo.reverse()
        for i, m in enumerate(todo):
            try:
                await self._advance(m)
            except SquashError as e:
                log.warning("squash %s: %s; starting over at v%d", self.run, e, m.version)
                await self._load(m.version)
                report = SquashReport(version=m.version)
                continue
            report = SquashReport(version=m.version)
            if i < len(todo) - self.keep_targets:
                continue  # behind: only the newest targets' spans would be kept
            await self._write_spans(report)
            await self._delete_old(report)
            log.info("squash %s v%d: %d spans (%s bytes), %d skipped, %d old objects deleted",
                     self.run, m.version, len(report.spans),
                     f"{sum(s['bytes'] for s in report.spans):,}", len(report.skipped),
                     report.deleted)
        return report

    async def run(self, interval: float = 2.0, stop: asyncio.Event | None = None) -> None:
        """Poll the board every `interval` seconds and squash each new version."""
        stop = stop or asyncio.Event()
        while not stop.is_set():
            try:
                await self.step()
            except (NotFoundError, VersionError) as e:
                log.warning("squash %s: %s", self.run, e)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval)
