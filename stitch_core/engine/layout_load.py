"""Loading a group's index tensors through the model's own loaders into integer shadows.

One job, about 220 lines: `layout.learn_layout` learns where each HF element lives by swapping a
group's engine parameters for integer shadows (filled with -1) and having the model's
``load_weights`` fill them with index values; this module makes those loads. What is loaded
decides the transient memory of learning:

* **split** (on a rank that holds a shard of the group): two loads. The first carries each HF
  element's *row id* (its position over every dimension but the last), the second its *column
  id* (the last dimension); each is an ``expand``-ed view of one ``arange`` of rows (or columns)
  elements, so nothing of the HF tensor's full size is allocated. Whatever the loaders narrow,
  concatenate, pad, duplicate or transpose, they do alike to both loads, so each shadow element
  holds its HF element's row after the first and its column after the second; `combine_ids`
  turns the pair into the flat index ``base[t] + hf_flat_pos`` the scan reads (marked foreign
  where the two disagree). A rank's memory is two shadows of its own elements. The full index
  would be the group's whole HF size on every rank: learning one rank of a Llama-3-70B-shaped
  model at TP8 held 9.9 GB that way and 3.0 GB this way (benchmarks/layout_memory.py).
* **full**: one load of ``arange`` tensors in HF shape (the group's whole HF size). Used on a
  rank that holds the whole group (TP=1: the same memory as split, in one load and without the
  combine: 0.3-0.4 s less at 0.63B, benchmarks/startup.py), for a group whose split load raised
  (a loader that ``.view``-s its input in a way an expanded, stride-0 view refuses), for a
  group whose two loads disagree on some element (a loader that computes with the values, or
  acts on its first call only: the full index then shows what it does), and when the shadows
  live off the CPU (`combine_ids` runs on the host).

Both put the same values in the shadows (`tests/test_layout.py` learns its engines both ways).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch

from stitch_core._jit import numba
from stitch_core.engine.layout_scan import PARALLEL_MIN_ELEMENTS, IndexPool
from stitch_core.engine.threads import thread_map
from stitch_core.errors import StitchError

log = logging.getLogger("stitch.layout")

Shapes = Mapping[str, tuple[tuple[int, ...], torch.dtype]]

__all__ = ["SplitMismatchError", "load_group", "combine_ids", "starts"]


def starts(sizes: list[int]) -> np.ndarray:
    """Per-tensor first index value, from 1 (0: a constant written by a loader, -1: untouched);
    the last entry is one past the group's last value."""
    out = np.ones(len(sizes) + 1, dtype=np.int64)
    out[1:] += np.cumsum(np.asarray(sizes, dtype=np.int64))
    return out


