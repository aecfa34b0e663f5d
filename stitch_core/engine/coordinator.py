"""The node side of an engine follower: decode each patch once, drive every rank, prove the result.

Size: about 490 lines, one job: one apply is one transaction (check, gather, decode, write,
prove, commit or undo); splitting its steps over modules would hide the order that makes it
safe.

Engine-agnostic: an adapter gives it `rpc(method, payload) -> [reply per rank]` reaching a
`stitch_core.engine.replica.RankReplica` in every tensor-parallel rank, plus optional
`pause`/`resume`
(hold engine steps) and `after_apply(version)` (called while steps are still held, right after a
version is in place: reset the prefix cache, tell the engine its weight version) hooks. It is the
apply target (`stitch_core.versions.ports.ApplyTarget`) of a
`stitch_core.versions.follower.Follower`. What the ranks hold, and its proof (start-up check,
`verify`), is `stitch_core.engine.proof.HeldState`, which `Coordinator` extends with the apply
transaction here. Each weight mutation runs inside the apply gate it is built with
(`stitch_core.engine.ports.ApplyGate`: the node's `VersionGate`, or, with no requests to gate, a
bare `ServedVersion`); its commit is what moves the served version.

Why the coordinator, not every rank, decodes: ULP values are entropy-coded under contexts taken
from the *old* value of each element, so a rank holding a slice of a tensor cannot decode a chunk
alone. The coordinator decodes positions, gathers the old bits from the ranks that hold them,
decodes the values once (while the engine keeps serving), and checks the result against the
manifest *before* anything is written: base fingerprint + sum of h(new) - h(old) must equal the
target fingerprint of every tensor, and both version digests must match. A corrupt, truncated,
foreign or out-of-order patch is refused there, with the engine untouched. Only then are the
ranks asked to write (engine steps held); each rank reads back what it wrote and reports its
fingerprint delta over every copy it holds, and the sum over ranks must equal multiplicity x the
change in the manifest fingerprint, or every rank undoes."""

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
from stitch_core.engine.decode import Batch, BatchDecoder, split_batches
from stitch_core.engine.ports import ApplyGate
from stitch_core.engine.proof import EngineStateError, HeldState, Rpc, load_host
from stitch_core.engine.rpc import index_dtype
from stitch_core.format import dtypes
from stitch_core.format import fingerprint as fpr
from stitch_core.format.patch import (
    PatchSet,
    apply_entry,
    check_compatible,
    check_digests,
)
from stitch_core.format.stp import PatchError, PatchReader
from stitch_core.settings import (
    APPLY_MEMORY,
    DECODE_THREADS,
    LOAD_TIMEOUT,
    RPC_TIMEOUT,
    STAGE_MEMORY,
)
from stitch_core.versions import verified
from stitch_core.versions.manifest import Manifest
from stitch_core.versions.served import ServedVersion
from stitch_core.versions.store import Step

log = logging.getLogger("stitch.engine")
# transient bytes the API server holds per changed element while it decodes a batch (positions,
# old and new bits at int64 and at the tensor's width, the ranks' replies, the RPC copies)
APPLY_BYTES_PER_ELEMENT = 48
DEFAULT_APPLY_MEMORY = APPLY_MEMORY  # decoded per batch at most (a patch of any size)
# what a rank holds per changed element between an apply's gather and its write (engine and HF
# positions, the selection of its share, old and new bits: 8+8+8+4+4, at most); an apply over the
# batch budget stages all its batches on the ranks ahead of the pause if the whole version fits
# the rank-side budget at this rate (a rank holding every changed element: TP=1)
STAGE_BYTES_PER_ELEMENT = 32
PREBUILD_POLL = 0.02  # seconds between two asks whether the ranks' builds ahead are done
Hook = Callable[[], Awaitable[Any]]
VersionHook = Callable[[int], Awaitable[Any]]


