"""The ``quantization_config`` an HF ``config.json`` needs for an engine to load a served view.

A pulled directory holds the view's tensors bit for bit; this module says how engines should read
them (docs/format.md, "Quantized views on pull"):

* ``fp8-e4m3-block``: vLLM's / SGLang's ``Fp8Config`` (DeepSeek-V3 / Qwen3-FP8 style):
  ``{"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
  "weight_block_size": [128, 128], "ignored_layers": [...]}``; scales stay ``weight_scale_inv``.
* ``fp8-e4m3-tensor`` / ``-channel``: compressed-tensors ``float-quantized`` (the FP8_DYNAMIC
  preset with the view's weight strategy: static fp8 weights, dynamic per-token fp8
  activations); scales are ``weight_scale``.
* ``nvfp4`` / ``mxfp4``: compressed-tensors ``nvfp4-pack-quantized`` / ``mxfp4-pack-quantized``
  with the weight-only presets NVFP4A16 / MXFP4A16 (the view has no activation scales).
* ``bf16`` / ``fp16``: no quantization config (a stale one is removed).

``ignore`` / ``ignored_layers`` lists the modules whose 2-D ``.weight`` the view kept in a plain
float dtype (the LM head; for fp4 also weights with an odd number of columns); embeddings are not
linear layers and are not listed.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from stitch_core.format.views import parse_view

PLAIN_FLOATS = ("BF16", "F16", "F32")
CT_FORMATS = {"fp8-e4m3": "float-quantized", "nvfp4": "nvfp4-pack-quantized",
              "mxfp4": "mxfp4-pack-quantized"}


def unquantized_linears(tensors: Mapping[str, tuple[str, Sequence[int]]]) -> list[str]:
    """Module names (``<m>`` of ``<m>.weight``) of 2-D plain-float weights, embeddings excluded."""
    return sorted(
        name.removesuffix(".weight") for name, (dtype, shape) in tensors.items()
        if name.endswith(".weight") and len(shape) == 2 and dtype in PLAIN_FLOATS
        and "embed" not in name
    )


def _ct_weights(kind: str, granularity: str | None, group: int) -> dict[str, Any]:
    if kind == "fp8-e4m3":
        return {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None,
                "strategy": granularity, "dynamic": False}
    return {"num_bits": 4, "type": "float", "symmetric": True, "group_size": group,
            "strategy": "tensor_group" if kind == "nvfp4" else "group", "dynamic": False,
            "scale_dtype": "torch.float8_e4m3fn" if kind == "nvfp4" else "torch.uint8"}


def quantization_config(
    view: str, tensors: Mapping[str, tuple[str, Sequence[int]]]
) -> dict[str, Any] | None:
    """The ``quantization_config`` for a view (None for bf16/fp16); ``tensors`` maps each view
    tensor's name to its (safetensors dtype, shape)."""
    v = parse_view(view)
    if not v.quantized:
        return None
    ignore = unquantized_linears(tensors)
    if v.kind == "fp8-e4m3" and v.granularity == "block":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [v.block, v.block], "ignored_layers": ignore}
    fmt = CT_FORMATS[v.kind]
    inputs = None
    if v.kind == "fp8-e4m3":
        inputs = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None,
                  "strategy": "token", "dynamic": True}
    group = {"targets": ["Linear"], "weights": _ct_weights(v.kind, v.granularity, v.block),
             "input_activations": inputs, "output_activations": None, "format": fmt}
    return {"quant_method": "compressed-tensors", "format": fmt,
            "quantization_status": "compressed", "config_groups": {"group_0": group},
            "ignore": ignore, "kv_cache_scheme": None, "global_compression_ratio": None}


def write_quantization_config(
    config_path: str | os.PathLike, view: str, tensors: Mapping[str, tuple[str, Sequence[int]]]
) -> dict[str, Any] | None:
    """Set (or, for a plain view, remove) ``quantization_config`` in the HF ``config.json`` at
    ``config_path``; nothing happens when there is no such file. Returns what was written."""
    p = Path(config_path)
    if not p.is_file():
        return None
    cfg = json.loads(p.read_text())
    qc = quantization_config(view, tensors)
    if qc is None:
        if "quantization_config" not in cfg:
            return None
        cfg.pop("quantization_config")
    else:
        cfg["quantization_config"] = qc
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(json.dumps(cfg, indent=2) + "\n")
    os.replace(tmp, p)
    return qc