def _rows_cols(shape: tuple[int, ...]) -> tuple[int, int]:
    if not shape:
        return 1, 1
    n = int(np.prod(shape, dtype=np.int64))
    return (n // shape[-1], shape[-1]) if n else (0, 0)


def _ids(shape: tuple[int, ...], first: int, rows: bool, dtype: torch.dtype) -> torch.Tensor:
    """Row (or column) ids of a tensor of `shape`, from `first`, as a view of one small arange."""
    r, c = _rows_cols(shape)
    if not shape:
        return torch.tensor(first, dtype=dtype)
    if r == 0:
        return torch.empty(shape, dtype=dtype)
    if rows:
        return torch.arange(first, first + r, dtype=dtype).view(*shape[:-1], 1).expand(shape)
    return torch.arange(first, first + c, dtype=dtype).expand(shape)


def _shadow_load(model: torch.nn.Module, g_params: Mapping[str, torch.nn.Parameter],
                 buf: torch.Tensor, tensors: Iterator[tuple[str, torch.Tensor]]
                 ) -> tuple[dict[str, torch.Tensor], Any]:
    """One ``load_weights(tensors)`` with each param of the group swapped for its view of `buf`
    (filled with -1); the params get their own data back whatever happens. (shadows, what the
    loader returned)."""
    saved: dict[str, torch.Tensor] = {}
    saved_rg: dict[str, bool] = {}
    shadows: dict[str, torch.Tensor] = {}
    try:
        off = 0
        for n, p in g_params.items():
            saved[n] = p.data
            saved_rg[n] = p.requires_grad
            p.requires_grad_(False)  # int .data is refused on grad params
            shadows[n] = buf[off:off + p.numel()].view(tuple(p.shape)).fill_(-1)
            off += p.numel()
            p.data = shadows[n]
        loaded = model.load_weights(tensors)
    finally:
        for n, p in g_params.items():
            if n in saved:
                p.data = saved[n]
                p.requires_grad_(saved_rg[n])
    return shadows, loaded


def _load_full(model, group, names, shapes: Shapes, g_params, n_shadow: int, pool: IndexPool,
               device, dtype, bases) -> tuple[dict[str, torch.Tensor], list[Any]]:
    ibuf = pool.take("index", int(bases[-1] - bases[0]), dtype)

    def index_tensors():
        for i, n in enumerate(names):  # each its own region of the pool
            lo, hi = int(bases[i]), int(bases[i + 1])
            out = ibuf[lo - 1:hi - 1]
            torch.arange(lo, hi, dtype=dtype, out=out)
            yield n, out.view(shapes[n][0])

    sbuf = pool.take("shadow", n_shadow, dtype, device)
    try:
        shadows, loaded = _shadow_load(model, g_params, sbuf, index_tensors())
    except (AttributeError, TypeError) as e:  # e.g. a plain Parameter, no loader
        raise RuntimeError(
            f"layout learning for group {group!r}: the model's loader failed on its parameters "
            f"({type(e).__name__}: {e}): a post-load step replaced them without their loaders "
            "(a quantized kernel no keeper follows)") from e
    return shadows, [loaded]


def _load_split(model, names, shapes: Shapes, g_params, n_shadow: int, pool: IndexPool, device,
                dtype, bases) -> tuple[dict[str, torch.Tensor], list[Any]]:
    rc = [_rows_cols(shapes[n][0]) for n in names]
    row0, col0 = starts([r for r, _ in rc]), starts([c for _, c in rc])
    cols = np.asarray([c for _, c in rc], dtype=np.int64)
    a, la = _shadow_load(model, g_params, pool.take("shadow", n_shadow, dtype, device),
                         ((n, _ids(shapes[n][0], int(row0[i]), True, dtype))
                          for i, n in enumerate(names)))
    b, lb = _shadow_load(model, g_params, pool.take("shadow-col", n_shadow, dtype, device),
                         ((n, _ids(shapes[n][0], int(col0[i]), False, dtype))
                          for i, n in enumerate(names)))

    def combine(n: str) -> int:
        x, y = a[n].view(-1).numpy(), b[n].view(-1).numpy()
        return combine_ids(x, y, row0, col0, cols, bases, x)  # in place: a becomes the index

    big = [n for n in a if a[n].numel() >= PARALLEL_MIN_ELEMENTS]
    foreign = sum(thread_map(combine, big, min(torch.get_num_threads(), 8), "stitch-combine"))
    foreign += sum(combine(n) for n in a if n not in big)
    if foreign:
        # the two loads disagree (a loader that computes with the values, or one that acts on
        # its first call only): the full index decides, in one load, what the loaders do
        raise SplitMismatchError(f"{foreign} elements whose row and column ids disagree")
    return a, [la, lb]


class SplitMismatchError(StitchError, RuntimeError):
    """The row and column loads of a group did not place the same elements alike."""


def load_group(model: torch.nn.Module, group: str, names: list[str], shapes: Shapes,
               g_params: Mapping[str, torch.nn.Parameter], pool: IndexPool,
               device: str | torch.device, dtype: torch.dtype, bases: np.ndarray,
               split: bool | None = None) -> tuple[dict[str, torch.Tensor], list[Any], str]:
    """Shadows of the group's params holding ``bases[t] + hf_flat_pos`` of the HF element each
    engine element came from (0 constant, -1 untouched, anything else foreign), the loader's
    return values, and how it was loaded ("split" or "full"). `split` None: split where the
    rank's shadows are fewer elements than the group's HF tensors (it holds a shard: two shadows
    are then less memory than the full index and one shadow; on a rank holding everything they
    are the same, and one load is faster than two loads and the combine)."""
    n_shadow = sum(int(p.numel()) for p in g_params.values())  # the rank's elements
    if split is None:
        split = n_shadow < int(bases[-1] - bases[0])
    if split and torch.device(device).type == "cpu":
        try:
            shadows, loaded = _load_split(model, names, shapes, g_params, n_shadow, pool,
                                          device, dtype, bases)
            return shadows, loaded, "split"
        except Exception as e:  # noqa: BLE001 - any loader failure: the full index
            log.warning("stitch: layout learning for group %r: the split index load failed "
                        "(%s: %s); loading the full index (%.2f GB)", group, type(e).__name__,
                        e, int(bases[-1] - bases[0]) * dtype.itemsize / 1e9)
    shadows, loaded = _load_full(model, group, names, shapes, g_params, n_shadow, pool, device,
                                 dtype, bases)
    return shadows, loaded, "full"


# elements checked at once on the fast path of `combine_ids` (one branch per block: the loop
# over a block vectorises; 1.6 ns per element on one thread, against 6.6 one at a time)
COMBINE_BLOCK = 64


@numba.njit(cache=True, nogil=True)
def combine_ids(a, b, row0, col0, cols, bases, out):  # pragma: no cover - compiled
    """Per shadow element, its row id `a` and column id `b` -> the flat index value the scan
    reads: ``bases[t] + row * cols[t] + col`` when both name tensor t, -1 / 0 where both are
    -1 / 0 (untouched / a loader's constant), ``bases[-1]`` (foreign) otherwise. `out` may be
    `a`. A block of COMBINE_BLOCK elements all inside the tensor of the block before is done
    without a branch per element; any other block one element at a time. Returns the count of
    foreign elements."""
    nt = row0.shape[0] - 1
    foreign = bases[nt]
    n = a.shape[0]
    n_foreign = 0
    t = 0
    i = 0
    while i < n:
        if i + COMBINE_BLOCK <= n:
            lo_r, hi_r, lo_c, hi_c = row0[t], row0[t + 1], col0[t], col0[t + 1]
            bad = False
            for q in range(COMBINE_BLOCK):
                x = np.int64(a[i + q])
                y = np.int64(b[i + q])
                bad |= (x < lo_r) | (x >= hi_r) | (y < lo_c) | (y >= hi_c)
            if not bad:
                c = cols[t]
                base = bases[t] - lo_r * c - lo_c
                for q in range(COMBINE_BLOCK):
                    out[i + q] = base + np.int64(a[i + q]) * c + np.int64(b[i + q])
                i += COMBINE_BLOCK
                continue
        for j in range(i, min(i + COMBINE_BLOCK, n)):
            x = np.int64(a[j])
            y = np.int64(b[j])
            if x < row0[0] or x >= row0[nt] or y < col0[0] or y >= col0[nt]:
                if x == y and x <= 0:
                    out[j] = x
                else:
                    out[j] = foreign
                    n_foreign += 1
                continue
            if x < row0[t] or x >= row0[t + 1]:
                t = np.searchsorted(row0, x, side="right") - 1
            if y < col0[t] or y >= col0[t + 1]:
                out[j] = foreign
                n_foreign += 1
            else:
                out[j] = bases[t] + (x - row0[t]) * cols[t] + (y - col0[t])
        i += COMBINE_BLOCK
    return n_foreign
