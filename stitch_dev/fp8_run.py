"""The FP8 test run shared by the engines' FP8 suites (tests/vllm, tests/sglang): a tiny Llama
whose shapes give full and partial 128x128 blocks, three versions published in the
``fp8-e4m3-block`` view and `stitch pull`ed.

Hidden 320 (= 2 x 128 + 64: the last block column of every q/k/v/gate/up weight and the last
block row of o/down is partial), intermediate 384, q 256 / k 128 / v 128 rows fused into one qkv
weight (and its scales) by the engines' loaders; the lm_head is untied and kept bf16 by the view.
v1 changes codes with the scales pinned; v2 also scales two blocks x4 (`SCALED`: a full block and
a partial one), so their scales change too.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from stitch_core.versions.board import LocalBoard
from stitch_core.versions.materialize import pull
from stitch_dev.tinymodel import build_tiny_model

__all__ = ["HIDDEN", "HEAD_DIM", "INTER", "SCALED", "TAMPERED", "fp8_model", "next_version",
           "publish_fp8_run"]

HIDDEN, HEAD_DIM, INTER = 320, 64, 384
SCALED = [("model.layers.0.self_attn.q_proj.weight", 0, 0),  # a full 128x128 block
          ("model.layers.1.self_attn.o_proj.weight", 2, 1)]  # rows 256-319: a partial block
TAMPERED = "model.layers.1.mlp.down_proj.weight_scale_inv"  # a scale no patch changes


def fp8_model(root: Path, kv_heads: int = 2, inter: int = INTER, arch: str = "llama",
              vocab: int = 500, hidden: int = HIDDEN) -> tuple[Path, dict[str, torch.Tensor]]:
    """A tiny Llama (or `arch`: ``qwen2`` adds q/k/v biases; SGLang's Llama loader reads only
    per-tensor FP8 scales) of 2 layers, 4 query / `kv_heads` KV heads of 64, `hidden` (320),
    intermediate `inter`, untied lm_head of `vocab` rows, as fp32 masters, and its directory
    (saved in bf16)."""
    d = build_tiny_model(root / "model", arch=arch, hidden_size=256, intermediate_size=inter,
                         num_heads=4, num_kv_heads=kv_heads, vocab_size=vocab,
                         tie_word_embeddings=False)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(hidden_size=hidden, head_dim=HEAD_DIM)
    (d / "config.json").write_text(json.dumps(cfg, indent=2))
    g = torch.Generator().manual_seed(0)
    masters = {}
    for name, t in load_file(d / "model.safetensors").items():  # same names, wider shapes
        shape = list(t.shape)
        if name.endswith(".bias"):  # q/k/v biases: their width is heads x 64 whatever hidden
            masters[name] = 0.1 * torch.randn(shape, generator=g)
            continue
        if name.endswith("norm.weight"):
            masters[name] = 1 + 0.1 * torch.randn(hidden, generator=g)
            continue
        if "embed" in name or "lm_head" in name:
            shape[1] = hidden
            masters[name] = 0.5 * torch.randn(shape, generator=g)
            continue
        shape[0 if ("o_proj" in name or "down_proj" in name) else 1] = hidden
        masters[name] = torch.randn(shape, generator=g) / shape[1] ** 0.5
    save_file({k: v.to(torch.bfloat16) for k, v in masters.items()}, d / "model.safetensors")
    return d, masters


def next_version(masters: dict[str, torch.Tensor], step: int,
                 scaled: list[tuple[str, int, int]] = SCALED) -> dict[str, torch.Tensor]:
    """A small update of every master; at step 2 also the `scaled` blocks x4 (their fp8 scales
    must grow: pinned scales change only where the codes would clip)."""
    g = torch.Generator().manual_seed(100 + step)
    out = {k: v + 2e-3 * v.abs().mean() * torch.randn(v.shape, generator=g)
           for k, v in masters.items()}
    if step == 2:
        for name, bi, bj in scaled:
            out[name][bi * 128:(bi + 1) * 128, bj * 128:(bj + 1) * 128] *= 4
    return out


def publish_fp8_run(root: Path, run: str, arch: str = "llama", vocab: int = 500,
                    hidden: int = HIDDEN, scaled: list[tuple[str, int, int]] = SCALED,
                    kv_heads: int = 2, inter: int = INTER) -> dict:
    """v0..v2 of `run` published in the ``fp8-e4m3-block`` view on ``root/board`` and pulled to
    ``root/pulled-<v>``: {"root", "dirs", "views"} (the views as loaded from the pulled files),
    after checking the pulled config and that v2 changes the `scaled` blocks' scales. The model:
    `fp8_model` (`arch`, `vocab`, `hidden`, `kv_heads`, `inter`)."""
    from stitch_trainer import Publisher

    model_dir, masters = fp8_model(root, kv_heads=kv_heads, inter=inter, arch=arch, vocab=vocab,
                                   hidden=hidden)
    with Publisher(str(root / "board"), run, "fp8-e4m3-block", config_dir=model_dir) as pub:
        for step in (0, 1, 2):
            if step:
                masters = next_version(masters, step, scaled)
            assert pub.publish(step, masters).result().version == step
    dirs = []
    for v in (0, 1, 2):
        d = root / f"pulled-{v}"
        asyncio.run(pull(LocalBoard(root / "board"), run, v, d, root / "cache", quiet=True))
        dirs.append(d)
    qc = json.loads((dirs[0] / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "fp8" and qc["weight_block_size"] == [128, 128], qc
    views = [load_file(d / "model.safetensors") for d in dirs]
    for name, bi, bj in scaled:  # the patch to v2 changes these scales (and their codes)
        s = name.replace(".weight", ".weight_scale_inv")
        assert views[2][s][bi, bj] > views[1][s][bi, bj], s
    assert torch.equal(views[1][TAMPERED], views[2][TAMPERED])
    return {"root": root, "dirs": dirs, "views": views}
