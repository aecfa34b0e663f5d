"""`MegatronLayout`: model dimensions and parallel sizes, and the mapping they imply.

Given the architecture's table (`stitch_trainer.megatron.tables`), the layout names every HF
tensor and every rank's local parameters with their shapes, and maps a local parameter to its
`Placement`s (`to_hf`) or local flat positions to global HF flat positions (`map_positions`).
Layer names carry the stage-local index; ``global = layout.layer_offset(pp_rank) + local``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from .placement import Placement
from .tables import ARCHS, LAYER, MODEL_TYPES, Rule

_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.")
IGNORED_SUFFIXES = ("._extra_state",)  # Transformer Engine state, not weights


@dataclass(frozen=True)
class MegatronLayout:
    """Model dimensions and parallel sizes: everything the mapping depends on.

    ``pipeline_layers``: decoder layers per PP stage (default: an even split, as Megatron does
    without ``num_layers_in_first/last_pipeline_stage``). ``spec``: "te" (Transformer Engine
    layer spec: input/pre-MLP norms fused into ``linear_qkv`` / ``linear_fc1`` as
    ``layer_norm_weight``) or "local" (separate ``input_layernorm`` / ``pre_mlp_layernorm``);
    `to_hf` accepts both names either way, `split_hf` emits this one.
    """

    arch: str
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    padded_vocab: int
    num_layers: int
    tp: int = 1
    pp: int = 1
    tie_embeddings: bool = False
    spec: Literal["te", "local"] = "te"
    pipeline_layers: tuple[int, ...] | None = None
    _index: dict[str, Rule] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"unknown arch {self.arch!r}; registered: {', '.join(ARCHS)}")
        if self.pipeline_layers is None:
            if self.num_layers % self.pp:
                raise ValueError(f"{self.num_layers} layers do not split evenly over pp="
                                 f"{self.pp}: pass pipeline_layers")
            object.__setattr__(self, "pipeline_layers", (self.num_layers // self.pp,) * self.pp)
        pl = self.pipeline_layers
        if len(pl) != self.pp or sum(pl) != self.num_layers or min(pl) < 0:
            raise ValueError(f"pipeline_layers {pl} is not a split of {self.num_layers} layers "
                             f"over pp={self.pp}")
        checks = [
            (self.num_heads % self.num_kv_heads == 0, "num_heads % num_kv_heads"),
            (self.num_kv_heads % self.tp == 0, "num_kv_heads % tp"),
            (self.ffn % self.tp == 0, "ffn % tp"),
            (self.hidden % self.tp == 0, "hidden % tp"),
            (self.padded_vocab % self.tp == 0, "padded_vocab % tp"),
            (self.padded_vocab >= self.vocab, "padded_vocab >= vocab"),
        ]
        bad = [what for ok, what in checks if not ok]
        if bad:
            raise ValueError(f"layout not shardable: {', '.join(bad)} fails")
        for r in ARCHS[self.arch]:
            self._index[r.megatron] = r
            if r.local:
                self._index[r.local] = r

    @classmethod
    def from_hf_config(
        cls,
        config: Any,
        tp: int = 1,
        pp: int = 1,
        padded_vocab: int | None = None,
        *,
        arch: str | None = None,
        make_vocab_size_divisible_by: int = 128,
        **kw: Any,
    ) -> MegatronLayout:
        """The layout of an HF config (``transformers`` config or a dict). Without
        ``padded_vocab``, the vocabulary is padded as Megatron does: to a multiple of
        ``make_vocab_size_divisible_by * tp``."""
        get = config.get if isinstance(config, Mapping) else (
            lambda k, d=None: getattr(config, k, d)
        )
        mt = get("model_type")
        arch = arch or MODEL_TYPES.get(mt)
        if arch is None:
            raise ValueError(f"no Megatron table for model_type {mt!r}: pass arch= or "
                             "register_arch(..., model_types=...)")
        heads, hidden, vocab = get("num_attention_heads"), get("hidden_size"), get("vocab_size")
        if padded_vocab is None:
            m = make_vocab_size_divisible_by * tp
            padded_vocab = -(-vocab // m) * m
        return cls(
            arch=arch,
            hidden=hidden,
            num_heads=heads,
            num_kv_heads=get("num_key_value_heads") or heads,
            head_dim=get("head_dim") or hidden // heads,
            ffn=get("intermediate_size"),
            vocab=vocab,
            padded_vocab=padded_vocab,
            num_layers=get("num_hidden_layers"),
            tp=tp,
            pp=pp,
            tie_embeddings=bool(get("tie_word_embeddings", False)),
            **kw,
        )

    # ------------------------------------------------------------- dimensions

    @property
    def rules(self) -> tuple[Rule, ...]:
        return ARCHS[self.arch]

    @property
    def dims(self) -> dict[str, int]:
        return {
            "hidden": self.hidden,
            "ffn": self.ffn,
            "vocab": self.vocab,
            "head_dim": self.head_dim,
            "q": self.num_heads * self.head_dim,
            "kv": self.num_kv_heads * self.head_dim,
        }

    def layer_offset(self, pp_rank: int) -> int:
        """Global index of the first decoder layer on PP stage ``pp_rank``."""
        assert self.pipeline_layers is not None
        return sum(self.pipeline_layers[:pp_rank])

    def _stage_has(self, r: Rule, pp_rank: int) -> bool:
        return r.stage == "layer" or (
            pp_rank == 0 if r.stage == "first" else pp_rank == self.pp - 1
        )

    def _hf_names(self, r: Rule, layer: int | None) -> tuple[str, ...]:
        if self.tie_embeddings and r.tied:
            return (r.tied,)
        return tuple(n.replace(LAYER, str(layer)) for n in r.hf) if layer is not None else r.hf

    def _hf_shapes(self, r: Rule) -> list[tuple[int, ...]]:
        d = self.dims
        rows = [d["q"], d["kv"], d["kv"]] if r.shape[0] == "qkv" else [d[r.shape[0]]] * len(r.hf)
        tail = tuple(d[s] for s in r.shape[1:])
        return [(n, *tail) for n in rows]

    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every HF tensor of the model and its shape, sorted by name."""
        out: dict[str, tuple[int, ...]] = {}
        for r in self.rules:
            if self.tie_embeddings and r.tied:
                continue
            layers: Iterable[int | None] = range(self.num_layers) if r.stage == "layer" else [None]
            for layer in layers:
                out.update(zip(self._hf_names(r, layer), self._hf_shapes(r), strict=True))
        return dict(sorted(out.items()))

    def local_shape(self, r: Rule) -> tuple[int, ...]:
        """The shape of rule ``r``'s local parameter on every TP rank."""
        shapes = self._hf_shapes(r)
        rows, tail = shapes[0][0], shapes[0][1:]
        tp = self.tp
        if r.kind == "replicated":
            return shapes[0]
        if r.kind == "row":
            return (rows, tail[0] // tp, *tail[1:])
        if r.kind == "vocab":
            return (self.padded_vocab // tp, *tail)
        if r.kind == "qkv":
            return (sum(s[0] for s in shapes) // tp, *tail)
        if r.kind == "gate_up":
            return (2 * rows // tp, *tail)
        if rows % tp:
            raise ValueError(f"{r.megatron}: {rows} rows do not split over tp={tp}")
        return (rows // tp, *tail)

    def megatron_shapes(self, tp_rank: int, pp_rank: int) -> dict[str, tuple[int, ...]]:
        """The local parameters of rank (tp_rank, pp_rank) (names under this ``spec``)."""
        self.check_rank(tp_rank, pp_rank)
        out: dict[str, tuple[int, ...]] = {}
        assert self.pipeline_layers is not None
        for r in self.rules:
            if not self._stage_has(r, pp_rank):
                continue
            if r.tied and self.tie_embeddings and self.pp == 1:
                continue  # Megatron reuses the embedding; no output_layer.weight on one stage
            name = r.local if (self.spec == "local" and r.local) else r.megatron
            shape = self.local_shape(r)
            if r.stage == "layer":
                for i in range(self.pipeline_layers[pp_rank]):
                    out[name.replace(LAYER, str(i))] = shape
            else:
                out[name] = shape
        return out

    def check_rank(self, tp_rank: int, pp_rank: int) -> None:
        if not (0 <= tp_rank < self.tp and 0 <= pp_rank < self.pp):
            raise ValueError(f"rank (tp={tp_rank}, pp={pp_rank}) outside tp={self.tp}, "
                             f"pp={self.pp}")

    # ------------------------------------------------------------- the mapping

    def rule_of(self, name: str, pp_rank: int) -> tuple[Rule, int | None] | None:
        """(rule, global layer or None) of a local parameter name; None for ignored state.
        Raises KeyError for an unknown name."""
        while name.startswith("module."):  # DDP / Float16Module wrappers
            name = name[len("module."):]
        if name.endswith(IGNORED_SUFFIXES):
            return None
        m = _LAYER_RE.match(name)
        layer = None
        key = name
        if m:
            local = int(m.group(1))
            assert self.pipeline_layers is not None
            if local >= self.pipeline_layers[pp_rank]:
                raise KeyError(f"{name}: stage {pp_rank} has {self.pipeline_layers[pp_rank]} "
                               "layers")
            layer = self.layer_offset(pp_rank) + local
            key = f"decoder.layers.{LAYER}." + name[m.end():]
        r = self._index.get(key)
        if r is None:
            raise KeyError(f"{name}: no rule in the {self.arch!r} table")
        if not self._stage_has(r, pp_rank):
            raise KeyError(f"{name}: not held by PP stage {pp_rank}")
        return r, layer

    def to_hf(self, name: str, tp_rank: int, pp_rank: int) -> list[Placement]:
        """Where the elements of local parameter ``name`` on rank (tp_rank, pp_rank) land.

        Elements covered by no placement (vocabulary padding) land nowhere. Replicas come back
        with ``owned=False``. ``_extra_state`` entries give []; unknown names raise KeyError.
        """
        self.check_rank(tp_rank, pp_rank)
        found = self.rule_of(name, pp_rank)
        if found is None:
            return []
        r, layer = found
        names, shapes = self._hf_names(r, layer), self._hf_shapes(r)
        tp, t = self.tp, tp_rank
        owned = not (self.tie_embeddings and r.tied)
        cols = math.prod(shapes[0][1:])
        if r.kind == "replicated":
            return [Placement(names[0], shapes[0], cols, shapes[0][0], owned=owned and t == 0)]
        if r.kind == "column":
            n = shapes[0][0] // tp
            return [Placement(names[0], shapes[0], cols, n, hf_row=t * n, owned=owned)]
        if r.kind == "row":
            c = shapes[0][1] // tp
            return [Placement(names[0], shapes[0], c, shapes[0][0], col=t * c, owned=owned)]
        if r.kind == "vocab":
            n = self.padded_vocab // tp
            real = max(0, min(n, self.vocab - t * n))  # rows past the vocabulary are padding
            if real == 0:
                return []
            return [Placement(names[0], shapes[0], cols, real, hf_row=t * n, owned=owned)]
        if r.kind == "gate_up":
            n = shapes[0][0] // tp
            return [
                Placement(names[0], shapes[0], cols, n, local_row=0, hf_row=t * n, owned=owned),
                Placement(names[1], shapes[1], cols, n, local_row=n, hf_row=t * n, owned=owned),
            ]
        # qkv: per group [q heads of the group; k head; v head]; groups split over TP
        hd, hpg = self.head_dim, self.num_heads // self.num_kv_heads
        groups = self.num_kv_heads // tp
        stride = (hpg + 2) * hd
        g0 = t * groups
        q, kv = hpg * hd, hd
        return [
            Placement(hf, shape, cols, rows=n, local_row=first, hf_row=g0 * n, runs=groups,
                      local_stride=stride, hf_stride=n, owned=owned)
            for hf, shape, n, first in zip(
                names, shapes, (q, kv, kv), (0, q, q + kv), strict=True
            )
        ]

    def map_positions(
        self,
        name: str,
        tp_rank: int,
        pp_rank: int,
        local_flat_positions: torch.Tensor | np.ndarray | Sequence[int],
        *,
        replicas: bool = False,
        return_index: bool = False,
    ) -> dict[str, torch.Tensor] | dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Global HF flat positions of local flat positions of ``name`` (int64, in input order),
        per HF tensor touched. Positions that land nowhere (padding; replicas unless
        ``replicas``) are dropped. With ``return_index``, each value is ``(hf_positions, idx)``
        where ``idx`` indexes the input (to gather values). Sorted input gives sorted output."""
        if isinstance(local_flat_positions, torch.Tensor):
            pos = local_flat_positions.to(torch.int64).reshape(-1)
        else:
            pos = torch.from_numpy(np.asarray(local_flat_positions, dtype=np.int64).reshape(-1))
        out: dict[str, Any] = {}
        for p in self.to_hf(name, tp_rank, pp_rank):
            if not (p.owned or replicas):
                continue
            mask, hf = p.map(pos)
            if return_index:
                out[p.hf_name] = (hf, torch.nonzero(mask).reshape(-1))
            else:
                out[p.hf_name] = hf
        return out
