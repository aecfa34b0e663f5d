"""Rank side of an in-place engine apply: gather old bits, write new bits, prove what was written.

Size: about 500 lines, one job: the rank side of the apply protocol (gather, write with
read-back, undo / commit, sums, whole-tensor loads) over one rank's layout; the bit helpers above
`RankReplica` exist only for its writes and sums.

One `RankReplica` lives next to the model in every tensor-parallel rank of an engine (a vLLM
worker, an SGLang TP process). It never decodes a patch: the node's coordinator
(`stitch_core.engine.coordinator`) decodes each patch once, and talks to the ranks in three calls:

1. `gather(id, positions)`: HF flat positions per tensor. The rank maps them through its layout
   (`stitch_core.engine.layout`), remembers where they live, and returns the old bits of those it
   holds.
2. `write(id, values)`: new bits per tensor, in the same order. The rank writes in place, reads
   back, and returns per tensor the fingerprint delta sum h(i, read back) - h(i, old) over *every
   copy it holds* (a replicated norm counts once per rank): the coordinator's check of the summed
   deltas proves what is in memory now, not what was meant to be written. Any error undoes the
   rank's writes before the call returns. (Between gather and write nothing else writes: the
   coordinator holds its lock and engine steps are held.)
3. `commit(id)` or `undo(id)`.

Tests and chaos drills can arm failpoints in `write` (`rpc.Arm`, `stitch_core.engine.failpoints`;
refused unless the process has STITCH_FAILPOINTS=1).

`sums()` recomputes the same per-copy sums over the whole model (start-up check, `verify`); an
engine that keeps a tensor in a wider dtype (fp32 norms) must hold exactly the widened served
value, anything else counts as corruption. The coordinator checks that the ranks' sums add up to
multiplicity x the manifest fingerprint, so every copy on every rank is proven, not just one
designated owner.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any

import numpy as np
import torch

from stitch_core.engine import derived, prebuild, rpc, scatter
from stitch_core.engine.failpoints import Failpoints
from stitch_core.engine.layout import (
    Layout,
    MastersInstalled,
    Segment,
    engine_params,
    in_range,
    learn_layout,
)
from stitch_core.engine.layout_cache import LayoutCache
from stitch_core.engine.threads import thread_map
from stitch_core.errors import StitchError
from stitch_core.format import dtypes
from stitch_core.format import fingerprint as fpr

_BLOCK = 1 << 22  # elements per step when hashing scattered runs
_LONG_RUN = 1 << 16  # runs at least this long are hashed in place (no index arrays)
_START_THREADS = 8  # threads for the start-up sums (the engine serves nothing yet)


class ReplicaError(StitchError, RuntimeError):
    """Raised by a rank for a request it cannot carry out (no layout, bad positions, ...)."""


# Requests beyond rpc's, {request type: handler(replica, request) -> reply}, that `handle`
# dispatches to: benchmarks and tests install theirs (e.g. stitch_dev.rank_baseline, on import);
# production code registers nothing.
HANDLERS: dict[type, Callable[[RankReplica, Any], Any]] = {}


def register_handler(request_type: type, handler: Callable[[RankReplica, Any], Any]) -> None:
    """Have every `RankReplica.handle` in this process answer `request_type` with `handler`."""
    HANDLERS[request_type] = handler



_INEXACT = 0x9E3779B97F4A7C15  # added to a sum per engine value that is not a served-view value




def _hf_bits(vals: torch.Tensor, hf_dtype: torch.dtype) -> torch.Tensor:
    """Integer bits of engine values as the HF dtype (exact for same or widened dtypes)."""
    if vals.dtype != hf_dtype:
        vals = vals.to(hf_dtype)
    return dtypes.int_view(vals)


def _inexact(vals: torch.Tensor, hf_dtype: torch.dtype) -> int:
    """Engine values (kept in a wider dtype) that no served-view value widens to: corruption."""
    if vals.dtype == hf_dtype:
        return 0
    back = vals.to(hf_dtype).to(vals.dtype)
    iv = dtypes.info(vals.dtype).int_dtype
    return int((back.reshape(-1).view(iv) != vals.reshape(-1).view(iv)).sum())


def _expand(seg: Segment, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """HF and engine flat positions of the runs `idx` of a segment."""
    length = seg.length[idx]
    run = np.repeat(np.arange(len(idx)), length)
    within = np.arange(int(length.sum()), dtype=np.int64) - np.repeat(
        np.cumsum(length) - length, length)
    return seg.hf_start[idx][run] + within, seg.eng_start[idx][run] + within


def _run_blocks(seg: Segment) -> Iterable[np.ndarray]:
    """Indices of short runs, grouped so each group expands to at most _BLOCK elements."""
    short = np.flatnonzero(seg.length < _LONG_RUN)
    if not len(short):
        return
    csum = np.cumsum(seg.length[short])
    cut = np.searchsorted(csum, np.arange(_BLOCK, int(csum[-1]) + _BLOCK, _BLOCK), side="right")
    lo = 0
    for hi in [*cut.tolist(), len(short)]:
        if hi > lo:
            yield short[lo:hi]
            lo = hi


class RankReplica:
    """The rank's view of an engine model as served-view tensors, patched in place.

    masters: context manager putting canonical weights back while the model's loader runs
    (engines that repack weights after loading). on_dirty: called with the engine parameter
    names whose bits changed (e.g. to re-pack them). not_state: attribute names of runtime state
    no loader writes (an engine's per-layer KV cache), left out of layout learning's check.
    prebuild_memory: bytes of kernels' weight copies an apply may build ahead of its write
    (`stitch_core.engine.prebuild`; 0: rebuilt in the pause only).
    """

    def __init__(self, model: torch.nn.Module, *,
                 masters: Callable[[torch.nn.Module], Any] = MastersInstalled,
                 on_dirty: Callable[[set[str]], Any] | None = None,
                 rank_info: dict[str, Any] | None = None,
                 layout_cache: LayoutCache | None = None,
                 not_state: Collection[str] = (),
                 layout_templates: bool = True,
                 prebuild_memory: int = 0):
        self.model = model
        self.not_state = tuple(not_state)  # attributes no loader writes (learn_layout)
        self.layout_cache = layout_cache
        self.layout_templates = layout_templates  # twin layers take a learned layer's map
        self.masters = masters
        self.on_dirty = on_dirty or (lambda dirty: None)
        self.rank_info = dict(rank_info or {})
        self.layout: Layout | None = None
        # the gather plan of each batch of apply `_plan_id` not written yet: {batch: {tensor:
        # (positions, [(engine param, engine positions, selection, HF positions, old, old sum)])}}
        self._plans: dict[int, dict[str, tuple[int, list[tuple]]]] = {}
        self._plan_id: str | None = None
        self._undo: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._undo_id: str | None = None
        self._dirty: set[str] = set()
        # (engine param, engine positions) of the last write: what a benchmark times a bare
        # index_put_ or gather against (stitch_dev.rank_baseline)
        self.last_write: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.failpoints = Failpoints()  # tests and chaos drills only (STITCH_FAILPOINTS=1)
        self._ahead = prebuild.Stager(model, prebuild_memory)  # copies built ahead of a write
        self._writes = 0  # writes, restores and loads so far: a build ahead must see none since

    # ------------------------------------------------------------ set-up and full checks

    def setup(self, shapes: Mapping[str, tuple[tuple[int, ...], str]],
              use_cache: bool = True) -> rpc.SetupReply:
        """Learn the layout (engine idle; from the layout cache when one is given, it holds this
        key and `use_cache`) and return full per-copy sums and mapped counts. `use_cache=False`
        learns every group through the loaders: no cache, no layer templates."""
        hf = {n: (tuple(s), dtypes.info(d).torch_dtype) for n, (s, d) in shapes.items()}
        t0 = time.perf_counter()
        cache = self.layout_cache
        key = cache.key(self.model, hf) if cache is not None else None
        layout = cache.load(key) if cache is not None and key and use_cache else None
        cached = layout is not None
        if layout is None:
            layout = learn_layout(self.model, hf, rank_info=self.rank_info,
                                  not_state=self.not_state,
                                  templates=use_cache and self.layout_templates)
            if cache is not None and key:
                cache.save(key, layout)
        layout.rank_info = dict(self.rank_info)
        self.layout = layout
        learn_s = time.perf_counter() - t0
        # the engine's own compute threads (torch's count), as nothing is served yet
        start_threads = min(torch.get_num_threads(), _START_THREADS)
        sums = self.sums(threads=start_threads)
        mapped = {n: sum(s.n_elems for s in t.segments) for n, t in self.layout.tensors.items()}
        return rpc.SetupReply(
            rank=self.rank_info, sums=sums, mapped=mapped, learn_s=learn_s,
            sums_s=time.perf_counter() - t0 - learn_s,
            const={p: c for p, c in self.layout.param_const.items() if c},
            unwritten={p: c for p, c in self.layout.param_unwritten.items() if c},
            derived=self.layout.derived(),
            # kernels' private copies of weights: kept in step (by kind), stale, not kept
            derived_copies=derived.kinds(self.model),
            stale_derived=derived.stale(self.model, threads=start_threads),
            unmanaged=derived.unmanaged(self.model), cached=cached,
            templated=0 if cached else layout.templated,
            learn_bytes=0 if cached else layout.learn_bytes,
            full_index_groups=[] if cached else list(layout.full_index_groups))

    def _params(self) -> dict[str, torch.nn.Parameter]:
        return engine_params(self.model)

    def sums(self, names: Iterable[str] | None = None, threads: int = 1) -> dict[str, int]:
        """Per tensor: sum of h over every copy this rank holds (mod 2^64). `threads` > 1 sums
        tensors in parallel (the hashing kernels release the GIL): start-up, when nothing else
        runs; a check while the engine serves keeps to one thread."""
        layout = self._layout()
        params = self._params()
        todo = list(names if names is not None else layout.tensors)
        totals = thread_map(lambda n: self._sum_tensor(layout, params, n), todo, threads,
                            "stitch-sums")
        return dict(zip(todo, totals, strict=True))

    def _sum_tensor(self, layout: Layout, params: Mapping[str, torch.nn.Parameter],
                    name: str) -> int:
        tm = layout.tensors.get(name)
        total = 0
        if tm is None:  # no copy of it on this rank (others may hold it)
            return 0
        for seg in tm.segments:
            flat = params[seg.param].data.reshape(-1)
            for i in np.flatnonzero(seg.length >= _LONG_RUN).tolist():
                e, h, n = int(seg.eng_start[i]), int(seg.hf_start[i]), int(seg.length[i])
                for s in range(0, n, _BLOCK):
                    m = min(_BLOCK, n - s)
                    vals = flat[e + s: e + s + m]
                    if vals.dtype != tm.hf_dtype:
                        total += _INEXACT * _inexact(vals, tm.hf_dtype)
                        vals = vals.to(tm.hf_dtype)
                    total += fpr.fingerprint(name, vals, offset=h + s)
            for idx in _run_blocks(seg):
                hpos, epos = _expand(seg, idx)
                ept = torch.from_numpy(epos).to(flat.device)
                vals = flat[ept]
                total += _INEXACT * _inexact(vals, tm.hf_dtype)
                bits = _hf_bits(vals, tm.hf_dtype)
                total += fpr.sum_at(name, torch.from_numpy(hpos).to(bits.device), bits,
                                    tm.hf_dtype.itemsize)
        return total & fpr.MASK64

    def _layout(self) -> Layout:
        if self.layout is None:
            raise ReplicaError("layout not learned yet: call setup() first")
        return self.layout

    # ------------------------------------------------------------ the apply protocol

    def gather(self, apply_id: str, positions: Mapping[str, np.ndarray],
               batch: int = 0) -> rpc.GatherReply:
        """Locate HF flat positions on this rank; return the old bits of those it holds. The plan
        is kept as batch `batch` of `apply_id` until that batch is written (a new apply drops
        every earlier plan and anything staged)."""
        layout = self._layout()
        params = self._params()
        if apply_id != self._plan_id:
            self._ahead.drop()
            self._plans, self._plan_id = {}, apply_id
        t0 = time.perf_counter()
        out: dict[str, rpc.Held] = {}
        plans: dict[str, tuple[int, list[tuple]]] = {}
        for name, pb in positions.items():
            tm = layout.tensors.get(name)
            if tm is None:
                raise ReplicaError(f"{name}: not a tensor of this model's layout")
            pos_np = np.ascontiguousarray(np.asarray(pb).reshape(-1), dtype=np.int64)
            if not in_range(pos_np, tm.hf_numel):
                raise ReplicaError(f"{name}: position out of range [0, {tm.hf_numel})")
            pos = torch.from_numpy(pos_np)
            idt = dtypes.info(tm.hf_dtype).int_dtype
            old_bits: torch.Tensor | None = None  # allocated when first needed
            complete = not pos.numel()  # a segment held every position: old_bits is whole
            held: torch.Tensor | None = None  # else: which positions some segment holds
            plan = []
            for seg in tm.segments:
                ok, eng = seg.locate(pos)
                if not eng.numel():
                    continue
                p = params[seg.param]
                eng_d = eng.to(p.device)
                old = p.data.reshape(-1)[eng_d]
                bits_d = _hf_bits(old, tm.hf_dtype)
                if eng.numel() == pos.numel():  # this segment holds every position (TP=1)
                    sel, hpos = None, pos
                    if not complete:  # a copy: the reply must not share the undo's memory
                        old_bits = bits_d.cpu() if bits_d.device.type != "cpu" else bits_d.clone()
                        complete = True
                else:
                    sel = ok.nonzero().squeeze(1)
                    hpos = pos[sel]
                    if not complete:
                        if held is None:
                            held = torch.zeros(pos.numel(), dtype=torch.bool)
                            old_bits = torch.zeros(pos.numel(), dtype=idt)
                        new = ~held[sel]  # not held by an earlier segment
                        old_bits[sel[new]] = bits_d.cpu()[new]
                        held[sel] = True
                hpos_d = hpos.to(p.device)
                # the old bits' partial sum, here and not in the write: the pause only hashes
                # what it wrote
                osum = fpr.sum_at(name, hpos_d, bits_d, tm.hf_dtype.itemsize)
                plan.append((seg.param, eng_d, sel, hpos_d, old, osum))
            plans[name] = (pos.numel(), plan)
            if old_bits is None:  # no segment held any position
                old_bits = torch.zeros(pos.numel(), dtype=idt)
            if complete or (held is not None and bool(held.all())):
                out[name] = rpc.Held(None, old_bits.numpy())
            else:
                idx = (held.nonzero().squeeze(1) if held is not None
                       else torch.zeros(0, dtype=torch.int64))
                out[name] = rpc.Held(idx.numpy().astype(rpc.index_dtype(pos.numel())),
                                     old_bits[idx].numpy())
        self._plans[batch] = plans
        return rpc.GatherReply(out, time.perf_counter() - t0)

    def prebuild(self, apply_id: str, values: Mapping[str, np.ndarray] | None,
                 batch: int = 0, build: bool = True) -> rpc.PrebuildReply:
        """Stage batch `batch`'s bits `values` (gathered as that batch of `apply_id`) for the
        write; with `build`, start building ahead the kernels' copies the staged bits of every
        batch will change, while the engine serves (`stitch_core.engine.prebuild`). `values`
        None: how far that is."""
        if values is not None:
            plans = self._plans.get(batch) if apply_id == self._plan_id else None
            if plans is None:
                raise ReplicaError(f"prebuild {apply_id} batch {batch} without a matching gather "
                                   f"({self._plan_id}, batches {sorted(self._plans)})")
            for name, vb in values.items():  # refused now, not in the pause
                if name not in plans:
                    raise ReplicaError(f"{name}: values for a tensor that was not gathered")
                if np.asarray(vb).size != plans[name][0]:
                    raise ReplicaError(f"{name}: {np.asarray(vb).size} values for "
                                       f"{plans[name][0]} positions")
            self._ahead.stage(apply_id, batch, values)
            if build:
                layout = self._layout()
                staged = self._ahead.bits
                self._ahead.start(apply_id, self._writes, self._params(),
                                  {b: self._plans[b] for b in staged},
                                  {n: layout.tensors[n].hf_dtype
                                   for v in staged.values() for n in v})
        return self._ahead.status(apply_id)

    def write(self, apply_id: str, values: Mapping[str, np.ndarray],
              last: bool = True, staged: bool = False, batch: int = 0) -> rpc.WriteReply:
        """Write new bits (every position of each gathered tensor of batch `batch`, in gather
        order; `staged`: those `prebuild` was given, of every batch staged). An apply written in
        several calls (same id) rebuilds and proves the derived copies once, with its `last`
        call, for every parameter any of its batches wrote (steps are held throughout, so
        nothing reads a copy in between)."""
        if apply_id != self._plan_id:
            raise ReplicaError(f"write {apply_id} without a matching gather ({self._plan_id})")
        todo: Mapping[int, Mapping[str, np.ndarray]]
        if staged:
            got = self._ahead.values(apply_id)
            if got is None:
                raise ReplicaError(f"write {apply_id}: no bits staged for it")
            todo = got
        else:
            todo = {batch: values}
        missing = sorted(b for b in todo if b not in self._plans)
        if missing:
            raise ReplicaError(f"write {apply_id}: batches {missing} were not gathered")
        layout = self._layout()
        params = self._params()
        t0 = time.perf_counter()
        ahead = self._ahead.take(apply_id, self._writes, todo,
                                 whole=last and self._undo_id != apply_id)
        self._writes += 1
        ahead_installed = 0
        undo: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        dirty: set[str] = set()
        deltas: dict[str, int] = {}
        rebuilt: list[str] = []
        rebuild_s = 0.0
        items = [(self._plans[b], name, vb) for b in sorted(todo) for name, vb in todo[b].items()]
        try:
            for i, (plans, name, vb) in enumerate(items):
                tm = layout.tensors[name]
                hf = dtypes.info(tm.hf_dtype)
                new_all = torch.from_numpy(np.ascontiguousarray(vb).reshape(-1)).view(hf.int_dtype)
                if name not in plans:
                    raise ReplicaError(f"{name}: values for a tensor that was not gathered")
                n, plan = plans[name]
                if new_all.numel() != n:
                    raise ReplicaError(f"{name}: {new_all.numel()} values for {n} positions")
                d = 0
                for pname, eng, sel, hpos, old, osum in plan:
                    flat = params[pname].data.reshape(-1)
                    new_bits = (new_all if sel is None else new_all[sel]).to(eng.device)
                    undo.append((flat, eng, old))
                    dirty.add(pname)
                    # hash what is *there now*: the coordinator's check of the summed deltas is
                    # the read-back proof (a lost or wrong write changes the sum)
                    if scatter.fused(flat, tm.hf_dtype, eng):  # CPU: one numba kernel
                        d += scatter.write_read_back_sum(name, flat, eng, new_bits, hpos) - osum
                        continue
                    scatter.write_bits(flat, eng, new_bits, tm.hf_dtype)
                    back = flat[eng]
                    extra = _INEXACT * _inexact(back, tm.hf_dtype)
                    d += (fpr.sum_at(name, hpos, _hf_bits(back, tm.hf_dtype), hf.itemsize)
                          - osum + extra)
                deltas[name] = (deltas.get(name, 0) + d) & fpr.MASK64  # a tensor may span batches
                if self.failpoints.armed:  # tests: fail here, part of the write done
                    self.failpoints.hit("write", i + 1, len(items))
            earlier = self._undo_id == apply_id  # batches of this apply written before
            all_dirty = dirty | (self._dirty if earlier else set())
            if last and all_dirty:
                mark = derived.generation()
                t_r = time.perf_counter()
                if ahead is not None:
                    ahead.arm()  # the copies built ahead are installed instead of rebuilt
                try:
                    rebuilt = list(self.on_dirty(all_dirty) or ())
                finally:
                    if ahead is not None:
                        ahead.disarm()
                        ahead_installed = ahead.installed(mark)
                        self._ahead.retired = ahead.retire()  # freed at commit, after the pause
                rebuild_s = time.perf_counter() - t_r
                # what the kernels read: every derived copy built from what was written must have
                # been rebuilt (and stamped) since, from the bytes that are there now
                flats = [flat for flat, _, _ in (self._undo if earlier else [])]
                stale = derived.not_rebuilt(self.model, flats + [flat for flat, _, _ in undo],
                                            mark)
                if stale:
                    raise ReplicaError(f"derived copies not rebuilt after the write (kernels would "
                                       f"read old values): {', '.join(stale[:5])}; undone")
        except BaseException:
            if ahead is not None:
                ahead.cancel()
            self._restore(undo, dirty)
            raise
        for b in todo:  # written: its plan is done with (the undo log keeps what it needs)
            self._plans.pop(b, None)
        if self._undo_id == apply_id:  # a later batch of the same apply: one undo for all
            self._undo.extend(undo)
            self._dirty |= dirty
            self.last_write += [(flat, eng) for flat, eng, _ in undo]
        else:
            self._undo, self._undo_id, self._dirty = undo, apply_id, dirty
            self.last_write = [(flat, eng) for flat, eng, _ in undo]
        if self.failpoints.armed:  # tests: all written (undo record kept), then the call fails
            self.failpoints.hit("written")
        return rpc.WriteReply(deltas, sorted(dirty), time.perf_counter() - t0, rebuilt,
                              rebuild_s, ahead_installed)

    def _restore(self, undo, dirty: set[str]) -> None:
        self._writes += 1
        for flat, eng, old in reversed(undo):
            if flat.dtype == old.dtype:
                iv = dtypes.info(flat.dtype).int_dtype
                flat.view(iv).index_put_((eng,), old.view(iv))
        if dirty:
            with contextlib.suppress(Exception):
                self.on_dirty(dirty)

    def undo(self, apply_id: str) -> rpc.Done:
        """Put back what apply `apply_id` wrote on this rank. A rank that wrote nothing of it (its
        write failed and restored itself, or never ran) has nothing to undo: `undone` False."""
        if apply_id != self._undo_id:
            return rpc.Done(apply_id, undone=False)
        self._restore(self._undo, self._dirty)
        self._undo, self._undo_id, self._dirty = [], None, set()
        return rpc.Done(apply_id, undone=True)

    def commit(self, apply_id: str) -> rpc.Done:
        if apply_id == self._undo_id:
            self._undo, self._undo_id, self._dirty = [], None, set()
        if apply_id == self._plan_id:
            self._plans, self._plan_id = {}, None
        self._ahead.drop(apply_id)
        return rpc.Done(apply_id)

    # ------------------------------------------------------------ the engine's own loader

    def load(self, items: Iterable[tuple[str, torch.Tensor]]) -> rpc.LoadReply:
        """Load whole tensors through the model's own `load_weights` (fallback and snapshots)."""
        t0 = time.perf_counter()
        items = list(items)
        self._ahead.drop()
        self._writes += 1
        with self.masters(self.model):
            self.model.load_weights(iter(items))
        layout = self.layout
        if layout is not None and all(n in layout.tensors for n, _ in items):
            dirty = {s.param for n, _ in items for s in layout.tensors[n].segments}
        else:
            dirty = set(self._params())
        self.on_dirty(dirty)
        self._plans, self._plan_id = {}, None
        return rpc.LoadReply(len(items), time.perf_counter() - t0)

    def load_files(self, files: Iterable[str]) -> rpc.LoadReply:
        """Load every tensor of these safetensors files (a snapshot) through the model's loader."""
        from safetensors import safe_open

        items = []
        for f in files:
            with safe_open(f, framework="pt") as sf:
                items.extend((k, sf.get_tensor(k)) for k in sf.keys())  # noqa: SIM118
        return self.load(items)

    def put(self, values: Mapping[str, tuple[Any, Any]]) -> dict[str, Any]:
        """Write new bits at HF flat positions ({name: (positions, new values or their integer
        bits)}) through the one write path (gather, write with read-back and derived-copy checks,
        commit), without a coordinator's checks against a manifest: tests and debugging."""
        layout = self._layout()
        positions, new = {}, {}
        for name, (pos, vals) in values.items():
            tm = layout.tensors[name]
            positions[name] = np.asarray(pos).reshape(-1).astype(rpc.index_dtype(tm.hf_numel))
            v = torch.as_tensor(vals).reshape(-1)
            new[name] = (dtypes.int_view(v) if v.is_floating_point() else v).numpy()
        aid = f"put-{time.monotonic_ns()}"
        self.gather(aid, positions)
        written = sum(int(eng.numel()) for _, plan in self._plans[0].values()
                      for _, eng, *_ in plan)
        out = self.write(aid, new)
        self.commit(aid)
        return {"written": written, "params": out.dirty}

    def handle(self, req: rpc.Request) -> rpc.Reply:
        """One entry point for engine RPC adapters: a typed request in, its reply out."""
        match req:
            case rpc.Setup(shapes, use_cache):
                return self.setup(shapes, use_cache)
            case rpc.Sums(names):
                return rpc.SumsReply(self.sums(names), derived.stale(self.model))
            case rpc.Gather(aid, positions, batch):
                return self.gather(aid, positions, batch)
            case rpc.Prebuild(aid, values, batch, build):
                return self.prebuild(aid, values, batch, build)
            case rpc.Write(aid, values, last, staged, batch):
                return self.write(aid, values, last, staged, batch)
            case rpc.Undo(aid):
                return self.undo(aid)
            case rpc.Commit(aid):
                return self.commit(aid)
            case rpc.Load(tensors):
                return self.load((n, dtypes.from_int(
                    torch.from_numpy(np.ascontiguousarray(bits).reshape(-1)).view(
                        dtypes.info(d).int_dtype), dtypes.info(d).torch_dtype, tuple(shape)))
                    for n, (d, shape, bits) in tensors.items())
            case rpc.LoadFiles(files):
                return self.load_files(files)
            case rpc.Arm():
                return self.failpoints.arm(req, self.rank_info)
        extra = HANDLERS.get(type(req))
        if extra is not None:  # a request type a benchmark or test registered
            return extra(self, req)
        raise ReplicaError(f"not a rank request: {type(req).__name__}")
