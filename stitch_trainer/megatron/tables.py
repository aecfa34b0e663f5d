"""The Megatron -> HF rules per architecture, as tables of `Rule`s.

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

Names with ``{L}`` (`LAYER`) are per decoder layer: the stage-local index in Megatron names, the
global one in HF names (`stitch_trainer.megatron.layout.MegatronLayout` translates).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

Kind = Literal["column", "row", "replicated", "qkv", "gate_up", "vocab"]
Stage = Literal["first", "layer", "last"]
KINDS: tuple[str, ...] = ("column", "row", "replicated", "qkv", "gate_up", "vocab")
_HF_COUNT = {"qkv": 3, "gate_up": 2}  # number of HF tensors per kind (others: 1)
LAYER = "{L}"  # the layer index placeholder in rule names


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
        stage = "layer" if LAYER in megatron else (
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
        layered = [LAYER in s for s in (r.megatron, *r.hf, *([r.local] if r.local else []))]
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

