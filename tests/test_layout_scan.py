"""Layout learning's shadow scan and buffer pool (stitch_core.engine.layout_scan)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from stitch_core.engine import layout_scan
from stitch_core.engine.layout_scan import IndexPool, scan_runs


def reference_scan(flat: np.ndarray, bases: np.ndarray):
    """The scan's contract in plain Python: runs of consecutive index values at consecutive
    positions within one tensor; counts of constants (0), unwritten (-1) and foreign values."""
    lo, hi = int(bases[0]), int(bases[-1])
    const = unwritten = foreign = 0
    runs: list[list[int]] = []
    prev, end = None, None
    for i, v in enumerate(flat.tolist()):
        if v < lo or v >= hi:
            const += v == 0
            unwritten += v < 0
            foreign += v > 0
            prev = None
            continue
        if prev is not None and v == prev + 1 and v < end:
            runs[-1][3] += 1
        else:
            t = int(np.searchsorted(bases, v, side="right")) - 1
            runs.append([t, v - int(bases[t]), i, 1])
            end = int(bases[t + 1])
        prev = v
    return const, unwritten, foreign, runs


def check(flat: np.ndarray, bases: np.ndarray) -> None:
    c, u, f, tid, hf, eng, length = scan_runs(flat, bases)
    rc, ru, rf, runs = reference_scan(flat, bases)
    assert (c, u, f) == (rc, ru, rf)
    got = np.stack([tid, hf, eng, length], axis=1).tolist() if len(tid) else []
    assert got == runs


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
@pytest.mark.parametrize("seed", range(12))
def test_scan_matches_the_reference_on_mixed_shadows(dtype, seed):
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 60, size=int(rng.integers(1, 5)))
    bases = np.concatenate([[1], 1 + np.cumsum(sizes)]).astype(np.int64)
    parts = []
    for _ in range(int(rng.integers(1, 12))):
        kind = rng.integers(0, 6)
        if kind <= 2:  # a run (possibly crossing into the next tensor's values)
            start = int(rng.integers(bases[0], bases[-1]))
            n = int(rng.integers(1, 40))
            parts.append(np.arange(start, min(start + n, int(bases[-1]) + 3)))
        elif kind == 3:
            parts.append(np.zeros(int(rng.integers(1, 5))))
        elif kind == 4:
            parts.append(-np.ones(int(rng.integers(1, 5))))
        else:
            parts.append(int(bases[-1]) + rng.integers(0, 100, size=int(rng.integers(1, 3))))
    flat = np.concatenate(parts).astype(dtype)
    check(flat, bases)


def test_long_runs_and_breaks_at_every_offset_of_the_block_check():
    bases = np.array([1, 1001, 3001], dtype=np.int64)
    for brk in range(1, 3 * layout_scan.RUN_BLOCK + 2):
        flat = np.arange(1, 200, dtype=np.int32)
        flat[brk] += 7  # breaks the run at offset brk
        check(flat, bases)
        for tail in (brk + 1, brk + layout_scan.RUN_BLOCK - 1):  # runs that end near the break
            check(flat[:tail], bases)
    # a run that reaches a tensor's end continues as a new run in the next tensor
    check(np.arange(990, 1020, dtype=np.int32), bases)
    check(np.arange(1, 3001, dtype=np.int32), bases)  # every element, two runs


def test_many_runs_grow_the_output():
    bases = np.array([1, 100001], dtype=np.int64)
    flat = np.arange(1, 100001, 2, dtype=np.int32)  # every value its own run: 50,000 runs
    c, u, f, tid, hf, eng, length = scan_runs(flat, bases)
    assert len(tid) == 50000 and (length == 1).all()
    assert (hf == np.arange(0, 100000, 2)).all() and (eng == np.arange(50000)).all()


def test_empty_and_all_special():
    bases = np.array([1, 11], dtype=np.int64)
    check(np.zeros(0, dtype=np.int32), bases)
    check(np.array([0, -1, 0, 50, -1], dtype=np.int32), bases)


def test_pool_reuses_and_grows():
    pool = IndexPool()
    a = pool.take("shadow", 100, torch.int32)
    b = pool.take("shadow", 50, torch.int32)
    assert b.data_ptr() == a.data_ptr()  # the same memory, no new allocation
    c = pool.take("index", 50, torch.int32)
    assert c.data_ptr() != a.data_ptr()  # another purpose: its own buffer
    d = pool.take("shadow", 200, torch.int32)
    assert d.numel() == 200 and pool.take("shadow", 10, torch.int64).dtype == torch.int64


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_shadows_scanned_on_threads_match_one_by_one(monkeypatch, threads):
    """`scan_shadows` gives every shadow of a group its own `scan_runs` result, in the group's
    order, whether the large ones are scanned on threads or not (here every shadow is large)."""
    monkeypatch.setattr(layout_scan, "PARALLEL_MIN_ELEMENTS", 8)
    rng = np.random.default_rng(7)
    bases = np.array([1, 4001, 9001, 9501], dtype=np.int64)
    shadows = {}
    for name, n, off in (("embed", 4500, 0), ("norm", 7, 3998), ("lm_head", 5200, 300),
                         ("bias", 3000, -50)):  # runs that cross tensors, constants, foreign
        flat = np.where(rng.random(n) < 0.05, -1, np.arange(n) % 9600 + off).astype(np.int32)
        shadows[name] = torch.from_numpy(flat).view(-1, 1)
    got = layout_scan.scan_shadows(shadows, bases, threads=threads)
    assert list(got) == list(shadows)
    for name, sh in shadows.items():
        want = scan_runs(sh.view(-1).numpy(), bases)
        assert [np.asarray(x).tolist() for x in got[name]] == [np.asarray(x).tolist()
                                                             for x in want]
        assert got[name][3].size > 1  # several runs: a result worth comparing
