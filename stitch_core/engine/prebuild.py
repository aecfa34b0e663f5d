"""Kernels' copies of weights built ahead of the pause, from exactly what the write will leave.

Where an engine's kernels read a private copy of a weight (vLLM packs its CPU linear layers with
oneDNN; `stitch_core.engine.derived`), an apply must rebuild every copy built from what it wrote
before the engine steps again. At RL learning rates an apply touches every layer, so rebuilding
in the pause re-packs the whole model: ~2 s at 0.6B on one core, over 90% of the pause.

Between its gather and its write the rank already knows what the write will do: the engine
positions (the gather plan) and the new bits (`rpc.Prebuild` carries the bits `rpc.Write` will
carry). `start` picks the copies a registered `DerivedCopy.build` can build off to the side, and
a background thread, while the engine serves, copies each one's written sources aside, writes
the new bits into that copy as the write will (`scatter.write_bits`), builds the kernel's copy
from it and stamps it with its digest. The write then installs each built copy instead of
rebuilding it (`DerivedCopy.install_ahead`: the module's holders are swapped), only if

* it is the write that was staged: same apply id, the whole apply in that one write (every
  batch staged, or one batch), the same bits (compared);
* nothing wrote a weight between the copying aside and the write (the replica's write count);

so the sources after the write equal, bit for bit, what the copy was built from, and the stamp is
theirs; the full checks (`derived.stale`, `/stitch/verify`) re-hash them as they do every copy.
Anything else (other bits, batches written one by one, a failed or unfinished build) falls back
to the in-place rebuild in the pause.

An apply over the coordinator's batch budget stages its batches' bits one after the other
(`Stager.stage`, with their gather plans kept by the replica); the last one starts the build over
all of them, and the write in the pause writes them all in one call.

Memory: the copies built ahead are held until the write, at most `budget` bytes of their sources
(`STITCH_PREBUILD_MEMORY`); copies beyond it are rebuilt in the pause. The written sources are
copied into the rank's scratch buffers (`Scratch`: as large as the largest source, kept).
One thread builds, beside the engine's own (on a small host they share cores with decode steps).
"""

from __future__ import annotations

import logging
import resource
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
import torch

from stitch_core.engine import derived, rpc, scatter
from stitch_core.errors import StitchError
from stitch_core.format import dtypes

log = logging.getLogger("stitch.engine")

__all__ = ["Prebuild", "PrebuildCancelledError", "Scratch", "Stager", "start", "engine_writes"]

# {engine param: [(engine positions, new bits as the served dtype's integers, served dtype)]}
Writes = dict[str, list[tuple[torch.Tensor, torch.Tensor, torch.dtype]]]


class PrebuildCancelledError(StitchError, RuntimeError):
    """A build ahead dropped before it ran (another apply, an undo, a load)."""


@dataclass
class _Job:
    dc: derived.DerivedCopy
    writes: dict[str, list[tuple[torch.Tensor, torch.Tensor, torch.dtype]]]  # by source attribute
    future: Future = field(default_factory=Future)


def engine_writes(plan: Mapping[str, tuple[int, list[tuple]]], values: Mapping[str, np.ndarray],
                  hf_dtypes: Mapping[str, torch.dtype]) -> Writes:
    """What a write of `values` through the gather `plan` ({name: (positions, [(engine param,
    engine positions, selection, ...)])}, `RankReplica`'s) writes, per engine parameter."""
    out: Writes = {}
    for name, vb in values.items():
        n, plan_n = plan[name]
        hf_dtype = hf_dtypes[name]
        bits = torch.from_numpy(np.ascontiguousarray(vb).reshape(-1)).view(
            dtypes.info(hf_dtype).int_dtype)
        if bits.numel() != n:
            raise ValueError(f"{name}: {bits.numel()} values for {n} positions")
        for pname, eng, sel, *_ in plan_n:
            new = (bits if sel is None else bits[sel]).to(eng.device)
            out.setdefault(pname, []).append((eng, new, hf_dtype))
    return out


