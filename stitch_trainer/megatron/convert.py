"""Whole conversions: every rank's shards -> HF tensors and back (snapshots and tests), and one
rank's local parameter cut out of HF tensors (the base of a rank's first diff)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch

from stitch_core.format import dtypes

from .layout import MegatronLayout
from .placement import Placement


def assemble_hf(
    state_dicts_by_rank: Mapping[tuple[int, int], Mapping[str, torch.Tensor]],
    layout: MegatronLayout,
    *,
    check_replicas: bool = True,
) -> dict[str, torch.Tensor]:
    """Gather every rank's local parameters ({(tp_rank, pp_rank): state dict}) into HF tensors.

    Raises ValueError when an HF element is written by no rank or by two, or (with
    ``check_replicas``) when a replica differs bitwise from the owner's copy.
    """
    shapes = layout.hf_shapes()
    out: dict[str, torch.Tensor] = {}
    count: dict[str, torch.Tensor] = {}
    replicas: list[tuple[Placement, torch.Tensor, str]] = []
    for (t, pp) in sorted(state_dicts_by_rank):
        for name, local in state_dicts_by_rank[(t, pp)].items():
            for p in layout.to_hf(name, t, pp):
                if not p.owned:
                    replicas.append((p, local, f"{name} on (tp={t}, pp={pp})"))
                    continue
                if p.hf_name not in out:
                    out[p.hf_name] = torch.empty(shapes[p.hf_name], dtype=local.dtype,
                                                 device=local.device)
                    count[p.hf_name] = torch.zeros(out[p.hf_name].numel(), dtype=torch.int32)
                view = out[p.hf_name].view(-1, p.hf_cols)
                rows = p.hf_rows(local.device)
                view[rows, p.col : p.col + p.cols] = p.gather(local)
                count[p.hf_name].view(-1, p.hf_cols)[rows.cpu(), p.col : p.col + p.cols] += 1
    missing = sorted(set(shapes) - set(out))
    if missing:
        raise ValueError(f"no rank holds {missing[0]} ({len(missing)} HF tensors missing)")
    for hf, c in count.items():
        if not bool((c == 1).all()):
            raise ValueError(f"{hf}: {int((c == 0).sum())} elements unwritten, "
                             f"{int((c > 1).sum())} written twice")
    if check_replicas:
        for p, local, where in replicas:
            got = dtypes.int_view(p.gather(local))
            want = dtypes.int_view(out[p.hf_name].view(-1, p.hf_cols)[
                p.hf_rows(local.device), p.col : p.col + p.cols])
            if not torch.equal(got, want):
                raise ValueError(f"replica {where} differs from {p.hf_name}")
    return out


def split_hf(
    hf_state_dict: Mapping[str, torch.Tensor],
    layout: MegatronLayout,
    *,
    pad_value: float = 0.0,
) -> dict[tuple[int, int], dict[str, torch.Tensor]]:
    """HF tensors -> {(tp_rank, pp_rank): Megatron local state dict} (names under
    ``layout.spec``), following the rules of the table; vocabulary padding rows are
    ``pad_value``. Tied embeddings give a replica ``output_layer.weight`` on the last stage when
    pp > 1, as Megatron does."""
    shapes = layout.hf_shapes()
    missing = sorted(set(shapes) - set(hf_state_dict))
    if missing:
        raise KeyError(f"HF state dict lacks {missing[0]} ({len(missing)} missing)")
    for k, s in shapes.items():
        if tuple(hf_state_dict[k].shape) != s:
            raise ValueError(f"{k}: shape {tuple(hf_state_dict[k].shape)}, layout says {s}")
    out: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
    for pp in range(layout.pp):
        for t in range(layout.tp):
            out[(t, pp)] = {
                name: local_from_hf(hf_state_dict, layout, name, t, pp, shape,
                                    pad_value=pad_value)
                for name, shape in layout.megatron_shapes(t, pp).items()
            }
    return out


def hf_names_of(layout: MegatronLayout, names: Iterable[str], tp_rank: int, pp_rank: int,
                *, replicas: bool = True) -> set[str]:
    """The HF tensors the local parameters ``names`` of rank (tp_rank, pp_rank) hold elements of
    (what a rank must read to rebuild its shard from an HF checkpoint)."""
    return {p.hf_name for n in names for p in layout.to_hf(n, tp_rank, pp_rank)
            if p.owned or replicas}


def local_from_hf(
    hf_state_dict: Mapping[str, torch.Tensor],
    layout: MegatronLayout,
    name: str,
    tp_rank: int,
    pp_rank: int,
    shape: Sequence[int] | None = None,
    *,
    pad_value: float = 0.0,
) -> torch.Tensor:
    """One local parameter of rank (tp_rank, pp_rank) cut out of HF tensors (only those
    `hf_names_of` names are needed); vocabulary padding is ``pad_value``. ``shape`` defaults to
    the layout's local shape of ``name``."""
    placements = layout.to_hf(name, tp_rank, pp_rank)
    if shape is None:
        found = layout.rule_of(name, pp_rank)
        if found is None:
            raise KeyError(f"{name}: not a weight")
        shape = layout.local_shape(found[0])
    ref = hf_state_dict[placements[0].hf_name] if placements else next(
        iter(hf_state_dict.values()))
    local = torch.full(tuple(shape), pad_value, dtype=ref.dtype, device=ref.device)
    v = local.view(-1, placements[0].cols if placements else 1)
    for p in placements:
        src = hf_state_dict[p.hf_name].reshape(-1, p.hf_cols)
        v[p.local_rows(local.device)] = src[p.hf_rows(local.device), p.col : p.col + p.cols]
    return local
