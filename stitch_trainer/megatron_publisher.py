"""Megatron-core adapter: publish versions from every TP/PP rank, never gathering the weights.

The loop of `stitch_trainer.fsdp.FSDPPublisher` (per-rank part files, one all-reduce of partial
fingerprints, one all-gather of part metadata, rank 0 writes the manifest, moves `latest` and
announces) with another answer to "which elements does this rank publish": a rank's local
parameters (Megatron names) are mapped to the served Hugging Face tensors with
`stitch_trainer.megatron.shards.shard_parts` (contiguous slices, or scattered positions for
row-parallel tensors with tp > 1) and added to its part with `add_part`.

    layout = MegatronLayout.from_hf_config(hf_config, tp=tp, pp=pp)
    pub = MegatronPublisher(board, "grpo", layout, tp_rank, pp_rank, "bf16", group=mp_group)
    pub.start_from(hf_dir)              # v0: snapshot of the HF checkpoint (written by rank 0)
    for step in ...:
        ...; optimizer.step()
        pub.publish(step, model)        # every rank of the group; a module or a state dict

`group` must hold exactly one rank per (tp_rank, pp_rank) (the model-parallel group of one
data-parallel replica; the other replicas do not publish). At the first publish each rank cuts its
base shard out of the HF checkpoint it started from, reading only the HF tensors it holds elements
of (no communication).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open

from stitch_core.format import dtypes
from stitch_core.format.patch import PatchBuilder
from stitch_core.format.views import project
from stitch_core.versions.board import Board

from .fsdp import FSDPPublisher, PublishError
from .megatron.convert import hf_names_of, local_from_hf
from .megatron.layout import MegatronLayout
from .megatron.shards import add_part, shard_parts


class MegatronPublisher(FSDPPublisher):
    """Publishes versions of a Megatron-core TP/PP model from every rank of `group` (default:
    world), each rank diffing its own local parameters (see the module docstring)."""

    _producer = "megatron"

    def __init__(
        self,
        board: str | Board,
        run: str,
        layout: MegatronLayout,
        tp_rank: int,
        pp_rank: int,
        view: str = "bf16",
        *,
        group: dist.ProcessGroup | None = None,
        nats: str | None = None,
        config_dir: str | Path | None = None,
        spool_dir: str | Path | None = None,
        signing_key: str | Path | None = None,
    ):
        layout.check_rank(tp_rank, pp_rank)
        super().__init__(
            board, run, view, nats=nats, group=group, config_dir=config_dir, spool_dir=spool_dir,
            signing_key=signing_key,
        )
        self.layout, self.tp_rank, self.pp_rank = layout, tp_rank, pp_rank
        self._hf = layout.hf_shapes()
        coords: list = [None] * self.world
        dist.all_gather_object(coords, (tp_rank, pp_rank), group=self.group)
        want = sorted((t, p) for t in range(layout.tp) for p in range(layout.pp))
        if sorted(coords) != want:
            self.close()
            raise ValueError(
                f"the group's ranks hold (tp, pp) = {coords}; a MegatronPublisher group needs "
                f"each of the {layout.tp * layout.pp} ranks of tp={layout.tp}, pp={layout.pp} once"
            )

    # -------------------------------------------------------------- what this rank publishes

    def _local_plan(self, module) -> tuple[dict[str, tuple[int, ...]], object]:
        """Every HF tensor of the layout; the plan is this rank's local parameters that land
        somewhere it owns (replicas, padding-only shards and `_extra_state` are left out).
        Never raises (a bad name fails phase 1 on this rank, so no rank hangs)."""
        sd = module.state_dict() if isinstance(module, torch.nn.Module) else dict(module)
        local: dict[str, torch.Tensor] = {}
        error = None
        for name, t in sd.items():
            if not isinstance(t, torch.Tensor):
                continue
            try:
                placed = self.layout.to_hf(name, self.tp_rank, self.pp_rank)
            except KeyError as e:
                error = error or e
                continue
            if any(p.owned for p in placed):
                local[name] = t.detach()
        return dict(self._hf), (local, error)

    def _diff_local(
        self, builder: PatchBuilder, plan
    ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        local, error = plan
        if error is not None:
            raise error
        with torch.no_grad():
            new = project(local, self.view)
        new = {n: t.to("cpu") for n, t in new.items()}  # host copy of this rank's shard only
        if self._prev is None:
            self._prev = self._read_base(new)
        differ = sorted(set(new) ^ set(self._prev))
        if differ:
            raise PublishError(f"{differ[0]}: this rank's parameters changed since the last "
                               f"version ({len(differ)} names differ)")
        dtype = next(iter(new.values())).dtype if new else None
        parts = shard_parts(self._prev, new, self.layout, self.tp_rank, self.pp_rank, dtype=dtype)
        for part in parts:
            add_part(builder, part)
        return new, {p.name: dtypes.info(p.dtype).name for p in parts}

    def _read_base(self, like: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's base shard (local names and shapes of `like`), cut out of the checkpoint
        of the base version; only the HF tensors it owns elements of are read."""
        ck = self._base_ck
        assert ck is not None
        need = hf_names_of(self.layout, like, self.tp_rank, self.pp_rank, replicas=False)
        hf: dict[str, torch.Tensor] = {}
        for shard, names in ck.shards.items():
            wanted = [n for n in names if n in need]
            if not wanted:
                continue
            with safe_open(ck.file(shard), framework="pt") as f:
                for n in wanted:
                    hf[n] = f.get_tensor(n)
        missing = sorted(need - set(hf))
        if missing:
            raise ValueError(f"{ck.path} lacks {missing[0]} ({len(missing)} HF tensors missing)")
        for n, t in hf.items():
            if tuple(t.shape) != self._hf[n]:
                raise ValueError(f"{n}: {tuple(t.shape)} in {ck.path}, {self._hf[n]} in layout")
        hf = project(hf, self.view)
        return {
            n: local_from_hf(hf, self.layout, n, self.tp_rank, self.pp_rank, tuple(t.shape))
            for n, t in like.items()
        }