def _batches_writes(plans: Mapping[int, Mapping[str, tuple[int, list[tuple]]]],
                   batches: Mapping[int, Mapping[str, np.ndarray]],
                   hf_dtypes: Mapping[str, torch.dtype]) -> Writes:
    """`engine_writes` of every staged batch (positions of two batches never meet), merged."""
    out: Writes = {}
    for b in sorted(batches):
        for pname, ws in engine_writes(plans[b], batches[b], hf_dtypes).items():
            out.setdefault(pname, []).extend(ws)
    return out


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _jobs(model: torch.nn.Module, params: Mapping[str, torch.Tensor], writes: Writes,
          budget: int) -> tuple[list[_Job], int, str]:
    """The copies to build ahead (engine order, within `budget` bytes of sources), their source
    bytes, and why none when none."""
    written = {pname: params[pname] for pname in writes if pname in params}
    by_storage: dict[int, list[str]] = {}  # every written parameter on each storage
    for pname, t in written.items():
        if t.numel():
            by_storage.setdefault(t.untyped_storage().data_ptr(), []).append(pname)
    storages = set(by_storage)
    jobs: list[_Job] = []
    total, touched, over = 0, 0, 0
    for mname, dc in derived.copies(model):
        src_storages = {t.untyped_storage().data_ptr() for t in dc.sources.values() if t.numel()}
        if not src_storages & storages:
            continue
        touched += 1
        if dc.build is None:
            continue
        by_attr: dict[str, list[tuple[torch.Tensor, torch.Tensor, torch.dtype]]] = {}
        ok = True
        for attr, t in dc.sources.items():
            if not t.numel() or t.untyped_storage().data_ptr() not in storages:
                continue
            # a source the write reaches only as the very tensor it writes, under each of the
            # parameter names it writes that storage by (never a view of part of it)
            names = by_storage[t.untyped_storage().data_ptr()]
            if not all(written[n].data_ptr() == t.data_ptr() and written[n].numel() == t.numel()
                       and written[n].dtype == t.dtype and written[n].is_contiguous()
                       and t.is_contiguous() for n in names):
                ok = False
                break
            by_attr[attr] = [w for n in names for w in writes[n]]
        size = sum(_nbytes(t) for t in dc.sources.values())
        if not ok:
            log.debug("stitch: %s (%s) is built from part of a written tensor: rebuilt in the "
                      "pause", mname, dc.kind)
            continue
        if total + size > budget:
            over += 1
            continue
        total += size
        jobs.append(_Job(dc, by_attr))
    why = ""
    if not jobs:
        why = ("no kernel copy is built from what this write changes" if not touched else
               f"over STITCH_PREBUILD_MEMORY ({budget:,} bytes)" if over else
               "no kernel copy this write changes can be built ahead")
    return jobs, total, why


class Scratch:
    """The buffers a build ahead copies written sources into, one per (device, dtype), grown to
    the largest source and kept between applies: a fresh clone per copy would cost a first touch
    of every byte each apply (page faults: ~1 s per GiB on some VMs). One build uses them at a
    time (`lock`). A `DerivedCopy.build` must not read its sources after it returns (vLLM's
    packing copies them: checked in tests/vllm)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._bufs: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    def copy_of(self, t: torch.Tensor, slot: int) -> torch.Tensor:
        """`t`'s values in scratch slot `slot` (one slot per source of a copy), shaped as `t`."""
        key = (f"{t.device}#{slot}", t.dtype)
        buf = self._bufs.get(key)
        if buf is None or buf.numel() < t.numel():
            self._bufs.pop(key, None)
            buf = self._bufs[key] = torch.empty(t.numel(), dtype=t.dtype, device=t.device)
        out = buf[:t.numel()].view(t.shape)
        out.copy_(t.detach())
        return out

    @property
    def nbytes(self) -> int:
        return sum(_nbytes(b) for b in self._bufs.values())


# the steps of one copy's build ahead, timed (summed over an apply's copies: `Prebuild.phases`);
# `build_sys`: the kernel's share of `build` on the building thread (page faults of the new
# copies, mostly), where the OS reports it per thread (Linux)
_RUSAGE_THREAD = getattr(resource, "RUSAGE_THREAD", None)
PHASES = ("copy", "write", "build", "digest") + (
    ("build_sys",) if _RUSAGE_THREAD is not None else ())


def _sys_time() -> float:
    return resource.getrusage(_RUSAGE_THREAD).ru_stime if _RUSAGE_THREAD is not None else 0.0


