"""Tiny random HF checkpoints for testing engines offline (no hub access).

``build_tiny_model(out_dir, arch="qwen2"|"qwen3"|"qwen3_moe"|"llama", seed=0)`` writes a
directory that ``vllm.LLM(model=out_dir)`` / ``AutoModelForCausalLM.from_pretrained`` can
load with no network:

* ``config.json``            tiny Qwen2 / Qwen3 / Qwen3-MoE / Llama config (bf16)
* ``model.safetensors``      random bf16 weights in HF names and shapes
* ``tokenizer.json``         byte-level BPE trained locally with ``tokenizers``
* ``tokenizer_config.json``  PreTrainedTokenizerFast config + ChatML template
* ``generation_config.json``

Only torch, safetensors and tokenizers are needed (no vllm / transformers
import).  Sizes are chosen for vLLM's CPU backend: its attention kernel needs
``head_dim`` in {32, 64, ...}, so hidden 128 / 4 heads gives head_dim 32.  The
default vocab (500) is deliberately *not* a multiple of 64, so vLLM pads the
embedding / lm_head rows (exercises vocab padding in layout maps).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

__all__ = ["build_tiny_model", "tiny_config", "CORPUS", "REALISTIC"]

# A model of realistic shape, random weights (the bit-exact engine tests): Llama architecture with
# tied embeddings like the small production Llamas, 24 layers, GQA 8 query / 2 KV heads (head_dim
# 64; both divide at TP=2), hidden 512, a 32k+ vocab that engines must pad (32800 is no multiple of
# 64). About 80M parameters, 160 MB in bf16.
REALISTIC = dict(arch="llama", vocab_size=32800, hidden_size=512, num_layers=24, num_heads=8,
                 num_kv_heads=2, intermediate_size=1376, tie_word_embeddings=True,
                 embed_std=0.05)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Small built-in corpus: enough text for a few hundred BPE merges.
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Stitch sends lossless weight patches of the served view to every engine.",
    "Engines follow versions by applying patches in place between steps.",
    "Reinforcement learning post-training updates the policy weights often.",
    "A patch lists the positions that changed and the new bits at each position.",
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i * i)\n",
    "import numpy as np\nx = np.arange(16).reshape(4, 4)\n",
    "Hello world! How are you today? I am fine, thank you.",
    "Once upon a time there was a tiny model with random weights.",
    "It could not say anything useful, but it was deterministic and fast.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 100 1000",
    "The attention heads share key and value projections in groups.",
    "Gate and up projections are fused; query, key and value are fused too.",
    "Tensor parallel ranks each hold a shard of every linear layer.",
    "user: what is two plus two? assistant: two plus two is four.",
]


def tiny_config(arch: str = "qwen2", *, vocab_size: int = 500, hidden_size: int = 128,
                num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2,
                intermediate_size: int = 256, max_position_embeddings: int = 256,
                tie_word_embeddings: bool | None = None) -> dict:
    """An HF config dict; ``tie_word_embeddings`` None keeps the architecture's default here
    (tied for qwen3, untied otherwise)."""
    cfg = _config(arch, vocab_size, hidden_size, num_layers, num_heads, num_kv_heads,
                  intermediate_size, max_position_embeddings)
    if tie_word_embeddings is not None:
        cfg["tie_word_embeddings"] = tie_word_embeddings
    return cfg


def _config(arch, vocab_size, hidden_size, num_layers, num_heads, num_kv_heads,
            intermediate_size, max_position_embeddings) -> dict:
    common = {
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-6,
        "use_cache": True,
        "tie_word_embeddings": False,
        "rope_theta": 10000.0,
        "attention_dropout": 0.0,
        "torch_dtype": "bfloat16",
        "dtype": "bfloat16",
        "bos_token_id": 0,
        "eos_token_id": 2,
    }
    if arch == "qwen2":
        return {
            "architectures": ["Qwen2ForCausalLM"],
            "model_type": "qwen2",
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": num_layers,
            **common,
        }
    if arch == "llama":
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "attention_bias": False,
            "mlp_bias": False,
            "pretraining_tp": 1,
            "head_dim": hidden_size // num_heads,
            **common,
        }
    if arch == "qwen3":  # per-head q/k RMS norms, no qkv bias, tied embeddings (small Qwen3s)
        return {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "attention_bias": False,
            "head_dim": hidden_size // num_heads,
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": num_layers,
            **common,
            "tie_word_embeddings": True,
        }
    if arch == "qwen3_moe":  # Qwen3 attention + a sparse MoE block (4 experts, top-2) per layer
        return {
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "attention_bias": False,
            "head_dim": hidden_size // num_heads,
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": num_layers,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": intermediate_size // 4,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "norm_topk_prob": True,
            "output_router_logits": False,
            "router_aux_loss_coef": 0.0,
            **common,
        }
    raise ValueError(f"unknown arch {arch!r} (expected 'qwen2', 'qwen3', 'qwen3_moe' or "
                     "'llama')")


def _hf_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    h = cfg["hidden_size"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = h // nh
    inter, vocab = cfg["intermediate_size"], cfg["vocab_size"]
    qkv_bias = cfg["model_type"] == "qwen2" or cfg.get("attention_bias", False)
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (nh * hd, h)
        shapes[p + "self_attn.k_proj.weight"] = (nkv * hd, h)
        shapes[p + "self_attn.v_proj.weight"] = (nkv * hd, h)
        if qkv_bias:
            shapes[p + "self_attn.q_proj.bias"] = (nh * hd,)
            shapes[p + "self_attn.k_proj.bias"] = (nkv * hd,)
            shapes[p + "self_attn.v_proj.bias"] = (nkv * hd,)
        if cfg["model_type"] in ("qwen3", "qwen3_moe"):
            shapes[p + "self_attn.q_norm.weight"] = (hd,)
            shapes[p + "self_attn.k_norm.weight"] = (hd,)
        shapes[p + "self_attn.o_proj.weight"] = (h, nh * hd)
        if "num_experts" in cfg:  # router + per-expert MLPs (engines fuse them per layer)
            shapes[p + "mlp.gate.weight"] = (cfg["num_experts"], h)
            e_inter = cfg["moe_intermediate_size"]
            for e in range(cfg["num_experts"]):
                shapes[p + f"mlp.experts.{e}.gate_proj.weight"] = (e_inter, h)
                shapes[p + f"mlp.experts.{e}.up_proj.weight"] = (e_inter, h)
                shapes[p + f"mlp.experts.{e}.down_proj.weight"] = (h, e_inter)
            continue
        shapes[p + "mlp.gate_proj.weight"] = (inter, h)
        shapes[p + "mlp.up_proj.weight"] = (inter, h)
        shapes[p + "mlp.down_proj.weight"] = (h, inter)
    shapes["model.norm.weight"] = (h,)
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (vocab, h)
    return shapes


def _random_weights(cfg: dict, seed: int, embed_std: float = 0.5):
    import torch

    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in _hf_shapes(cfg).items():
        if name.endswith(("layernorm.weight", "_norm.weight")) or name == "model.norm.weight":
            t = 1.0 + 0.1 * torch.randn(shape, generator=g)
        elif name.endswith(".bias"):
            t = 0.1 * torch.randn(shape, generator=g)
        elif "embed_tokens" in name or name == "lm_head.weight":
            t = embed_std * torch.randn(shape, generator=g)  # 0.5: lively logits
        else:
            t = torch.randn(shape, generator=g) / (shape[-1] ** 0.5)
        out[name] = t.to(torch.bfloat16).contiguous()
    return out


def _train_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    return tok


def build_tiny_model(out_dir, arch: str = "qwen2", seed: int = 0, embed_std: float = 0.5,
                     **cfg_overrides) -> Path:
    """Write a tiny random HF checkpoint for ``arch`` to ``out_dir``; return its path.

    Deterministic for a given (arch, seed, overrides).  ``cfg_overrides`` go to
    :func:`tiny_config` (e.g. ``vocab_size=512``, ``num_layers=1``); ``embed_std`` scales the
    random embedding (``build_tiny_model(d, **REALISTIC)`` for the realistic shape).
    """
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = tiny_config(arch, **cfg_overrides)

    tok = _train_tokenizer(cfg["vocab_size"])
    n_tok = tok.get_vocab_size(with_added_tokens=True)
    assert n_tok <= cfg["vocab_size"], (n_tok, cfg["vocab_size"])
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    cfg["bos_token_id"] = ids["<|endoftext|>"]
    cfg["eos_token_id"] = ids["<|im_end|>"]
    tok.save(str(out / "tokenizer.json"))

    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": cfg["max_position_embeddings"],
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {
            str(ids[t]): {"content": t, "lstrip": False, "normalized": False,
                          "rstrip": False, "single_word": False, "special": True}
            for t in SPECIAL_TOKENS
        },
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
    (out / "special_tokens_map.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}, indent=2))
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    (out / "generation_config.json").write_text(json.dumps({
        "bos_token_id": cfg["bos_token_id"],
        "eos_token_id": [cfg["eos_token_id"], cfg["bos_token_id"]],
        "do_sample": False,
    }, indent=2))

    weights = _random_weights(cfg, seed, embed_std)
    tmp = out / "model.safetensors.tmp"
    save_file(weights, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, out / "model.safetensors")
    return out


if __name__ == "__main__":  # pragma: no cover
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--arch", default="qwen2", choices=["qwen2", "qwen3", "qwen3_moe", "llama"])
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    print(build_tiny_model(a.out_dir, a.arch, a.seed))
