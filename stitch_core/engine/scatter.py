"""The rank write's hot path: scatter new bits into an engine tensor, read them back, hash them.

One job, about 75 lines. `write_read_back_sum` writes served-view bits at engine positions and
returns the partial fingerprint of what is there *afterwards* (read back after every write of the
call), so the coordinator's check of the summed deltas proves memory, not intent. On CPU, where
the engine keeps the served dtype, that is one numba kernel. Its first pass checks the positions
are in range and whether they strictly rise. Rising positions are distinct: no write of the call
reaches another's element, so each element is read back and hashed right after its block of 256
writes, in one pass over the positions (what a layout of row-major slices gives: the decoder's HF
positions rise, and so do their engine positions). Any other order (two HF elements mapped onto
one engine element, a transposed layout) writes everything first and reads back in a second pass,
so a later write over an earlier one's element shows in the sum. Elsewhere (accelerators, engines
that keep a wider dtype) it is torch's `index_put_`, a gather back and a hash pass
(benchmarks/rank_write.py has the figures of each).
"""

from __future__ import annotations

import numpy as np
import torch

from stitch_core._jit import numba
from stitch_core.format import dtypes
from stitch_core.format import fingerprint as fpr

_h = fpr.element_hash_nb
_RW_BLOCK = 256  # writes per block: their cache lines (at most 16 KiB) stay in any L1


@numba.njit(cache=True, nogil=True)
def _write_read_back_sum(flat, eng, new, hpos, seed, itemsize):  # pragma: no cover - compiled
    """flat[eng[j]] = new[j] for all j, then sum h(hpos[j], flat[eng[j]]) over what is there:
    (True, sum), or (False, 0) with nothing written if a position is out of range."""
    n = flat.shape[0]
    bad = False
    rising = True
    for j in range(eng.shape[0]):
        bad |= (eng[j] < 0) | (eng[j] >= n)
        if j:
            rising &= eng[j] > eng[j - 1]
    if bad:
        return False, np.uint64(0)
    acc = np.uint64(0)
    if rising:
        # distinct positions: no later write of this call reaches an earlier one's element, so
        # what is there at the end is what is there right after its own write. Written and read
        # back a block at a time: the block's stores go out together as index_put_'s do (a read
        # after each store held the core on that store's cache miss: 2.7-3x index_put_ on an
        # AVX2 EPYC at sparse positions), and its reads find the lines still in L1
        m = eng.shape[0]
        for s in range(0, m, _RW_BLOCK):
            e = min(s + _RW_BLOCK, m)
            for j in range(s, e):
                flat[eng[j]] = new[j]
            for j in range(s, e):
                acc += _h(np.int64(hpos[j]), np.int64(flat[eng[j]]), seed, itemsize)
        return True, acc
    for j in range(eng.shape[0]):
        flat[eng[j]] = new[j]
    for j in range(eng.shape[0]):
        acc += _h(np.int64(hpos[j]), np.int64(flat[eng[j]]), seed, itemsize)
    return True, acc


def write_bits(flat: torch.Tensor, eng: torch.Tensor, new_bits: torch.Tensor,
               hf_dtype: torch.dtype) -> None:
    """flat[eng] = the served-dtype values whose integer bits are `new_bits`: bit for bit where
    the engine keeps the served dtype, an exact widening where it keeps a wider one (fp32 bias).
    What `write_read_back_sum` writes, without the read-back (torch; any device)."""
    new_vals = new_bits.view(hf_dtype)
    if flat.dtype == hf_dtype:
        iv = dtypes.info(flat.dtype).int_dtype
        flat.view(iv).index_put_((eng,), new_vals.view(iv))
    else:
        flat.index_put_((eng,), new_vals.to(flat.dtype))


def fused(flat: torch.Tensor, hf_dtype: torch.dtype, eng: torch.Tensor) -> bool:
    """Whether `write_read_back_sum` serves this engine tensor (CPU, the served dtype)."""
    return (flat.device.type == "cpu" and flat.dtype == hf_dtype and flat.is_contiguous()
            and eng.device.type == "cpu")


def write_read_back_sum(name: str, flat: torch.Tensor, eng: torch.Tensor, new_bits: torch.Tensor,
                        hpos: torch.Tensor) -> int:
    """Write `new_bits` (the served dtype's integer bits) at positions `eng` of the flat engine
    tensor `flat`, then return sum h(hpos[j], bits read back at eng[j]) mod 2^64 (`fused` must
    hold)."""
    dt = dtypes.info(flat.dtype)
    iv = dtypes.int_view(flat).numpy()
    new = new_bits.view(dt.int_dtype).numpy()
    e = np.ascontiguousarray(eng.numpy(), dtype=np.int64)
    h = np.ascontiguousarray(hpos.numpy(), dtype=np.int64)
    if not (e.shape == h.shape == new.shape):
        raise ValueError(f"{name}: {e.shape[0]} positions, {h.shape[0]} HF positions, "
                         f"{new.shape[0]} values")
    ok, acc = _write_read_back_sum(iv, e, new, h, fpr.seed_of(name), dt.itemsize)
    if not ok:
        raise ValueError(f"{name}: engine position out of range [0, {iv.shape[0]})")
    return int(acc) & fpr.MASK64