def _build(job: _Job, scratch: Scratch,
           phases: dict[str, float]) -> tuple[Callable[[], None], bytes]:
    with scratch.lock:
        srcs: dict[str, torch.Tensor] = {}
        for slot, (attr, t) in enumerate(job.dc.sources.items()):
            w = job.writes.get(attr)
            if w is None:
                srcs[attr] = t  # not written by this apply
                continue
            t0 = time.perf_counter()
            copy = scratch.copy_of(t, slot)
            t1 = time.perf_counter()
            flat = copy.reshape(-1)
            for eng, bits, hf_dtype in w:
                scatter.write_bits(flat, eng, bits, hf_dtype)
            phases["copy"] += t1 - t0
            phases["write"] += time.perf_counter() - t1
            srcs[attr] = copy
        assert job.dc.build is not None
        t0, s0 = time.perf_counter(), _sys_time()
        install = job.dc.build(srcs)
        t1 = time.perf_counter()
        if _RUSAGE_THREAD is not None:
            phases["build_sys"] += _sys_time() - s0
        digest = derived.digest(srcs.values())
        phases["build"] += t1 - t0
        phases["digest"] += time.perf_counter() - t1
        return install, digest


class Prebuild:
    """One apply's copies built ahead on a background thread (`start` makes one)."""

    def __init__(self, apply_id: str, writes_seen: int,
                 values: Mapping[int, Mapping[str, np.ndarray]],
                 jobs: list[_Job], nbytes: int, why: str = "", scratch: Scratch | None = None):
        self.apply_id, self.writes_seen = apply_id, writes_seen
        self.scratch = scratch if scratch is not None else Scratch()
        self.values = values  # {batch: new bits per tensor}: the bits it was built from
        self.jobs, self.nbytes, self.why = jobs, nbytes, why
        self.t0 = time.perf_counter()
        self.seconds = 0.0
        self.phases = dict.fromkeys(PHASES, 0.0)
        self._cancel = threading.Event()
        self._thread: threading.Thread | None = None
        if jobs:
            self._thread = threading.Thread(target=self._run, name="stitch-prebuild", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        for job in self.jobs:
            if self._cancel.is_set():
                job.future.set_exception(PrebuildCancelledError(self.apply_id))
                continue
            try:
                job.future.set_result(_build(job, self.scratch, self.phases))
            except BaseException as e:  # noqa: BLE001 - reported where it is installed
                job.future.set_exception(e)
        self.seconds = time.perf_counter() - self.t0

    @property
    def done(self) -> bool:
        return all(j.future.done() for j in self.jobs)

    def status(self) -> rpc.PrebuildReply:
        done = self.done
        return rpc.PrebuildReply(self.apply_id, len(self.jobs), self.nbytes, done,
                                 self.seconds if done else time.perf_counter() - self.t0, self.why,
                                 dict(self.phases) if done else {})

    def matches(self, apply_id: str, writes_seen: int,
                values: Mapping[int, Mapping[str, np.ndarray]]) -> bool:
        """Whether a write of `values` ({batch: bits per tensor}) is the one staged, with nothing
        written since."""
        if apply_id != self.apply_id or writes_seen != self.writes_seen:
            return False
        if values is self.values:  # the staged bits themselves (`rpc.Write.staged`)
            return True
        return (values.keys() == self.values.keys()
                and all(_same(values[b], v) for b, v in self.values.items()))

    def arm(self) -> None:
        """Offer each built copy to the write's rebuild (`derived.rebuild_from`)."""
        for job in self.jobs:
            job.dc.ahead = job.future

    def disarm(self) -> None:
        for job in self.jobs:
            job.dc.ahead = None

    def retire(self) -> list[object]:
        """The old copies the installs replaced (their owners keep them until the apply is
        committed: freeing 1 GB of packed copies takes ~30 ms, outside the pause then)."""
        out = []
        for job in self.jobs:
            if job.dc.retired is not None:
                out.append(job.dc.retired)
                job.dc.retired = None
        return out

    def installed(self, since: int) -> int:
        """How many built copies a rebuild after the mark `since` installed (their stamp)."""
        n = 0
        for job in self.jobs:
            fut = job.future
            if (job.dc.built > since and fut.done() and fut.exception() is None
                    and job.dc.stamp == fut.result()[1]):
                n += 1
        return n

    def stop(self) -> None:
        """Build nothing more (the copy being built finishes; what is built stays usable)."""
        self._cancel.set()

    def cancel(self) -> None:
        """Drop what is not built yet (the one building finishes) and forget the rest."""
        self._cancel.set()
        self.disarm()


def _same(a: Mapping[str, np.ndarray], b: Mapping[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(
        np.array_equal(np.asarray(a[n]).reshape(-1), np.asarray(v).reshape(-1))
        for n, v in b.items())


def start(apply_id: str, writes_seen: int, model: torch.nn.Module,
          params: Mapping[str, torch.Tensor],
          plans: Mapping[int, Mapping[str, tuple[int, list[tuple]]]],
          values: Mapping[int, Mapping[str, np.ndarray]], hf_dtypes: Mapping[str, torch.dtype],
          budget: int, scratch: Scratch | None = None) -> Prebuild:
    """Start building ahead the copies a write of `values` ({batch: bits per tensor}) through
    `plans` (the gather plan of each batch) will change (in `scratch`'s buffers: the rank's,
    kept between applies)."""
    writes = _batches_writes(plans, values, hf_dtypes)
    jobs, nbytes, why = _jobs(model, params, writes, budget) if budget > 0 else (
        [], 0, "STITCH_PREBUILD_MEMORY is 0")
    return Prebuild(apply_id, writes_seen, values, jobs, nbytes, why, scratch)


class Stager:
    """A rank's bits staged ahead of a write and the copies built from them, one apply at a time
    (`RankReplica` owns one: its budget, scratch buffers, the bits and build for the next write)."""

    def __init__(self, model: torch.nn.Module, budget: int):
        self.model, self.budget = model, int(budget)
        self.scratch = Scratch()
        self.staged: Prebuild | None = None
        self.bits: dict[int, dict[str, np.ndarray]] = {}  # {batch: new bits} of `bits_id`
        self.bits_id: str | None = None
        self.retired: list[object] = []  # old copies replaced by installs, freed at commit

    def stage(self, apply_id: str, batch: int, values: Mapping[str, np.ndarray]) -> None:
        """Hold batch `batch`'s bits for the write of `apply_id` (another apply's are dropped)."""
        if self.bits_id != apply_id:
            self.drop()
            self.bits_id = apply_id
        if self.staged is not None:  # a build from fewer batches: it would not match
            self.staged.cancel()
            self.staged = None
        self.bits[batch] = dict(values)

    def start(self, apply_id: str, writes_seen: int, params: Mapping[str, torch.Tensor],
              plans: Mapping[int, Mapping[str, tuple[int, list[tuple]]]],
              hf_dtypes: Mapping[str, torch.dtype]) -> None:
        """Build ahead the copies the staged bits of every batch of `apply_id` change."""
        if self.bits_id != apply_id or not self.bits:
            raise ValueError(f"no bits staged for apply {apply_id}")
        if self.staged is not None:
            self.staged.cancel()
        self.staged = start(apply_id, writes_seen, self.model, params, plans, self.bits,
                            hf_dtypes, self.budget, self.scratch)

    def values(self, apply_id: str) -> dict[int, dict[str, np.ndarray]] | None:
        """The bits staged for `apply_id`'s write, per batch (None: none staged)."""
        return self.bits if self.bits_id == apply_id and self.bits else None

    def status(self, apply_id: str) -> rpc.PrebuildReply:
        st = self.staged
        if st is None or st.apply_id != apply_id:
            return rpc.PrebuildReply(apply_id, 0, 0, True, why="nothing built ahead for this apply")
        return st.status()

    def take(self, apply_id: str, writes_seen: int,
             values: Mapping[int, Mapping[str, np.ndarray]], whole: bool) -> Prebuild | None:
        """The build staged for exactly this write (`whole`: the apply's only write; the same
        bits, nothing written since), or None; any other is dropped. The staged bits are let go
        (the write holds what it writes)."""
        st, self.staged = self.staged, None
        self.bits, self.bits_id = {}, None
        if st is None:
            return None
        if whole and st.matches(apply_id, writes_seen, values):
            st.stop()  # what is not built by now is rebuilt in the pause
            return st
        st.cancel()
        return None

    def drop(self, apply_id: str | None = None) -> None:
        """Drop the staged bits and build (only if they are `apply_id`'s, when given) and free
        the copies the last installs replaced."""
        self.retired = []
        if self.staged is not None and apply_id in (None, self.staged.apply_id):
            self.staged.cancel()
            self.staged = None
        if apply_id in (None, self.bits_id):
            self.bits, self.bits_id = {}, None
