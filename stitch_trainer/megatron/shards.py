"""Shard-local diffing: this rank's share of every HF tensor, as parts of a multi-part patch.

A rank diffs its own local parameters (Megatron names) and names the changed elements by their
global HF flat positions (`shard_parts`), without gathering anything; `add_part` adds each part
to a `stitch_core.format.patch.PatchBuilder`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from stitch_core.format import dtypes
from stitch_core.format import fingerprint as fpr

from .layout import MegatronLayout
from .placement import Placement


@dataclass
class ShardPart:
    """This rank's share of one HF tensor, in the form a multi-part PatchBuilder takes.

    Contiguous (``offset`` set): ``base``/``new`` are this rank's elements of a contiguous flat
    slice of the HF tensor starting at ``offset`` (in HF order) -> ``PatchBuilder.add(name, base,
    new, shape=shape, offset=offset)``. An empty slice means the rank holds none of the tensor
    (every part of a multi-part patch lists every tensor).

    Scattered (``positions`` set; row-parallel tensors with tp > 1, whose rank-local columns are
    strided in HF flat order): the sorted global flat ``positions`` of the changed elements, their
    ``old``/``new_bits`` (integer views, `stitch_core.format.dtypes.int_view`), and ``base_fp``, the
    partial fingerprint over every element this rank owns -> the ``add_positions`` API of
    `add_part`.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int | None = None
    base: torch.Tensor | None = None
    new: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    old: torch.Tensor | None = None
    new_bits: torch.Tensor | None = None
    base_fp: int | None = None

    @property
    def scattered(self) -> bool:
        return self.positions is not None


def add_part(builder: Any, part: ShardPart) -> Any:
    """Add one `ShardPart` to a `stitch_core.format.patch.PatchBuilder`."""
    if not part.scattered:
        return builder.add(part.name, part.base, part.new, shape=part.shape, offset=part.offset)
    if not hasattr(builder, "add_positions"):
        raise NotImplementedError(
            f"{part.name}: a row-parallel shard with tp > 1 needs PatchBuilder.add_positions"
        )
    return builder.add_positions(
        part.name, part.positions, part.old, part.new_bits,
        dtype=part.dtype, shape=part.shape, base_fp=part.base_fp,
    )


def merge_scattered(parts: Sequence[ShardPart]) -> ShardPart:
    """One scattered part from several ranks' scattered parts of the same tensor (e.g. gathered
    over the TP group so that a single part carries a row-parallel tensor): positions merged in
    order, partial fingerprints summed."""
    if not parts or any(not p.scattered or p.name != parts[0].name for p in parts):
        raise ValueError("merge_scattered needs scattered parts of one tensor")
    pos = torch.cat([p.positions for p in parts])
    order = torch.argsort(pos)
    old = torch.cat([p.old for p in parts])[order]
    new = torch.cat([p.new_bits for p in parts])[order]
    if bool((pos[order][1:] == pos[order][:-1]).any()):
        raise ValueError(f"{parts[0].name}: two parts hold the same position")
    fp = sum(p.base_fp or 0 for p in parts) & fpr.MASK64
    return ShardPart(parts[0].name, parts[0].shape, parts[0].dtype, positions=pos[order],
                     old=old, new_bits=new, base_fp=fp)


def _partial_fp(name: str, p: Placement, block: torch.Tensor, rows_per_step: int) -> int:
    """Fingerprint terms of the gathered ``block`` (HF order) at its scattered HF positions."""
    dt = dtypes.info(block.dtype)
    seed = fpr.seed_of(name)
    hrows = p.hf_rows(block.device)
    total = 0
    for s in range(0, block.shape[0], rows_per_step):
        pos = p.hf_positions(hrows[s : s + rows_per_step]).reshape(-1)
        total += fpr.partial_sum(pos, dtypes.int_view(block[s : s + rows_per_step]), dt.itemsize,
                                 seed)
    return total & fpr.MASK64


def shard_parts(
    prev: Mapping[str, torch.Tensor],
    new: Mapping[str, torch.Tensor],
    layout: MegatronLayout,
    tp_rank: int,
    pp_rank: int,
    *,
    dtype: torch.dtype | None = None,
    block_elements: int = 1 << 22,
) -> list[ShardPart]:
    """This rank's `ShardPart` of every HF tensor of the model, sorted by HF name.

    ``prev``/``new``: the rank's local parameters (Megatron names) of two versions, already in
    the served dtype (an elementwise view such as bf16 can be projected shard-locally).
    Parameters landing nowhere, replicas and ``_extra_state`` are skipped; every other local
    parameter must be in both. ``dtype`` (default: that of the local tensors) is used for the
    empty parts of tensors this rank does not hold.
    """
    held: dict[str, ShardPart] = {}
    for name in sorted(new):
        placements = [p for p in layout.to_hf(name, tp_rank, pp_rank) if p.owned]
        if not placements:
            continue
        b, n = prev[name], new[name]
        if b.shape != n.shape or b.dtype != n.dtype:
            raise ValueError(f"{name}: versions differ in shape or dtype")
        for p in placements:
            gb, gn = p.gather(b), p.gather(n)
            sl = p.hf_slice
            if sl is not None:
                held[p.hf_name] = ShardPart(p.hf_name, p.hf_shape, n.dtype, offset=sl[0],
                                            base=gb.reshape(-1), new=gn.reshape(-1))
                continue
            bv, nv = dtypes.int_view(gb), dtypes.int_view(gn)
            idx = torch.nonzero(bv != nv).reshape(-1)
            hrows = p.hf_rows(idx.device)
            pos = hrows[idx // p.cols] * p.hf_cols + p.col + idx % p.cols
            held[p.hf_name] = ShardPart(
                p.hf_name, p.hf_shape, n.dtype, positions=pos, old=bv[idx], new_bits=nv[idx],
                base_fp=_partial_fp(p.hf_name, p, gb, max(1, block_elements // p.cols)),
            )
    if dtype is None:
        dtype = next(iter(new.values())).dtype if new else torch.bfloat16
    empty = torch.empty(0, dtype=dtype)
    return [
        held[hf] if hf in held else ShardPart(hf, shape, dtype, offset=0, base=empty, new=empty)
        for hf, shape in layout.hf_shapes().items()
    ]
