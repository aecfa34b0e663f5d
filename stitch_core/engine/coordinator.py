"""The node side of an engine follower: decode each patch once, drive every rank, prove the result.

Engine-agnostic: an adapter gives it `rpc(method, payload) -> [reply per rank]` reaching a
`stitch_core.engine.replica.RankReplica` in every tensor-parallel rank, plus optional
`pause`/`resume`
(hold engine steps) and `after_apply(version)` (called while steps are still held, right after a
version is in place: reset the prefix cache, tell the engine its weight version) hooks. It is the
`apply` callback of a `stitch_core.versions.follower.Follower`.

Why the coordinator, not every rank, decodes: ULP values are entropy-coded under contexts taken
from the *old* value of each element, so a rank holding a slice of a tensor cannot decode a chunk
alone. The coordinator decodes positions, gathers the old bits from the ranks that hold them,
decodes the values once (while the engine keeps serving), and checks the result against the
manifest *before* anything is written: base fingerprint + sum of h(new) - h(old) must equal the
target fingerprint of every tensor, and both version digests must match. A corrupt, truncated,
foreign or out-of-order patch is refused there, with the engine untouched. Only then are the
ranks asked to write (engine steps held); each rank reads back what it wrote and reports its
fingerprint delta over every copy it holds, and the sum over ranks must equal multiplicity x the
change in the manifest fingerprint, or every rank undoes.

Start-up: the ranks learn their layout from the model's own loaders and report full sums; a
tensor whose sums do not add up to multiplicity x its manifest fingerprint is not placed exactly
by the layout (a loader or post-load step that transforms values). So is an engine parameter that
no loader writes (computed from other weights after loading, e.g. MLA's absorbed matrices): a
patch could not keep it in step. Either refuses the start, naming them, unless the loader
fallback is opted into: then a transformed tensor goes through the engine's own loader with the
reconstructed tensor (kept on the host here), unverified, and both are logged by name.

Long on purpose (about 470 lines): one apply is one transaction (gather, decode, prove, write,
check, commit or undo); splitting its steps over modules would hide the order that makes it safe.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from stitch_core.engine import rpc
from stitch_core.engine.layout import read_safetensors_shapes
from stitch_core.engine.rpc import index_dtype
from stitch_core.errors import StitchError
from stitch_core.format import codec, dtypes
from stitch_core.format import fingerprint as fpr
from stitch_core.format.checkpoint import open_checkpoint
from stitch_core.format.patch import (
    PatchSet,
    apply_entry,
    check_compatible,
    check_digests,
    chunk_list,
    decode_chunk,
)
from stitch_core.format.stp import PatchError, PatchReader
from stitch_core.settings import APPLY_MEMORY, LOAD_TIMEOUT, RPC_TIMEOUT
from stitch_core.versions.manifest import PULLED_MANIFEST, Manifest
from stitch_core.versions.store import RefusedVersion, Step, check_signed
from stitch_core.versions.trust import TrustSet

log = logging.getLogger("stitch.engine")
# transient bytes the API server holds per changed element while it decodes a batch (positions,
# old and new bits at int64 and at the tensor's width, the ranks' replies, the RPC copies)
APPLY_BYTES_PER_ELEMENT = 48
DEFAULT_APPLY_MEMORY = APPLY_MEMORY  # decoded per batch at most (a patch of any size)
# the adapter's transport: one typed request to every rank, one reply per rank (rank order)
Rpc = Callable[[rpc.Request], Awaitable[list[Any]]]
Hook = Callable[[], Awaitable[Any]]
VersionHook = Callable[[int], Awaitable[Any]]


class EngineStateError(StitchError, RuntimeError):
    """The engine's weights could not be proven; it must not serve until recovered."""


def read_pulled_manifest(model_dir: str | Path) -> Manifest | None:
    """The manifest `stitch pull` left in `model_dir`, None if it has none."""
    p = Path(model_dir) / PULLED_MANIFEST
    if not p.exists():
        return None
    return Manifest.model_validate_json(p.read_text())


def _files_fingerprints(model_dir: Path, names: list[str]) -> dict[str, int]:
    ck = open_checkpoint(model_dir)
    return {n: fpr.fingerprint(n, ck.load(n)) for n in names}


