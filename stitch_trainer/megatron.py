"""Megatron-core TP/PP shards <-> Hugging Face tensors, for Llama/Qwen-family models.

A Megatron rank (tp_rank, pp_rank) holds local parameters such as
``decoder.layers.3.self_attention.linear_qkv.weight``; the served view is in Hugging Face layout
(``model.layers.11.self_attn.q_proj.weight`` ...). This module says, as data, where every local
element lands in the HF tensors, so a rank can diff its own shard and name the changed elements
by their *global HF flat positions* without gathering anything.

The rules per architecture are a table (`ARCHS`, see `LLAMA`, `QWEN2`, `QWEN3`) of
`Rule(megatron name, HF name(s), kind, HF shape)`; kinds (Megatron's tensor-parallel layouts):

* ``column``: split on dim 0 (rank r holds HF rows [r*R/tp, (r+1)*R/tp)).
* ``row``: split on dim 1 (rank r holds HF columns [r*C/tp, (r+1)*C/tp) of every row).
* ``replicated``: every TP rank holds the whole tensor; TP rank 0 owns it (counted once).
* ``vocab``: column split of the vocabulary padded to ``padded_vocab``; rows >= ``vocab`` are
  padding and land nowhere.
* ``qkv``: fused ``[q; k; v]`` interleaved per KV (query) group: for each group g,
  ``heads_per_group`` query heads, then one key head, then one value head (``head_dim`` rows each),
  and the groups split on dim 0 (rank r holds groups [r*G/tp, (r+1)*G/tp)). Works for weights and
  biases (Qwen2).
* ``gate_up``: fused SwiGLU ``linear_fc1``: rank r holds ``[gate rows of r; up rows of r]``.

A local tensor maps to HF tensors as a few `Placement`s (repeated row runs plus a column offset),
so positions are translated with integer arithmetic on whole tensors (`map_positions`).
Layer names carry the stage-local index; ``global = layout.layer_offset(pp_rank) + local``.

Long on purpose (about 800 lines): the Megatron -> HF mapping tables per architecture, one
place to read and extend them.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from stitch_core.format import dtypes
from stitch_core.format import fingerprint as fpr

Kind = Literal["column", "row", "replicated", "qkv", "gate_up", "vocab"]
Stage = Literal["first", "layer", "last"]
KINDS: tuple[str, ...] = ("column", "row", "replicated", "qkv", "gate_up", "vocab")
_HF_COUNT = {"qkv": 3, "gate_up": 2}  # number of HF tensors per kind (others: 1)
_LAYER = "{L}"
_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.")
IGNORED_SUFFIXES = ("._extra_state",)  # Transformer Engine state, not weights


# ------------------------------------------------------------------------- the tables


@dataclass(frozen=True)
class Rule:
    """One Megatron parameter and the HF tensor(s) its elements land in.

    ``megatron``: the name in a stage's state dict, ``{L}`` standing for the stage-local layer
    index (the HF names use ``{L}`` for the global one). ``shape``: the HF shape of each HF tensor
    in layout dimensions (``hidden``, ``ffn``, ``vocab``, ``head_dim``, ``q`` = heads*head_dim,
    ``kv`` = kv_heads*head_dim, and for ``qkv`` rules ``qkv`` = q for q_proj, kv for k/v_proj).
    ``local``: the name under Megatron's local (non-Transformer-Engine) layer spec, where norms
    are modules of their own instead of being fused into the next linear layer. ``tied``: with
    tied embeddings this parameter is a replica of that HF tensor (and ``hf`` is absent).
    ``stage``: which pipeline stage holds it (derived from the name when omitted).
    """

    megatron: str
    hf: tuple[str, ...]
    kind: Kind
    shape: tuple[str, ...]
    local: str | None = None
    tied: str | None = None
    stage: Stage = "layer"


def rule(
    megatron: str,
    hf: str | Sequence[str],
    kind: Kind,
    shape: Sequence[str],
    *,
    local: str | None = None,
    tied: str | None = None,
    stage: Stage | None = None,
) -> Rule:
    """A `Rule`; ``stage`` defaults to "layer" for names with ``{L}``, else "first" for
    ``embedding.*`` and "last" for everything else."""
    if stage is None:
        stage = "layer" if _LAYER in megatron else (
            "first" if megatron.startswith("embedding.") else "last"
        )
    hf_t = (hf,) if isinstance(hf, str) else tuple(hf)
    return Rule(megatron, hf_t, kind, tuple(shape), local, tied, stage)


_A = "decoder.layers.{L}.self_attention."
_M = "decoder.layers.{L}.mlp."
_HA = "model.layers.{L}.self_attn."
_HM = "model.layers.{L}.mlp."

#: Llama / Mistral: RMSNorm, GQA, SwiGLU, no biases.
LLAMA: tuple[Rule, ...] = (
    rule("embedding.word_embeddings.weight", "model.embed_tokens.weight", "vocab",
         ("vocab", "hidden")),
    rule(_A + "linear_qkv.layer_norm_weight", "model.layers.{L}.input_layernorm.weight",
         "replicated", ("hidden",), local="decoder.layers.{L}.input_layernorm.weight"),
    rule(_A + "linear_qkv.weight",
         (_HA + "q_proj.weight", _HA + "k_proj.weight", _HA + "v_proj.weight"),
         "qkv", ("qkv", "hidden")),
    rule(_A + "linear_proj.weight", _HA + "o_proj.weight", "row", ("hidden", "q")),
    rule(_M + "linear_fc1.layer_norm_weight", "model.layers.{L}.post_attention_layernorm.weight",
         "replicated", ("hidden",), local="decoder.layers.{L}.pre_mlp_layernorm.weight"),
    rule(_M + "linear_fc1.weight", (_HM + "gate_proj.weight", _HM + "up_proj.weight"),
         "gate_up", ("ffn", "hidden")),
    rule(_M + "linear_fc2.weight", _HM + "down_proj.weight", "row", ("hidden", "ffn")),
    rule("decoder.final_layernorm.weight", "model.norm.weight", "replicated", ("hidden",)),
    rule("output_layer.weight", "lm_head.weight", "vocab", ("vocab", "hidden"),
         tied="model.embed_tokens.weight"),
)

#: Qwen2 / Qwen2.5: Llama plus a bias on q/k/v (fused and interleaved like the weight).
QWEN2: tuple[Rule, ...] = (
    *LLAMA,
    rule(_A + "linear_qkv.bias",
         (_HA + "q_proj.bias", _HA + "k_proj.bias", _HA + "v_proj.bias"),
         "qkv", ("qkv",)),
)

#: Qwen3: Llama plus per-head RMSNorm on queries and keys (no q/k/v bias).
QWEN3: tuple[Rule, ...] = (
    *LLAMA,
    rule(_A + "q_layernorm.weight", _HA + "q_norm.weight", "replicated", ("head_dim",)),
    rule(_A + "k_layernorm.weight", _HA + "k_norm.weight", "replicated", ("head_dim",)),
)

ARCHS: dict[str, tuple[Rule, ...]] = {}
MODEL_TYPES: dict[str, str] = {}  # HF config.model_type -> arch


def register_arch(name: str, rules: Iterable[Rule], model_types: Iterable[str] = ()) -> None:
    """Add (or replace) an architecture's table; ``model_types`` are the HF ``config.model_type``
    values `MegatronLayout.from_hf_config` maps to it. Raises ValueError on a malformed table."""
    rules = tuple(rules)
    seen: set[str] = set()
    for r in rules:
        if r.kind not in KINDS:
            raise ValueError(f"{name}: {r.megatron}: unknown kind {r.kind!r}")
        if len(r.hf) != _HF_COUNT.get(r.kind, 1):
            raise ValueError(f"{name}: {r.megatron}: kind {r.kind} needs "
                             f"{_HF_COUNT.get(r.kind, 1)} HF names, got {len(r.hf)}")
        layered = [_LAYER in s for s in (r.megatron, *r.hf, *([r.local] if r.local else []))]
        if any(layered) != all(layered) or all(layered) != (r.stage == "layer"):
            raise ValueError(f"{name}: {r.megatron}: {{L}} must appear in every name of a "
                             "layer rule and in none of a first/last-stage rule")
        if r.kind == "row" and len(r.shape) != 2:
            raise ValueError(f"{name}: {r.megatron}: a row-parallel tensor is 2-D")
        for n in (r.megatron, *([r.local] if r.local else [])):
            if n in seen:
                raise ValueError(f"{name}: {n} appears twice")
            seen.add(n)
    ARCHS[name] = rules
    for t in model_types:
        MODEL_TYPES[t] = name


register_arch("llama", LLAMA, ("llama", "mistral"))
register_arch("qwen2", QWEN2, ("qwen2",))
register_arch("qwen3", QWEN3, ("qwen3",))


# ------------------------------------------------------------------------- placements


@dataclass(frozen=True)
class Placement:
    """Where some rows of a local tensor land in one HF tensor.

    The local tensor is seen as ``(-1, cols)`` rows and the HF tensor as ``(-1, hf_cols)``
    (1-D tensors: one element per row). For run j < ``runs``, local rows
    ``local_row + j*local_stride + [0, rows)`` are HF rows ``hf_row + j*hf_stride + [0, rows)``,
    local column c being HF column ``col + c``. ``owned``: False for replicas (a replicated
    tensor on TP ranks > 0, a tied output layer), which are not counted.
    """

    hf_name: str
    hf_shape: tuple[int, ...]
    cols: int
    rows: int
    local_row: int = 0
    hf_row: int = 0
    runs: int = 1
    local_stride: int = 0
    hf_stride: int = 0
    col: int = 0
    owned: bool = True

    @property
    def hf_cols(self) -> int:
        return math.prod(self.hf_shape[1:])

    @property
    def numel(self) -> int:
        return self.runs * self.rows * self.cols

    def _rows(self, first: int, stride: int, device: Any = None) -> torch.Tensor:
        j = torch.arange(self.runs, device=device).unsqueeze(1) * stride
        return (first + j + torch.arange(self.rows, device=device)).reshape(-1)

    def local_rows(self, device: Any = None) -> torch.Tensor:
        """Local row indices, in HF order."""
        return self._rows(self.local_row, self.local_stride, device)

    def hf_rows(self, device: Any = None) -> torch.Tensor:
        return self._rows(self.hf_row, self.hf_stride, device)

    @property
    def local_contiguous(self) -> bool:
        return self.runs == 1 or self.local_stride == self.rows

    @property
    def hf_slice(self) -> tuple[int, int] | None:
        """(flat offset, numel) when the HF positions form one contiguous flat slice."""
        if (self.runs == 1 or self.hf_stride == self.rows) and self.cols == self.hf_cols:
            return self.hf_row * self.hf_cols, self.numel
        return None

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """The local elements this placement covers, as ``(runs*rows, cols)`` in HF order (a view
        when the local rows are contiguous)."""
        v = local.reshape(-1, self.cols)
        if self.local_contiguous:
            return v[self.local_row : self.local_row + self.runs * self.rows]
        return v[self.local_rows(local.device)]

    def hf_positions(self, block_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Global HF flat positions of the covered elements (or of those in the HF rows
        ``block_rows``), in `gather` order; int64 ``(n, cols)``."""
        rows = self.hf_rows() if block_rows is None else block_rows
        c = torch.arange(self.col, self.col + self.cols, device=rows.device)
        return rows.unsqueeze(1) * self.hf_cols + c

    def map(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """For local flat positions: (mask of those this placement covers, their HF positions)."""
        row, c = positions // self.cols, positions % self.cols
        rel = row - self.local_row
        j = rel // self.local_stride if self.runs > 1 else torch.zeros_like(rel)
        i = rel - j * self.local_stride
        mask = (rel >= 0) & (j < self.runs) & (i < self.rows)
        hrow = self.hf_row + j[mask] * self.hf_stride + i[mask]
        return mask, hrow * self.hf_cols + self.col + c[mask]


# ------------------------------------------------------------------------- the layout


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
        return tuple(n.replace(_LAYER, str(layer)) for n in r.hf) if layer is not None else r.hf

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

    def _local_shape(self, r: Rule) -> tuple[int, ...]:
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
            shape = self._local_shape(r)
            if r.stage == "layer":
                for i in range(self.pipeline_layers[pp_rank]):
                    out[name.replace(_LAYER, str(i))] = shape
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
            key = f"decoder.layers.{_LAYER}." + name[m.end():]
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


# ------------------------------------------------------------------------- shard-local diffing


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


# ------------------------------------------------------------------------- whole conversions


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
        shape = layout._local_shape(found[0])
    ref = hf_state_dict[placements[0].hf_name] if placements else next(
        iter(hf_state_dict.values()))
    local = torch.full(tuple(shape), pad_value, dtype=ref.dtype, device=ref.device)
    v = local.view(-1, placements[0].cols if placements else 1)
    for p in placements:
        src = hf_state_dict[p.hf_name].reshape(-1, p.hf_cols)
        v[p.local_rows(local.device)] = src[p.hf_rows(local.device), p.col : p.col + p.cols]
    return local
