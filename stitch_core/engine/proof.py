"""Proof of what an engine's ranks hold: the fingerprints of every copy on every rank, checked
against a manifest at start-up and on demand.

`HeldState` is the proof side of `stitch_core.engine.coordinator.Coordinator` (which adds the
apply transaction on top): it reaches a `stitch_core.engine.replica.RankReplica` in every
tensor-parallel rank through the adapter's `rpc(request) -> [reply per rank]`, records the
version the ranks are proven to hold in the `stitch_core.versions.served.ServedVersion` it is
built with (`served`, shared with the follower and the gate; `version` reads it back), and keeps
the fingerprints of that version (`fps`) with what the proof learned of their layout: the copies
of each tensor across ranks (`mult`), tensors the layout does not place exactly (`fallback`),
tensors no rank holds (`unheld`), and engine parameters no loader writes (`derived`).

Start-up: the ranks learn their layout from the model's own loaders and report full sums; a
tensor whose sums do not add up to multiplicity x its manifest fingerprint is not placed exactly
by the layout (a loader or post-load step that transforms values). So is an engine parameter that
no loader writes (computed from other weights after loading, e.g. MLA's absorbed matrices): a
patch could not keep it in step. Either refuses the start, naming them, unless the loader
fallback is opted into: then a transformed tensor goes through the engine's own loader with the
reconstructed tensor (kept on the host here), unverified, and both are logged by name.

`verify` recomputes every rank's full sums; whatever cannot be proven stops serving (`served` is
cleared, so the gate answers not_ready) until a version is proven again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from stitch_core.engine import rpc
from stitch_core.engine.layout import read_safetensors_shapes
from stitch_core.errors import StitchError
from stitch_core.format import dtypes
from stitch_core.format import fingerprint as fpr
from stitch_core.format.checkpoint import open_checkpoint
from stitch_core.settings import LOAD_TIMEOUT, RPC_TIMEOUT
from stitch_core.versions.manifest import PULLED_MANIFEST, Manifest
from stitch_core.versions.served import ServedVersion
from stitch_core.versions.store import RefusedVersionError, check_signed
from stitch_core.versions.trust import TrustSet

log = logging.getLogger("stitch.engine")
# the adapter's transport: one typed request to every rank, one reply per rank (rank order)
Rpc = Callable[[rpc.Request], Awaitable[list[Any]]]


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


def load_host(model_dir: Path, names: set[str]) -> dict[str, torch.Tensor]:
    """The tensors `names` of the checkpoint in `model_dir`, on the host (loader fallback)."""
    ck = open_checkpoint(model_dir)
    return {n: ck.load(n) for n in ck.names() if n in names}


class HeldState:
    """The version an engine's ranks are proven to hold, and the proof: start-up and full checks
    over rank RPCs."""

    def __init__(self, rpc: Rpc, *, served: ServedVersion, run: str | None = None,
                 loader_fallback: bool = False, rpc_timeout: float | None = RPC_TIMEOUT,
                 load_timeout: float | None = LOAD_TIMEOUT):
        self.rpc = rpc
        # every rank RPC is bounded: a hung rank fails the apply (then undone and proven, or
        # the engine stops serving) instead of holding the engine forever
        self.rpc_timeout = rpc_timeout
        self.load_timeout = load_timeout  # start-up layout learning and snapshot loads
        # tensors the layout map does not place exactly: refuse (default), or update them through
        # the engine's own loader, which nothing can read back to verify
        self.loader_fallback = loader_fallback
        self.run = run
        self.served = served
        self.fps: dict[str, int] = {}  # verified fingerprints of the version the engine holds
        self.shapes: dict[str, tuple[tuple[int, ...], str]] = {}
        self.mult: dict[str, int] = {}  # copies of each element across all ranks
        self.fallback: dict[str, torch.Tensor] = {}  # tensors applied through the engine loader
        self.unheld: list[str] = []  # tensors no rank holds any element of (e.g. a tied lm_head)
        self.derived: list[str] = []  # engine params no loader writes (computed after loading)
        self.derived_copies: dict[str, int] = {}  # kernels' copies kept in step, by kind
        self.kernels: dict[str, str] = {}  # kernels of quantized layers, by format (the ranks')
        self.ranks = 0
        self.layout_cached = False  # every rank's layout came from its layout cache
        self.layout_templated = 0  # layer groups that took a learned twin's map, over all ranks
        self.check: dict[str, Any] = {"ok": None}
        # one proof or apply at a time (held by verify, and by the coordinator's apply and load)
        self.lock = asyncio.Lock()

    @property
    def version(self) -> int | None:
        """The version the ranks are proven to hold (None: none), as recorded in `served`."""
        return self.served.version

    async def call_ranks(self, req: rpc.Request, timeout: float | None = None) -> list[Any]:
        """`rpc(req)` on every rank, bounded by `timeout` (default `rpc_timeout`; EngineStateError
        when it runs out)."""
        limit = timeout if timeout is not None else self.rpc_timeout
        try:
            return await asyncio.wait_for(self.rpc(req), limit)
        except TimeoutError:
            raise EngineStateError(f"{type(req).__name__}: no answer from every rank in "
                                   f"{limit:g} s") from None

    def mismatched(self, replies: list[rpc.SumsReply], fps: dict[str, int]) -> list[str]:
        """Tensors whose summed per-copy fingerprints differ from `fps`, and stale copies."""
        return [n for n, k in self.mult.items()
                if sum(r.sums[n] for r in replies) & fpr.MASK64 != (k * fps[n]) & fpr.MASK64
                ] + _stale(replies)

    def stop_serving(self, reason: str) -> None:
        """Hold no version from now on (requests get not_ready) until one is proven again."""
        log.error("stitch: %s; not serving v%s any more", reason, self.version)
        self.check = {"ok": False, "at": time.time(), "kind": "stopped", "reason": reason}
        self.served.clear()

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
            except RefusedVersionError as e:
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
        replies: list[rpc.SetupReply] = await self.call_ranks(rpc.Setup(self.shapes),
                                                         self.load_timeout)
        self.ranks = len(replies)
        placed, fallback, self.unheld = self._classify(replies, want)
        if any(r.cached or r.templated for r in replies) and (
                fallback or _stale(replies) or any(r.derived or r.unmanaged for r in replies)):
            # a cached or templated layout is never trusted: learn it again through every
            # loader, prove again
            log.warning("stitch: the %s layout did not prove the weights (%d tensors); "
                        "learning it again through every loader",
                        "cached" if any(r.cached for r in replies) else "templated",
                        len(fallback))
            replies = await self.call_ranks(rpc.Setup(self.shapes, use_cache=False),
                                            self.load_timeout)
            self.mult.clear()
            placed, fallback, self.unheld = self._classify(replies, want)
        self.layout_cached = all(r.cached for r in replies)
        self.layout_templated = sum(r.templated for r in replies)
        self.derived = sorted({p for r in replies for p in r.derived}
                              | {a for r in replies for a in r.unmanaged})
        self.derived_copies = _merge_counts(r.derived_copies for r in replies)
        # which kernels serve quantized layers, as the ranks name them ({"fp8": "vllm:..."})
        self.kernels = {k: v for r in replies for k, v in (r.rank.get("kernels") or {}).items()}
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
            host = await asyncio.to_thread(load_host, model_dir, set(fallback))
            bad = [n for n in fallback if n not in host or fpr.fingerprint(n, host[n]) != want[n]]
            if bad:
                raise EngineStateError(f"snapshot files do not match their fingerprints: {bad[:5]}")
            self.fallback = host
            log.warning("stitch: %d tensors are not placed exactly by the layout map and will be "
                        "updated through the engine's own loader: %s", len(fallback),
                        ", ".join(sorted(fallback)))
        self.fps = dict(want)
        self.check = {"ok": True, "at": time.time(), "kind": "full", "tensors": len(placed),
                      "fallback": len(fallback), "seconds": time.perf_counter() - t0,
                      # start-up: the slowest rank's layout (learned or read from its cache)
                      "layout_s": max(r.learn_s for r in replies),
                      "layout_cached": self.layout_cached,
                      "layout_templated": self.layout_templated,
                      # learned: the most transient bytes on one rank, and the groups some rank
                      # loaded with the full HF-shaped index (`layout_load`)
                      "layout_bytes": max(r.learn_bytes for r in replies),
                      "layout_full_index": sorted({g for r in replies
                                                   for g in r.full_index_groups})}
        if m is not None:
            self.served.set(m.version)
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

    # ------------------------------------------------------------ full check

    async def verify(self) -> dict[str, Any]:
        """Recompute every rank's full sums and compare with the held version's fingerprints;
        a failed check (or ranks that cannot answer) stops serving. The check's record."""
        async with self.lock:
            return await self.recheck()

    async def recheck(self) -> dict[str, Any]:
        """`verify` for a caller that holds `lock` already (e.g. after a failed commit)."""
        if not self.ranks:  # start() has not learned the layouts yet: nothing to check
            return {"ok": None, "error": "the engine is still starting (layouts not learned)"}
        t0 = time.perf_counter()
        try:
            replies: list[rpc.SumsReply] = await self.call_ranks(rpc.Sums(sorted(self.mult)))
            stale = _stale(replies)  # kernels' copies not rebuilt from the weights there now
            bad = self.mismatched(replies, self.fps)
        except Exception as e:  # noqa: BLE001 - ranks that cannot answer prove nothing
            stale, bad = [], [f"{type(e).__name__}: {e}"]
        self.check = {"ok": not bad, "at": time.time(), "kind": "full",
                      "tensors": len(self.mult), "mismatched": bad[:20],
                      "derived_copies": sum(self.derived_copies.values()),
                      "stale_derived": stale[:20], "seconds": time.perf_counter() - t0}
        if bad:
            log.error("stitch: full check of v%s failed for %d tensors (%s); not serving",
                      self.version, len(bad), ", ".join(bad[:5]))
            self.served.clear()
        return self.check


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