def _load_host(model_dir: Path, names: set[str]) -> dict[str, torch.Tensor]:
    ck = open_checkpoint(model_dir)
    return {n: ck.load(n) for n in ck.names() if n in names}


class Coordinator:
    """Drives one engine's ranks through start-up and each apply, and proves the result."""

    def __init__(self, rpc: Rpc, *, run: str | None = None, gate: Any = None,
                 metrics: Any = None, pause: Hook | None = None, resume: Hook | None = None,
                 after_apply: VersionHook | None = None, loader_fallback: bool = False,
                 rpc_timeout: float | None = RPC_TIMEOUT, load_timeout: float | None = LOAD_TIMEOUT,
                 apply_memory: int = DEFAULT_APPLY_MEMORY):
        self.rpc = rpc
        # bytes an apply decodes at a time: a patch over it is applied in batches, each one
        # gathered, decoded and written inside the pause (one transaction, one undo)
        self.apply_memory = int(apply_memory)
        # every rank RPC is bounded: a hung rank fails the apply (then undone and proven, or
        # the engine stops serving) instead of holding the engine forever
        self.rpc_timeout = rpc_timeout
        self.load_timeout = load_timeout  # start-up layout learning and snapshot loads
        # tensors the layout map does not place exactly: refuse (default), or update them through
        # the engine's own loader, which nothing can read back to verify
        self.loader_fallback = loader_fallback
        self.run = run
        self.gate = gate
        self.metrics = metrics
        self.pause, self.resume, self.after_apply = pause, resume, after_apply
        self.version: int | None = None
        self.fps: dict[str, int] = {}  # verified fingerprints of the version the engine holds
        self.shapes: dict[str, tuple[tuple[int, ...], str]] = {}
        self.mult: dict[str, int] = {}  # copies of each element across all ranks
        self.fallback: dict[str, torch.Tensor] = {}  # tensors applied through the engine loader
        self.unheld: list[str] = []  # tensors no rank holds any element of (e.g. a tied lm_head)
        self.derived: list[str] = []  # engine params no loader writes (computed after loading)
        self.derived_copies: dict[str, int] = {}  # kernels' copies kept in step, by kind
        self.ranks = 0
        self.check: dict[str, Any] = {"ok": None}
        self.last_apply: dict[str, Any] | None = None
        # the last apply or load that failed once a rank may have written: undone and proven?
        self.last_abort: dict[str, Any] | None = None
        self.patch_bytes_total = 0
        self.history: list[dict[str, Any]] = []
        # engine steps left held after a failed apply or load whose weights could not be proven:
        # requests already admitted stay frozen (never served from those weights) until a
        # snapshot load is proven and resumes them
        self.steps_held = False
        self._lock = asyncio.Lock()

    async def _call(self, req: rpc.Request, timeout: float | None = None) -> list[Any]:
        """`rpc(req)` on every rank, bounded by `timeout` (default `rpc_timeout`; EngineStateError
        when it runs out)."""
        limit = timeout if timeout is not None else self.rpc_timeout
        try:
            return await asyncio.wait_for(self.rpc(req), limit)
        except TimeoutError:
            raise EngineStateError(f"{type(req).__name__}: no answer from every rank in "
                                   f"{limit:g} s") from None

    def _mismatched(self, replies: list[rpc.SumsReply], fps: dict[str, int]) -> list[str]:
        """Tensors whose summed per-copy fingerprints differ from `fps`, and stale copies."""
        return [n for n, k in self.mult.items()
                if sum(r.sums[n] for r in replies) & fpr.MASK64 != (k * fps[n]) & fpr.MASK64
                ] + _stale(replies)

    def stop_serving(self, reason: str) -> None:
        """Hold no version from now on (requests get not_ready) until one is proven again."""
        log.error("stitch: %s; not serving v%s any more", reason, self.version)
        self.check = {"ok": False, "at": time.time(), "kind": "stopped", "reason": reason}
        self._set_version(None)

    async def _abort(self, aid: str, version: int, err: BaseException) -> None:
        """An apply of `version` failed once a rank may have written: undo it on every rank and
        prove the version held before. If that cannot be proven (a rank gone, hung or holding
        other bits), stop serving: nothing unproven is ever served (new requests get not_ready,
        engine steps stay held, see `_resume`), and the follower reloads a snapshot through the
        verified path (it reads the held version, None, from here)."""
        try:
            await self._call(rpc.Undo(aid))
            bad = self._mismatched(await self._call(rpc.Sums(sorted(self.mult))), self.fps)
        except Exception as e:  # noqa: BLE001 - any failure here means: not provable
            bad = [f"{type(e).__name__}: {e}"]
        self.last_abort = {"version": version, "error": f"{type(err).__name__}: {err}",
                           "undone": not bad, "at": time.time()}
        if not bad:
            log.warning("stitch: v%d failed (%s); undone on every rank, v%s proven", version,
                        err, self.version)
            return
        log.error("stitch: v%d failed (%s) and v%s could not be proven after the undo (%s); "
                  "not serving until a snapshot is loaded", version, err, self.version,
                  ", ".join(bad[:5]))
        self.check = {"ok": False, "at": time.time(), "kind": "abort", "mismatched": bad[:20]}
        self._set_version(None)
        raise EngineStateError(f"v{version} failed and the engine's weights could not be proven "
                               f"afterwards: {bad[0]}") from err

    # ------------------------------------------------------------ status

    def status(self) -> dict[str, Any]:
        return {"fingerprint_check": self.check, "last_apply": self.last_apply,
                "last_abort": self.last_abort,
                "patch_bytes_total": self.patch_bytes_total, "ranks": self.ranks,
                "fallback_tensors": sorted(self.fallback), "unheld_tensors": self.unheld,
                "derived_params": self.derived, "derived_copies": self.derived_copies,
                "steps_held": self.steps_held}

    async def _resume(self, proven: bool) -> None:
        """End the pause of an apply or load: resume engine steps if the weights are proven.
        If not, keep them held: requests admitted before (at a proven version) would otherwise
        go on generating from weights nothing proved, and answer 200; they wait instead, frozen,
        until a snapshot load is proven (it resumes them)."""
        if self.pause is None or self.resume is None:
            return
        if not proven:
            self.steps_held = True
            log.error("stitch: engine steps stay held until a version is proven")
            return
        await self.resume()
        self.steps_held = False

    # ------------------------------------------------------------ start-up

    async def start(self, model_dir: str | Path, trust: TrustSet | None = None) -> int | None:
        """Learn layouts on every rank and prove the loaded weights; returns the held version.
        With a trust set the directory must carry a manifest signed by one of its keys (what the
        ranks hold is then proven against that manifest's fingerprints)."""
        model_dir = Path(model_dir)
        m = read_pulled_manifest(model_dir)
        if trust:
            if m is None:
                raise EngineStateError(
                    f"a trust set is configured but {model_dir} has no {PULLED_MANIFEST} (start "
                    "from `stitch pull --trust ...` output): nothing signed to prove it against")
            try:
                kid = check_signed(m, trust)
            except RefusedVersion as e:
                raise EngineStateError(f"refusing to serve {model_dir}: {e}") from None
            log.info("stitch: %s v%d in %s is signed by trusted key %s", m.run, m.version,
                     model_dir, kid)
        if m is not None:
            if self.run is not None and m.run != self.run:
                raise EngineStateError(f"{model_dir} holds run {m.run!r}, not {self.run!r}")
            self.run = m.run
            self.shapes = {t.name: (tuple(t.shape), t.dtype) for t in m.tensors}
            want = m.fingerprints
        else:
            hf = read_safetensors_shapes(model_dir)
            self.shapes = {n: (s, dtypes.info(d).name) for n, (s, d) in hf.items()}
            want = await asyncio.to_thread(_files_fingerprints, model_dir, list(self.shapes))
        t0 = time.perf_counter()
        replies: list[rpc.SetupReply] = await self._call(rpc.Setup(self.shapes),
                                                         self.load_timeout)
        self.ranks = len(replies)
        placed, fallback, self.unheld = self._classify(replies, want)
        self.derived = sorted({p for r in replies for p in r.derived}
                              | {a for r in replies for a in r.unmanaged})
        self.derived_copies = _merge_counts(r.derived_copies for r in replies)
        stale = _stale(replies)
        if stale:
            raise EngineStateError(f"derived copies of weights do not match the weights they are "
                                   f"built from: {', '.join(stale[:5])}")
        if self.derived:
            msg = (f"{len(self.derived)} engine parameters or kernel states are written by no "
                   "loader (computed from other weights after loading, e.g. MLA's absorbed "
                   "W_UK/W_UV or a packed copy no adapter rebuilds, or never loaded), so a patch "
                   "cannot keep them in step with the weights: "
                   f"{', '.join(self.derived[:5])}{' ...' if len(self.derived) > 5 else ''}")
            if not self.loader_fallback:
                raise EngineStateError(msg + ". STITCH_LOADER_FALLBACK=1 follows anyway, "
                                       "leaving them as loaded")
            log.warning("stitch: %s; following anyway (loader fallback on)", msg)
        if self.unheld:
            log.warning("stitch: %d tensors of the checkpoint are held by no rank (the engine's "
                        "loaders place none of their elements, e.g. a tied lm_head): %s; the "
                        "engine does not use them, so they are neither verified nor updated",
                        len(self.unheld), ", ".join(self.unheld[:10]))
        if fallback and not self.loader_fallback:
            raise EngineStateError(
                f"{len(fallback)} tensors are not held where the layout map puts them (a loader "
                "or a post-load step transforms them, e.g. quantisation or kernel repacking), so "
                f"the engine's copy cannot be verified: {', '.join(sorted(fallback)[:5])}"
                f"{' ...' if len(fallback) > 5 else ''}. STITCH_LOADER_FALLBACK=1 updates them "
                "through the engine's own loader instead, unverified")
        if fallback:
            host = await asyncio.to_thread(_load_host, model_dir, set(fallback))
            bad = [n for n in fallback if n not in host or fpr.fingerprint(n, host[n]) != want[n]]
            if bad:
                raise EngineStateError(f"snapshot files do not match their fingerprints: {bad[:5]}")
            self.fallback = host
            log.warning("stitch: %d tensors are not placed exactly by the layout map and will be "
                        "updated through the engine's own loader: %s", len(fallback),
                        ", ".join(sorted(fallback)))
        self.fps = dict(want)
        self.check = {"ok": True, "at": time.time(), "kind": "full", "tensors": len(placed),
                      "fallback": len(fallback), "seconds": time.perf_counter() - t0}
        if m is not None:
            self._set_version(m.version)
        log.info("stitch: %s verified on %d rank(s): %d tensors in place, %d via the loader; "
                 "kernels' packed copies kept in step: %s",
                 f"{m.run} v{m.version}" if m else str(model_dir), self.ranks, len(placed),
                 len(fallback), ", ".join(f"{n} {k}" for k, n in self.derived_copies.items())
                 or "none")
        return self.version

    def _classify(self, replies, want: dict[str, int]) -> tuple[list[str], list[str], list[str]]:
        """(placed: every copy proven; fallback: mapped but not provable; unheld: no element
        mapped on any rank)."""
        placed, fallback, unheld = [], [], []
        for name, (shape, _) in self.shapes.items():
            numel = int(np.prod(shape, dtype=np.int64))
            mapped = sum(r.mapped.get(name, 0) for r in replies)
            total = sum(r.sums.get(name, 0) for r in replies) & fpr.MASK64
            k = mapped // numel if numel else 0
            if not numel or not mapped:
                unheld.append(name)
            elif mapped == k * numel and total == (k * want[name]) & fpr.MASK64:
                self.mult[name] = k
                placed.append(name)
            else:
                fallback.append(name)
        return placed, fallback, sorted(unheld)

    def _set_version(self, v: int | None) -> None:
        self.version = v
        if self.gate is not None:
            if v is None:
                self.gate.clear_version()
            else:
                self.gate.set_version(v)
        if self.metrics is not None and v is not None:
            self.metrics.set_version(v, getattr(self.gate, "latest", None))

    # ------------------------------------------------------------ following

    async def __call__(self, step: Step, path: Path) -> None:
        """The Follower's apply callback."""
        if step.kind == "snapshot":
            await self.load_snapshot(step.manifest, path)
        else:
            await self.apply_patch(step.manifest, step.patch_parts or [path])

    async def apply_patch(self, m: Manifest, paths: list[Path]) -> dict[str, Any]:
        async with self._lock:
            t_all = time.perf_counter()
            refs = m.patches if len(m.patches) == len(paths) else [None] * len(paths)
            readers: list[PatchReader] = []
            try:
                for p, r in zip(paths, refs, strict=True):
                    readers.append(PatchReader(p, sha256=r.sha256 if r else None))
                patch = (readers[0] if len(readers) == 1 and readers[0].header.part is None
                         else PatchSet(readers))
                placed, fallback = await asyncio.to_thread(self._check, patch, m)
                batches = self._batches(patch, placed)
                aid = uuid.uuid4().hex
                fb_new = await asyncio.to_thread(self._decode_fallback, patch, fallback)
                timing = {"gather_s": 0.0, "gather_rank_s": 0.0}
                running: dict[str, int] = {}
                if len(batches) <= 1:  # decoded while the engine serves, written in one pause
                    first = await self._prepare(patch, batches[0] if batches else [], aid,
                                                running, timing)
                    stats = await self._write(m, aid, _once(first), fb_new)
                else:  # bounded memory: each batch gathered, decoded and written in the pause
                    stats = await self._write(m, aid, self._each(patch, batches, aid, running,
                                                                 timing), fb_new)
            finally:
                for r in readers:
                    r.close()
            changed = sum(c.count for b in batches for _, segs, _ in b for _, c in segs)
            stats.update(version=m.version, changed=changed, batches=len(batches), **timing,
                         total_s=time.perf_counter() - t_all, patch_bytes=m.patch_bytes)
            self.patch_bytes_total += m.patch_bytes
            self.last_apply = stats
            self.history.append(stats)
            if self.metrics is not None and self.gate is None:  # a gate reports its applies
                self.metrics.applied(m.version, stats["pause_s"], m.patch_bytes)
            return stats

    def _check(self, patch, m: Manifest) -> tuple[list[Any], list[Any]]:
        """Everything the header alone can prove, before any payload is decoded: the patch is
        this run's base -> `m.version`, produces the manifest's fingerprints and both digests,
        and every entry's dtype, shape and base fingerprint are the engine's (so the declared
        element counts are the model's, never more). Returns the entries to place on the ranks
        and those to load through the engine's loader."""
        h = patch.header
        if self.version is None:
            raise EngineStateError("the engine holds no verified version")
        check_compatible(h, self.shapes.keys(), run=self.run, base_version=self.version)
        if h.base_version is None or h.target_version != m.version or h.run != m.run:
            raise PatchError(f"patch file is not {m.run} v{h.base_version}->v{m.version}")
        target = {t.name: fpr.parse(t.target_fp) for t in h.tensors if t.target_fp}
        if target != m.fingerprints:
            raise PatchError(f"patch does not produce the fingerprints of {m.run} v{m.version}")
        rows = [(n, dt, tuple(s), self.fps[n]) for n, (s, dt) in self.shapes.items()]
        check_digests(h, rows, [(n, dt, tuple(s), target[n]) for n, (s, dt) in
                                self.shapes.items()])
        placed, fb = [], []
        for e in h.tensors:
            if e.kind == "removed" or e.base_fp is None or e.name not in self.shapes:
                raise PatchError(f"{e.name}: a structural change (added/removed tensor) needs a "
                                 "snapshot, not an in-place patch")
            shape, dt = self.shapes[e.name]
            if e.dtype != dt or tuple(e.shape) != tuple(shape):
                raise PatchError(f"{e.name}: patch is for {e.dtype}{e.shape}, the engine holds "
                                 f"{dt}{list(shape)}")
            if fpr.parse(e.base_fp) != self.fps[e.name]:
                raise PatchError(f"{e.name}: patch base fingerprint {e.base_fp} is not the "
                                 f"engine's {fpr.fmt(self.fps[e.name])} (wrong base version?)")
            if e.name in self.fallback:
                fb.append(e)
            elif e.name not in self.unheld and e.changed:  # unheld: nothing to gather or write
                placed.append(e)
        return placed, fb

    def _batches(self, patch, entries) -> list[list[tuple[Any, list[tuple[Any, Any]], bool]]]:
        """Entries' chunks grouped so that a batch decodes at most `apply_memory` bytes
        (APPLY_BYTES_PER_ELEMENT per changed element); a tensor may span batches."""
        limit = max(1, self.apply_memory // APPLY_BYTES_PER_ELEMENT)
        batches: list[list[tuple[Any, list[tuple[Any, Any]], bool]]] = []
        cur: list[tuple[Any, list[tuple[Any, Any]], bool]] = []
        n = 0
        for e in entries:
            segs: list[tuple[Any, Any]] = []
            for reader, c in chunk_list(patch, e):
                if c.count > limit:
                    raise PatchError(f"{e.name}: a chunk of {c.count:,} changed elements is over "
                                     f"this engine's apply budget ({limit:,} elements, "
                                     f"STITCH_APPLY_MEMORY={self.apply_memory})")
                if n + c.count > limit:
                    if segs:
                        cur.append((e, segs, False))
                        segs = []
                    batches.append(cur)
                    cur, n = [], 0
                segs.append((reader, c))
                n += c.count
            if segs:
                cur.append((e, segs, True))  # the tensor's last chunk is in this batch
        if cur:
            batches.append(cur)
        return batches

    async def _prepare(self, patch, batch, aid: str, running: dict[str, int],
                       timing: dict[str, float]) -> dict[str, np.ndarray]:
        """One batch: decode its positions, gather the old bits from the ranks, decode and check
        the new values. The new bits per tensor, in position order."""
        plan = await asyncio.to_thread(self._positions, batch)
        t_g = time.perf_counter()
        gathered: list[rpc.GatherReply] = await self._call(rpc.Gather(aid, {
            n: p.numpy().astype(index_dtype(int(np.prod(self.shapes[n][0]))))
            for n, (p, _) in plan.items()}))
        timing["gather_s"] += time.perf_counter() - t_g
        timing["gather_rank_s"] += max((g.seconds for g in gathered), default=0.0)
        return await asyncio.to_thread(self._decode, plan, gathered, running)

    async def _each(self, patch, batches, aid: str, running: dict[str, int],
                    timing: dict[str, float]) -> AsyncIterator[dict[str, np.ndarray]]:
        for batch in batches:
            yield await self._prepare(patch, batch, aid, running, timing)

    def _positions(self, batch) -> dict[str, Any]:
        plan: dict[str, Any] = {}
        for e, segs, last in batch:
            chunks, pos = [], []
            for reader, c in segs:
                pb, vb = reader.read_chunk(c)
                try:
                    p = codec.decode_positions(c.pos, pb, c.start, c.stop, c.count)
                except codec.CodecError as err:
                    raise PatchError(f"{e.name}: corrupt patch data: {err}") from None
                chunks.append((c, vb, len(p)))
                pos.append(p)
            plan[e.name] = (torch.from_numpy(np.concatenate(pos)), (e, chunks, last))
        return plan

    def _decode(self, plan, gathered: list[rpc.GatherReply], running: dict[str, int]
                ) -> dict[str, np.ndarray]:
        """New bits of a batch; each tensor's fingerprint is carried in `running` across
        batches and checked against its target once its last chunk is decoded."""
        new: dict[str, np.ndarray] = {}
        for name, (pos, (e, chunks, last)) in plan.items():
            dt = dtypes.info(e.dtype)
            old = torch.empty(pos.numel(), dtype=dt.int_dtype)
            held = torch.zeros(pos.numel(), dtype=torch.bool)
            for g in gathered:
                h_ = g.old[name]
                bits = torch.from_numpy(np.ascontiguousarray(h_.bits).reshape(-1)).view(
                    dt.int_dtype)
                idx = (torch.arange(pos.numel()) if h_.index is None
                       else torch.from_numpy(h_.index.astype(np.int64)))
                old[idx] = bits
                held[idx] = True
            if not bool(held.all()):
                raise EngineStateError(f"{name}: {int((~held).sum())} changed positions are held "
                                       "by no rank (layout incomplete)")
            got = running.get(name, self.fps[name])
            out, s = [], 0
            for c, vb, k in chunks:
                p, o = pos[s:s + k], old[s:s + k].to(torch.int64)
                s += k
                v = decode_chunk(name, c, vb, o, dt, torch.device("cpu"))
                got = fpr.update(got, name, p, o, v, dt.itemsize)
                out.append(v.to(dt.int_dtype))
            running[name] = got
            if last and fpr.fmt(got) != e.target_fp:
                raise PatchError(f"{name}: result fingerprint {fpr.fmt(got)} != {e.target_fp} "
                                 "(corrupt patch?)")
            new[name] = torch.cat(out).numpy()
        return new

    def _decode_fallback(self, patch, entries) -> dict[str, torch.Tensor]:
        """Whole tensors for the engine's loader (loader fallback; outside the memory budget),
        verified by apply_entry against their target fingerprints."""
        return {e.name: apply_entry(patch, e, self.fallback[e.name], base_fp=self.fps[e.name])
                for e in entries}

    async def _write(self, m: Manifest, aid: str,
                     batches: AsyncIterator[dict[str, np.ndarray]],
                     fb_new: dict[str, torch.Tensor]) -> dict[str, Any]:
        gate_cm = self.gate.applying(m.version) if self.gate is not None else _NoGate()
        async with gate_cm as handle:
            t0 = time.perf_counter()
            if self.pause is not None:
                await self.pause()
            t_w = time.perf_counter()
            replies: list[rpc.WriteReply] = []
            proven = True
            try:
                try:  # a transaction across ranks: any failure from here on is undone everywhere
                    deltas: dict[str, int] = {}
                    async for new in batches:  # one batch, or bounded ones (same apply id)
                        batch_replies = await self._call(rpc.Write(aid, new))
                        for name in new:
                            deltas[name] = (deltas.get(name, 0)
                                            + sum(r.delta[name] for r in batch_replies))
                        replies.extend(batch_replies)
                    for name, got in deltas.items():
                        want = (self.mult[name] * (m.fingerprints[name] - self.fps[name])) \
                            & fpr.MASK64
                        if got & fpr.MASK64 != want:
                            raise EngineStateError(
                                f"{name}: ranks wrote a change that does not add up to the "
                                "manifest's (layout bug?); undone")
                    if fb_new:
                        await self._call(rpc.Load({
                            n: (dtypes.info(t.dtype).name, tuple(t.shape),
                                dtypes.int_view(t).reshape(-1).numpy())
                            for n, t in fb_new.items()}))
                except BaseException as e:
                    try:
                        await self._abort(aid, m.version, e)  # steps still held
                    except EngineStateError:
                        proven = False  # not even the old version: steps stay held
                        raise
                    raise
                write_s = time.perf_counter() - t_w
                self.fps = dict(m.fingerprints)
                self.fallback.update(fb_new)
                handle.commit(m.patch_bytes)
                await self._after(m.version)
            finally:
                await self._resume(proven)
            pause_s = time.perf_counter() - t0
        self._set_version(m.version)  # proven by the ranks' read-back deltas
        try:
            await self._call(rpc.Commit(aid))  # drops the ranks' undo logs; outside the pause
        except Exception as e:  # noqa: BLE001 - a rank may be gone: prove what is there
            log.error("stitch: commit of v%d failed (%s); checking every rank", m.version, e)
            check = await self._verify_unlocked()
            if not check["ok"]:
                raise EngineStateError(f"v{m.version}: commit failed and the weights could not "
                                       "be proven afterwards") from e
        return {"write_s": write_s, "pause_s": pause_s,
                "write_rank_s": max((r.seconds for r in replies), default=0.0)}

    async def load_snapshot(self, m: Manifest, snap_dir: Path) -> None:
        """Load a whole version through the engine's loader, then prove it."""
        async with self._lock:
            files = sorted(str(p) for p in Path(snap_dir).glob("*.safetensors"))
            want = m.fingerprints
            if set(want) != set(self.shapes):
                raise PatchError(f"snapshot v{m.version} has other tensors than the engine")
            gate_cm = self.gate.applying(m.version) if self.gate is not None else _NoGate()
            async with gate_cm as handle:
                if self.pause is not None:
                    await self.pause()
                bad: list[str] = ["the load did not finish"]
                try:
                    try:  # a load has no undo: once it started, only a proof may serve again
                        await self._call(rpc.LoadFiles(files), self.load_timeout)
                        replies: list[rpc.SumsReply] = await self._call(rpc.Sums())
                        bad = self._mismatched(replies, want)
                    except Exception as e:  # noqa: BLE001 - a rank failed or hung mid-load
                        bad = [f"{type(e).__name__}: {e}"]
                    if bad:
                        self._set_version(None)
                        self.check = {"ok": False, "at": time.time(), "kind": "snapshot",
                                      "mismatched": bad[:20]}
                        self.last_abort = {"version": m.version, "error": bad[0],
                                           "undone": False, "snapshot": True, "at": time.time()}
                        raise EngineStateError(
                            f"v{m.version} loaded but {len(bad)} tensors do not verify: {bad[:3]}")
                    if self.fallback:
                        self.fallback = await asyncio.to_thread(
                            _load_host, Path(snap_dir), set(self.fallback))
                    self.fps = dict(want)
                    handle.commit()
                    await self._after(m.version)
                finally:
                    await self._resume(not bad)
            self.check = {"ok": True, "at": time.time(), "kind": "snapshot",
                          "tensors": len(self.mult), "fallback": len(self.fallback)}
            self._set_version(m.version)

    async def _after(self, version: int) -> None:
        if self.after_apply is not None:
            try:
                await self.after_apply(version)
            except Exception as e:  # e.g. a prefix cache that cannot be reset while busy
                log.debug("after_apply hook: %s", e)

    async def verify(self) -> dict[str, Any]:
        """Recompute every rank's full sums and compare with the held version's fingerprints;
        a failed check (or ranks that cannot answer) stops serving. The check's record."""
        async with self._lock:
            return await self._verify_unlocked()

    async def _verify_unlocked(self) -> dict[str, Any]:
        if not self.ranks:  # start() has not learned the layouts yet: nothing to check
            return {"ok": None, "error": "the engine is still starting (layouts not learned)"}
        t0 = time.perf_counter()
        try:
            replies: list[rpc.SumsReply] = await self._call(rpc.Sums(sorted(self.mult)))
            stale = _stale(replies)  # kernels' copies not rebuilt from the weights there now
            bad = self._mismatched(replies, self.fps)
        except Exception as e:  # noqa: BLE001 - ranks that cannot answer prove nothing
            stale, bad = [], [f"{type(e).__name__}: {e}"]
        self.check = {"ok": not bad, "at": time.time(), "kind": "full",
                      "tensors": len(self.mult), "mismatched": bad[:20],
                      "derived_copies": sum(self.derived_copies.values()),
                      "stale_derived": stale[:20], "seconds": time.perf_counter() - t0}
        if bad:
            log.error("stitch: full check of v%s failed for %d tensors (%s); not serving",
                      self.version, len(bad), ", ".join(bad[:5]))
            self._set_version(None)
        return self.check


async def _once(item: dict[str, np.ndarray]) -> AsyncIterator[dict[str, np.ndarray]]:
    yield item


def _stale(replies) -> list[str]:
    """Derived copies any rank reports stale, as 'rank R: module (kind)'."""
    return [f"rank {i}: {name}" for i, r in enumerate(replies)
            for name in r.stale_derived]


def _merge_counts(counts) -> dict[str, int]:
    out: dict[str, int] = {}
    for c in counts:
        for k, v in c.items():
            out[k] = out.get(k, 0) + int(v)
    return dict(sorted(out.items()))


class _NoGate:
    class _H:
        def commit(self, patch_bytes: int | None = None) -> None:
            pass

    async def __aenter__(self):
        return self._H()

    async def __aexit__(self, *exc) -> bool:
        return False

