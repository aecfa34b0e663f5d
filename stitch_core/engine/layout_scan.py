"""The integer shadows of layout learning: their memory, and the scan that reads them as runs.

One job, about 140 lines: `layout.learn_layout` swaps every engine parameter of a group for an
integer shadow, has the model's loaders fill it with index values, and scans it into runs (the
large shadows of a group on several threads at once: `scan_shadows`). The
shadows and index tensors of every group come from one `IndexPool` (allocated once, for the
largest group: fresh allocations cost a page fault per 4 KiB, which was most of learning's time
at 0.6B), and `scan_runs` reads a shadow in one pass that checks long runs 32 elements at a
time (benchmarks/startup.py).
"""

from __future__ import annotations

import numpy as np
import torch

from stitch_core._jit import numba
from stitch_core.engine.threads import thread_map


class IndexPool:
    """Reusable flat buffers, one per (purpose, dtype, device), grown when a larger one is asked
    for. Learn the largest group first and every page is touched once."""

    def __init__(self) -> None:
        self._bufs: dict[tuple[str, torch.dtype, str], torch.Tensor] = {}
        self.nbytes_peak = 0  # the most bytes the pool held at once

    def take(self, purpose: str, n: int, dtype: torch.dtype,
             device: str | torch.device = "cpu") -> torch.Tensor:
        key = (purpose, dtype, str(device))
        buf = self._bufs.get(key)
        if buf is None or buf.numel() < n:
            self._bufs.pop(key, None)  # free the smaller one first
            buf = self._bufs[key] = torch.empty(n, dtype=dtype, device=device)
            self.nbytes_peak = max(self.nbytes_peak, sum(
                b.numel() * b.element_size() for b in self._bufs.values()))
        return buf[:n]

    def clear(self) -> None:
        self._bufs.clear()


@numba.njit(cache=True, nogil=True)
def _grow(a, n):  # pragma: no cover - compiled
    out = np.empty(n, np.int64)
    out[: a.shape[0]] = a
    return out


# elements a run is checked by at once (one branch each; 8 -> 32 halved the scan's time,
# 1.62 -> 0.8 ns per element on a long run: the block vectorises)
RUN_BLOCK = 32


@numba.njit(cache=True, nogil=True)
def _run_length(flat, i, v, lim):  # pragma: no cover - compiled
    """The length (1..lim) of the run of consecutive values v, v+1, ... from flat[i], a block
    of RUN_BLOCK at a time (one branch per block, which LLVM vectorises)."""
    k = 1
    while k + RUN_BLOCK <= lim:
        d = np.int64(0)
        for q in range(RUN_BLOCK):
            d |= np.int64(flat[i + k + q]) ^ (v + k + q)
        if d != 0:
            break
        k += RUN_BLOCK
    while k < lim and np.int64(flat[i + k]) == v + k:
        k += 1
    return k


@numba.njit(cache=True, nogil=True)
def scan_runs(flat, bases):  # pragma: no cover - compiled
    """One pass over a filled integer shadow (engine order): its runs of consecutive index values
    at consecutive engine positions within one tensor of the group. Returns (constant count,
    unwritten count, foreign count, run tensor ids, HF starts, engine starts, lengths). Values:
    -1 never written, 0 a constant from a loader, v in [bases[t], bases[t+1]) HF element
    v - bases[t] of tensor t, anything else foreign."""
    n = flat.shape[0]
    lo, hi = bases[0], bases[bases.shape[0] - 1]
    n_const = n_unwritten = n_foreign = 0
    cap = 1024
    tid = np.empty(cap, np.int64)
    hf_start = np.empty(cap, np.int64)
    eng_start = np.empty(cap, np.int64)
    length = np.empty(cap, np.int64)
    r = 0
    i = 0
    while i < n:
        v = np.int64(flat[i])
        if v < lo or v >= hi:
            if v == 0:
                n_const += 1
            elif v < 0:
                n_unwritten += 1
            else:
                n_foreign += 1
            i += 1
            continue
        t = np.searchsorted(bases, v, side="right") - 1
        lim = min(n - i, bases[t + 1] - v)  # the run cannot pass the shadow's or tensor's end
        k = _run_length(flat, i, v, lim)
        if r == cap:
            cap *= 2
            tid, hf_start = _grow(tid, cap), _grow(hf_start, cap)
            eng_start, length = _grow(eng_start, cap), _grow(length, cap)
        tid[r], hf_start[r], eng_start[r], length[r] = t, v - bases[t], i, k
        r += 1
        i += k
    return (n_const, n_unwritten, n_foreign, tid[:r].copy(), hf_start[:r].copy(),
            eng_start[:r].copy(), length[:r].copy())


# a shadow this large is worth a thread of its own (below, the thread costs more than it saves)
PARALLEL_MIN_ELEMENTS = 1 << 22


def scan_shadows(shadows: dict[str, torch.Tensor], bases: np.ndarray,
                 threads: int | None = None) -> dict[str, tuple]:
    """`scan_runs` of every shadow of a group, {name: its result}. Shadows of at least
    PARALLEL_MIN_ELEMENTS are scanned on up to `threads` threads at once (default: torch's
    intra-op threads; `scan_runs` releases the GIL): at a first start the embedding and an untied
    lm_head are two such shadows of one group."""
    flats = {n: sh.view(-1).cpu().numpy() for n, sh in shadows.items()}
    big = [n for n, f in flats.items() if f.shape[0] >= PARALLEL_MIN_ELEMENTS]
    threads = min(threads or torch.get_num_threads(), 8)
    out: dict[str, tuple] = {}
    if threads > 1 and len(big) > 1:
        scanned = thread_map(lambda n: scan_runs(flats[n], bases), big, threads, "stitch-scan")
        out.update(zip(big, scanned, strict=True))
    for n, f in flats.items():
        if n not in out:
            out[n] = scan_runs(f, bases)
    return {n: out[n] for n in flats}