class Coordinator(HeldState):
    """Drives one engine's ranks through start-up and each apply, and proves the result."""

    def __init__(self, rpc: Rpc, *, run: str | None = None, gate: ApplyGate | None = None,
                 pause: Hook | None = None, resume: Hook | None = None,
                 after_apply: VersionHook | None = None, loader_fallback: bool = False,
                 rpc_timeout: float | None = RPC_TIMEOUT, load_timeout: float | None = LOAD_TIMEOUT,
                 apply_memory: int = DEFAULT_APPLY_MEMORY,
                 stage_memory: int = STAGE_MEMORY,
                 decode_threads: int = DECODE_THREADS):
        """`gate`: what every apply runs through, and whose served version it records (None: a
        new `ServedVersion`, for a coordinator with no requests to gate)."""
        self.gate: ApplyGate = gate if gate is not None else ServedVersion()
        super().__init__(rpc, served=self.gate.served, run=run,
                         loader_fallback=loader_fallback, rpc_timeout=rpc_timeout,
                         load_timeout=load_timeout)
        # bytes an apply decodes at a time: a patch over it is applied in batches (one
        # transaction, one undo), each decoded and staged on the ranks before the pause if the
        # version fits `stage_memory` per rank, else gathered, decoded and written in the pause
        # after the first
        self.apply_memory = int(apply_memory)
        self.stage_memory = int(stage_memory)
        self.decoder = BatchDecoder(decode_threads)  # a batch's chunks decode on its threads
        self.pause, self.resume, self.after_apply = pause, resume, after_apply
        self.last_apply: dict[str, Any] | None = None
        # the last apply or load that failed once a rank may have written: undone and proven?
        self.last_abort: dict[str, Any] | None = None
        self.patch_bytes_total = 0
        self.history: list[dict[str, Any]] = []
        # engine steps left held after a failed apply or load whose weights could not be proven:
        # requests already admitted stay frozen (never served from those weights) until a
        # snapshot load is proven and resumes them
        self.steps_held = False

    async def _abort(self, aid: str, version: int, err: BaseException) -> None:
        """An apply of `version` failed once a rank may have written: undo it on every rank and
        prove the version held before. If that cannot be proven (a rank gone, hung or holding
        other bits), stop serving: nothing unproven is ever served (new requests get not_ready,
        engine steps stay held, see `_resume`), and the follower reloads a snapshot through the
        verified path (it reads the held version, None, from here)."""
        try:
            await self.call_ranks(rpc.Undo(aid))
            bad = self.mismatched(await self.call_ranks(rpc.Sums(sorted(self.mult))), self.fps)
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
        self.served.clear()
        raise EngineStateError(f"v{version} failed and the engine's weights could not be proven "
                               f"afterwards: {bad[0]}") from err

    # ------------------------------------------------------------ status

    def status(self) -> dict[str, Any]:
        return {"fingerprint_check": self.check, "last_apply": self.last_apply,
                "last_abort": self.last_abort,
                "patch_bytes_total": self.patch_bytes_total, "ranks": self.ranks,
                "fallback_tensors": sorted(self.fallback), "unheld_tensors": self.unheld,
                "derived_params": self.derived, "derived_copies": self.derived_copies,
                "kernels": self.kernels, "fp8_kernel": self.kernels.get("fp8"),
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

    # ------------------------------------------------------------ following

    async def __call__(self, step: Step, path: Path) -> None:
        """The Follower's apply callback."""
        if step.kind == "snapshot":
            await self.load_snapshot(step.manifest, path)
        else:
            await self.apply_patch(step.manifest, step.patch_parts or [path])

    async def apply_patch(self, m: Manifest, paths: list[Path]) -> dict[str, Any]:
        async with self.lock:
            t_all = time.perf_counter()
            refs = m.patches if len(m.patches) == len(paths) else [None] * len(paths)
            readers: list[PatchReader] = []
            try:
                for p, r in zip(paths, refs, strict=True):
                    sha = r.sha256 if r else None
                    readers.append(PatchReader(p, sha256=sha, verified=verified.identity(p, sha)))
                patch = (readers[0] if len(readers) == 1 and readers[0].header.part is None
                         else PatchSet(readers))
                placed, fallback = await asyncio.to_thread(self._check, patch, m)
                batches = self._batches(patch, placed)
                changed = sum(c.count for b in batches for _, segs, _ in b for _, c in segs)
                expect = {e.name for b in batches for e, _, _ in b}
                fb_new = await asyncio.to_thread(self._decode_fallback, patch, fallback)
                timing = {"gather_s": 0.0, "gather_rank_s": 0.0, "prebuild_s": 0.0, "prebuilt": 0,
                          "staged_batches": 0}
                aid, feed = await self._ahead(patch, batches, changed, timing)
                stats = await self._write(m, aid, feed, expect, fb_new)
            finally:
                for r in readers:
                    r.close()
            stats.update(version=m.version, changed=changed, batches=len(batches), **timing,
                         total_s=time.perf_counter() - t_all, patch_bytes=m.patch_bytes)
            self.patch_bytes_total += m.patch_bytes
            self.last_apply = stats
            self.history.append(stats)
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

    def _batches(self, patch, entries) -> list[Batch]:
        """Batches of at most `apply_memory` bytes (APPLY_BYTES_PER_ELEMENT per element)."""
        return split_batches(patch, entries, max(1, self.apply_memory // APPLY_BYTES_PER_ELEMENT),
                             f"STITCH_APPLY_MEMORY={self.apply_memory}")

    async def _prepare(self, patch, batch, aid: str, running: dict[str, int],
                       timing: dict[str, float], index: int = 0) -> dict[str, np.ndarray]:
        """Batch `index`: decode its positions, gather the old bits from the ranks, decode and
        check the new values. The new bits per tensor, in position order."""
        plan = await asyncio.to_thread(self.decoder.positions, batch)
        t_g = time.perf_counter()
        gathered: list[rpc.GatherReply] = await self.call_ranks(rpc.Gather(aid, {
            n: p.numpy().astype(index_dtype(int(np.prod(self.shapes[n][0]))))
            for n, (p, _) in plan.items()}, index))
        timing["gather_s"] += time.perf_counter() - t_g
        timing["gather_rank_s"] += max((g.seconds for g in gathered), default=0.0)
        return await asyncio.to_thread(self.decoder.values, plan, gathered, running, self.fps)

    async def _ahead(self, patch, batches, changed: int, timing: dict[str, Any],
                     ) -> tuple[str, AsyncIterator[tuple[dict[str, np.ndarray], bool, bool, int]]]:
        """Everything before the pause, while the engine serves: the first batch (a patch
        within the apply memory: all of it) gathered, decoded and checked, its bits staged on
        the ranks (and the kernels' copies they change built there); over the apply memory,
        every batch in turn if the version fits the stage memory. The apply's id and what the
        pause writes. A failure (a corrupt batch) has the ranks forget what they hold of it."""
        aid, running = uuid.uuid4().hex, {}
        try:
            first = await self._prepare(patch, batches[0] if batches else [], aid, running,
                                        timing)
            if len(batches) == 1:
                if await self._prebuild(aid, first, timing):
                    timing["staged_batches"] = 1
                    return aid, self._staged()
            elif len(batches) > 1 and changed * STAGE_BYTES_PER_ELEMENT <= self.stage_memory:
                if await self._stage(patch, batches, first, aid, running, timing):
                    timing["staged_batches"] = len(batches)
                    return aid, self._staged()
                await self._forget(aid)  # a rank could not stage: the later batches in the pause
                aid, running = uuid.uuid4().hex, {}
                first = await self._prepare(patch, batches[0], aid, running, timing)
            return aid, self._each(patch, batches, first, aid, running, timing)
        except BaseException:
            await self._forget(aid)
            raise

    async def _forget(self, aid: str) -> None:
        """Have the ranks drop an apply nothing was written of (its plans, staged bits and
        builds ahead: up to `stage_memory` each); best effort, a new apply drops them too."""
        try:
            await self.call_ranks(rpc.Commit(aid))
        except Exception as e:  # noqa: BLE001 - the next apply's gather drops them anyway
            log.debug("stitch: dropping apply %s on the ranks: %s", aid, e)

    async def _stage(self, patch, batches, first: dict[str, np.ndarray], aid: str,
                     running: dict[str, int], timing: dict[str, Any]) -> bool:
        """Decode every batch while the engine serves, each one's bits staged on the ranks before
        the next is gathered (this process holds one batch at a time; the ranks hold every
        batch's plan and bits until the write), the last with the kernels' copies built ahead.
        A corrupt batch raises (nothing written); False if a rank could not stage a batch."""
        values = first
        for i in range(1, len(batches)):
            try:
                await self.call_ranks(rpc.Prebuild(aid, values, i - 1, False))
            except Exception as e:  # noqa: BLE001 - the in-pause batches are the fallback
                log.warning("stitch: staging batch %d of %d failed (%s); the later batches are "
                            "decoded in the pause", i, len(batches), e)
                return False
            values = await self._prepare(patch, batches[i], aid, running, timing, i)
        return await self._prebuild(aid, values, timing, len(batches) - 1)

    async def _prebuild(self, aid: str, values: dict[str, np.ndarray],
                        timing: dict[str, Any], batch: int = 0) -> bool:
        """Stage the write's bits on the ranks while the engine still serves, so that the write
        in the pause carries none, and have them build the kernels' copies of weights those bits
        change (`stitch_core.engine.prebuild`); wait until they have: the pause then installs
        them instead of rebuilding them. Never fails the apply: False (the write carries the bits)
        if a rank could not stage them; a copy not built in time is rebuilt in the pause."""
        t0 = time.perf_counter()
        try:
            replies: list[rpc.PrebuildReply] = await self.call_ranks(
                rpc.Prebuild(aid, values, batch))
            while not all(r.done for r in replies):
                if time.perf_counter() - t0 > (self.rpc_timeout or 60.0):
                    log.warning("stitch: copies built ahead not ready in %.0f s; the pause "
                                "rebuilds the rest", time.perf_counter() - t0)
                    break
                await asyncio.sleep(PREBUILD_POLL)
                replies = await self.call_ranks(rpc.Prebuild(aid))
        except Exception as e:  # noqa: BLE001 - the in-pause rebuild is the fallback
            log.warning("stitch: staging the write failed (%s); it carries its bits and the "
                        "pause rebuilds", e)
            return False
        timing["prebuild_s"] = time.perf_counter() - t0
        timing["prebuilt"] = max((r.copies for r in replies), default=0)
        if timing["prebuilt"]:
            # the steps of the slowest rank's build (copy aside, write, the kernel's build, digest)
            slow = max(replies, key=lambda r: r.seconds)
            timing["prebuild_phases_s"] = dict(slow.phases)
            log.info("stitch: %d kernel copies of weights built ahead of the pause in %.2f s "
                     "(engine serving; %.0f MB of weights per rank at most; %s)",
                     timing["prebuilt"], timing["prebuild_s"],
                     max(r.nbytes for r in replies) / 1e6,
                     ", ".join(f"{k} {v:.2f} s" for k, v in slow.phases.items()) or "in progress")
        return True

    async def _each(self, patch, batches, first: dict[str, np.ndarray], aid: str,
                    running: dict[str, int], timing: dict[str, float],
                    ) -> AsyncIterator[tuple[dict[str, np.ndarray], bool, bool, int]]:
        """(new bits, last write, staged on the ranks, batch) per batch: the first decoded
        already, the others gathered and decoded here (inside the pause)."""
        yield first, len(batches) <= 1, False, 0
        for i in range(1, len(batches)):
            yield (await self._prepare(patch, batches[i], aid, running, timing, i),
                   i == len(batches) - 1, False, i)

    @staticmethod
    async def _staged() -> AsyncIterator[tuple[dict[str, np.ndarray], bool, bool, int]]:
        """One write of every batch staged on the ranks."""
        yield {}, True, True, 0

    def _decode_fallback(self, patch, entries) -> dict[str, torch.Tensor]:
        """Whole tensors for the engine's loader (loader fallback; outside the memory budget),
        verified by apply_entry against their target fingerprints."""
        return {e.name: apply_entry(patch, e, self.fallback[e.name], base_fp=self.fps[e.name])
                for e in entries}

    async def _write(self, m: Manifest, aid: str,
                     batches: AsyncIterator[tuple[dict[str, np.ndarray], bool, bool, int]],
                     expect: set[str], fb_new: dict[str, torch.Tensor]) -> dict[str, Any]:
        """Hold engine steps, write `batches` on every rank, and check that the ranks' read-back
        deltas of every tensor in `expect` (each one the patch changes) add up to the manifest's
        change; commit (the version is served) or undo everywhere."""
        async with self.gate.applying(m.version) as handle:
            t0 = time.perf_counter()
            if self.pause is not None:
                await self.pause()
            t_w = time.perf_counter()
            replies: list[rpc.WriteReply] = []
            proven = True
            try:
                try:  # a transaction across ranks: any failure from here on is undone everywhere
                    deltas: dict[str, int] = {}
                    rank_s = 0.0  # per batch the slowest rank, summed
                    async for new, last, staged, index in batches:  # all staged, or batches
                        batch_replies = await self.call_ranks(
                            rpc.Write(aid, {} if staged else new, last, staged, index))
                        for r in batch_replies:
                            for name, d in r.delta.items():
                                deltas[name] = deltas.get(name, 0) + d
                        replies.extend(batch_replies)
                        rank_s += max((r.seconds for r in batch_replies), default=0.0)
                    if not set(deltas) <= expect:
                        raise EngineStateError(
                            f"ranks wrote tensors the patch does not change: "
                            f"{sorted(set(deltas) - expect)[:5]}; undone")
                    target = m.fingerprints  # a dict built per access: once, not per tensor
                    for name in expect:
                        got = deltas.get(name, 0)
                        want = (self.mult[name] * (target[name] - self.fps[name])) & fpr.MASK64
                        if got & fpr.MASK64 != want:
                            raise EngineStateError(
                                f"{name}: ranks wrote a change that does not add up to the "
                                "manifest's (layout bug?); undone")
                    if fb_new:
                        await self.call_ranks(rpc.Load({
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
                handle.commit(m.patch_bytes)  # proven by the ranks' read-back deltas
                await self._after(m.version)
            finally:
                await self._resume(proven)
            pause_s = time.perf_counter() - t0
        # the gate's commit made m.version the served one
        try:
            await self.call_ranks(rpc.Commit(aid))  # drops the ranks' undo logs; outside the pause
        except Exception as e:  # noqa: BLE001 - a rank may be gone: prove what is there
            log.error("stitch: commit of v%d failed (%s); checking every rank", m.version, e)
            check = await self.recheck()
            if not check["ok"]:
                raise EngineStateError(f"v{m.version}: commit failed and the weights could not "
                                       "be proven afterwards") from e
        # derived copies (packed, re-quantized) rebuilt by the last batch: the slowest rank's
        return {"write_s": write_s, "pause_s": pause_s,
                "write_rank_s": rank_s,
                "derived_rebuilt": max((len(r.rebuilt) for r in replies), default=0),
                "derived_ahead": max((r.ahead for r in replies), default=0),
                "rebuild_rank_s": max((r.rebuild_s for r in replies), default=0.0)}

    async def load_snapshot(self, m: Manifest, snap_dir: Path) -> None:
        """Load a whole version through the engine's loader, then prove it."""
        async with self.lock:
            files = sorted(str(p) for p in Path(snap_dir).glob("*.safetensors"))
            want = m.fingerprints
            if set(want) != set(self.shapes):
                raise PatchError(f"snapshot v{m.version} has other tensors than the engine")
            async with self.gate.applying(m.version) as handle:
                if self.pause is not None:
                    await self.pause()
                bad: list[str] = ["the load did not finish"]
                try:
                    try:  # a load has no undo: once it started, only a proof may serve again
                        await self.call_ranks(rpc.LoadFiles(files), self.load_timeout)
                        replies: list[rpc.SumsReply] = await self.call_ranks(rpc.Sums())
                        bad = self.mismatched(replies, want)
                    except Exception as e:  # noqa: BLE001 - a rank failed or hung mid-load
                        bad = [f"{type(e).__name__}: {e}"]
                    if bad:
                        self.served.clear()
                        self.check = {"ok": False, "at": time.time(), "kind": "snapshot",
                                      "mismatched": bad[:20]}
                        self.last_abort = {"version": m.version, "error": bad[0],
                                           "undone": False, "snapshot": True, "at": time.time()}
                        raise EngineStateError(
                            f"v{m.version} loaded but {len(bad)} tensors do not verify: {bad[:3]}")
                    if self.fallback:
                        self.fallback = await asyncio.to_thread(
                            load_host, Path(snap_dir), set(self.fallback))
                    self.fps = dict(want)
                    self.check = {"ok": True, "at": time.time(), "kind": "snapshot",
                                  "tensors": len(self.mult), "fallback": len(self.fallback)}
                    handle.commit()
                    await self._after(m.version)
                finally:
                    await self._resume(not bad)

    async def _after(self, version: int) -> None:
        if self.after_apply is not None:
            try:
                await self.after_apply(version)
            except Exception as e:  # e.g. a prefix cache that cannot be reset while busy
                log.debug("after_apply hook: %s", e)

