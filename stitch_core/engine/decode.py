"""The coordinator's decode of one apply batch, its chunks spread over threads.

A batch is a list of `(entry, [(reader, chunk), ...], last)`: a tensor's chunks (or the part of
them in this batch) and whether its last chunk is among them. Decoding it has two steps around
the ranks' gather:

1. `positions(batch)`: every chunk's positions (its own stream, no old values needed);
2. `values(plan, gathered, running, base_fps)`: the old bits the ranks sent are put in position
   order, then every chunk's new values are decoded under contexts of those old bits and its
   fingerprint delta sum h(new) - h(old) is computed; a tensor whose last chunk is in the batch
   is checked against its target fingerprint.

Chunks (at most `header.MAX_CHUNK_SPAN` positions each, 2^20 by default) decode independently,
and the codec's and the fingerprint's numba kernels release the GIL, so both steps run the
chunks on a thread pool of `threads` workers (`STITCH_DECODE_THREADS`). The fingerprint is a sum,
so per-chunk deltas add up in any order; the file reads stay on the calling thread (a reader's
seek + read is not thread-safe) and results are put back in chunk order, so the output (and the
first error raised, that of the first failing chunk in order) is the same for any thread count.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import numpy as np
import torch

from stitch_core.engine import rpc
from stitch_core.engine.proof import EngineStateError
from stitch_core.engine.threads import thread_map
from stitch_core.format import codec, dtypes
from stitch_core.format import fingerprint as fpr
from stitch_core.format.patch import chunk_list, decode_chunk
from stitch_core.format.stp import PatchError
from stitch_core.settings import DECODE_THREADS

T = TypeVar("T")
R = TypeVar("R")
CPU = torch.device("cpu")
# a tensor's chunks (or those of them in this batch) and whether its last chunk is among them
Batch = list[tuple[Any, list[tuple[Any, Any]], bool]]
# per tensor of a batch: its positions in chunk order and (entry, [(chunk, values, n)], last)
Plan = dict[str, tuple[torch.Tensor, tuple[Any, list[tuple[Any, Any, int]], bool]]]


def split_batches(patch, entries, limit: int, budget: str) -> list[Batch]:
    """Entries' chunks grouped so that a batch holds at most `limit` changed elements; a tensor
    may span batches. A chunk over `limit` is refused (`budget` names the setting)."""
    batches: list[Batch] = []
    cur: Batch = []
    n = 0
    for e in entries:
        segs: list[tuple[Any, Any]] = []
        for reader, c in chunk_list(patch, e):
            if c.count > limit:
                raise PatchError(f"{e.name}: a chunk of {c.count:,} changed elements is over "
                                 f"this engine's apply budget ({limit:,} elements, {budget})")
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


class BatchDecoder:
    """Decodes apply batches on up to `threads` threads (capped by the host's CPU count)."""

    def __init__(self, threads: int = DECODE_THREADS):
        self.threads = max(1, min(int(threads), os.cpu_count() or 1))

    def _map(self, fn: Callable[[T], R], items: Sequence[T]) -> list[R]:
        return thread_map(fn, items, self.threads, "stitch-decode")

    def positions(self, batch: Iterable[tuple[Any, list[tuple[Any, Any]], bool]]) -> Plan:
        jobs: list[tuple[Any, Any, Any]] = []  # (entry, chunk, position bytes), chunk order
        values: list[Any] = []
        tensors: list[tuple[Any, int, bool]] = []  # (entry, number of chunks, last)
        for e, segs, last in batch:
            for reader, c in segs:
                pb, vb = reader.read_chunk(c)  # on this thread: the reader seeks
                jobs.append((e, c, pb))
                values.append(vb)
            tensors.append((e, len(segs), last))

        def one(job: tuple[Any, Any, Any]) -> np.ndarray:
            e, c, pb = job
            try:
                return codec.decode_positions(c.pos, pb, c.start, c.stop, c.count)
            except codec.CodecError as err:
                raise PatchError(f"{e.name}: corrupt patch data: {err}") from None

        got = self._map(one, jobs)
        plan: Plan = {}
        i = 0
        for e, n, last in tensors:
            pos = got[i:i + n]
            chunks = [(jobs[i + k][1], values[i + k], len(pos[k])) for k in range(n)]
            plan[e.name] = (torch.from_numpy(np.concatenate(pos)), (e, chunks, last))
            i += n
        return plan

    def values(self, plan: Plan, gathered: list[rpc.GatherReply], running: dict[str, int],
               base_fps: dict[str, int]) -> dict[str, np.ndarray]:
        """New bits of a batch, per tensor in position order. Each tensor's fingerprint is
        carried in `running` across batches (starting from `base_fps`) and checked against its
        target once its last chunk is decoded."""
        olds = dict(zip(plan, self._map(lambda n: _old_bits(n, plan[n], gathered), list(plan)),
                        strict=True))
        jobs = []  # (name, chunk, value bytes, positions, old bits, dtype), chunk order
        for name, (pos, (e, chunks, _)) in plan.items():
            dt, s = dtypes.info(e.dtype), 0
            for c, vb, k in chunks:
                jobs.append((name, c, vb, pos[s:s + k], olds[name][s:s + k].to(torch.int64), dt))
                s += k

        def one(job) -> tuple[torch.Tensor, int]:
            name, c, vb, p, o, dt = job
            v = decode_chunk(name, c, vb, o, dt, CPU)
            return v.to(dt.int_dtype), fpr.update(0, name, p, o, v, dt.itemsize)

        got = self._map(one, jobs)
        new: dict[str, np.ndarray] = {}
        i = 0
        for name, (_, (e, chunks, last)) in plan.items():
            part = got[i:i + len(chunks)]
            i += len(chunks)
            fp = (running.get(name, base_fps[name]) + sum(d for _, d in part)) & fpr.MASK64
            running[name] = fp
            if last and fpr.fmt(fp) != e.target_fp:
                raise PatchError(f"{name}: result fingerprint {fpr.fmt(fp)} != {e.target_fp} "
                                 "(corrupt patch?)")
            new[name] = torch.cat([v for v, _ in part]).numpy()
        return new


def _old_bits(name: str, planned, gathered: list[rpc.GatherReply]) -> torch.Tensor:
    """The old bits of one tensor's planned positions, from every rank's gather reply."""
    pos, (e, _, _) = planned
    dt = dtypes.info(e.dtype)
    old = torch.empty(pos.numel(), dtype=dt.int_dtype)
    held = torch.zeros(pos.numel(), dtype=torch.bool)
    for g in gathered:
        h_ = g.old[name]
        bits = torch.from_numpy(np.ascontiguousarray(h_.bits).reshape(-1)).view(dt.int_dtype)
        idx = (torch.arange(pos.numel()) if h_.index is None
               else torch.from_numpy(h_.index.astype(np.int64)))
        old[idx] = bits
        held[idx] = True
    if not bool(held.all()):
        raise EngineStateError(f"{name}: {int((~held).sum())} changed positions are held "
                               "by no rank (layout incomplete)")
    return old
