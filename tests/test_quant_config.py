"""quantization_config on pull (stitch_core.format.quant_config): the config each view gets, and a
run published in a quantized view pulls as a directory whose config.json describes its tensors,
which stay bit-exact to the view."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from stitch_core.format import dtypes
from stitch_core.format.quant_config import quantization_config, write_quantization_config
from stitch_core.format.views import project
from stitch_core.versions.board import LocalBoard
from stitch_core.versions.materialize import pull
from stitch_trainer.publisher import Publisher

RUN = "quant"
HF_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
             "intermediate_size": 256, "num_attention_heads": 4, "num_hidden_layers": 1,
             "num_key_value_heads": 4, "vocab_size": 512, "torch_dtype": "bfloat16"}


def masters(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(512, 64, generator=g),
        "model.layers.0.mlp.up_proj.weight": torch.randn(256, 64, generator=g) * 0.05,
        "model.layers.0.mlp.down_proj.weight": torch.randn(64, 256, generator=g) * 0.05,
        "model.layers.0.input_layernorm.weight": torch.ones(64),
        "lm_head.weight": torch.randn(512, 64, generator=g) * 0.05,
    }


def rows(view: dict[str, torch.Tensor]) -> dict[str, tuple[str, list[int]]]:
    return {n: (dtypes.info(t.dtype).name, list(t.shape)) for n, t in view.items()}


def test_fp8_block_config_is_what_vllm_and_sglang_fp8config_read():
    view = project(masters(0), "fp8-e4m3-block")
    assert quantization_config("fp8-e4m3-block", rows(view)) == {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
        "weight_block_size": [128, 128], "ignored_layers": ["lm_head"]}
    assert quantization_config("fp8-e4m3", rows(view))["weight_block_size"] == [128, 128]


@pytest.mark.parametrize("spec,fmt,weights", [
    ("fp8-e4m3-channel", "float-quantized",
     {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None,
      "strategy": "channel", "dynamic": False}),
    ("fp8-e4m3-tensor", "float-quantized",
     {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None,
      "strategy": "tensor", "dynamic": False}),
    ("nvfp4", "nvfp4-pack-quantized",
     {"num_bits": 4, "type": "float", "symmetric": True, "group_size": 16,
      "strategy": "tensor_group", "dynamic": False, "scale_dtype": "torch.float8_e4m3fn"}),
    ("mxfp4", "mxfp4-pack-quantized",
     {"num_bits": 4, "type": "float", "symmetric": True, "group_size": 32,
      "strategy": "group", "dynamic": False, "scale_dtype": "torch.uint8"}),
])
def test_compressed_tensors_configs(spec, fmt, weights):
    m = masters(0)
    m["model.layers.0.odd_proj.weight"] = torch.randn(4, 7)
    qc = quantization_config(spec, rows(project(m, spec)))
    group = qc["config_groups"]["group_0"]
    assert (qc["quant_method"], qc["format"], qc["quantization_status"]) == (
        "compressed-tensors", fmt, "compressed")
    assert group["weights"] == weights and group["targets"] == ["Linear"]
    assert group["format"] == fmt
    if spec.startswith("fp8"):  # FP8_DYNAMIC: dynamic per-token activations
        assert group["input_activations"]["strategy"] == "token"
        assert group["input_activations"]["dynamic"] is True
        assert qc["ignore"] == ["lm_head"]
    else:  # weight-only; an odd-column weight is left bf16 by the fp4 views, so ignored
        assert group["input_activations"] is None
        assert qc["ignore"] == ["lm_head", "model.layers.0.odd_proj"]
    from compressed_tensors.quantization import QuantizationConfig  # the schema itself

    parsed = QuantizationConfig.model_validate(qc)
    assert parsed.format == fmt and parsed.ignore == qc["ignore"]


def test_plain_views_get_no_config_and_lose_a_stale_one(tmp_path):
    p = tmp_path / "config.json"
    p.write_text(json.dumps({**HF_CONFIG, "quantization_config": {"quant_method": "fp8"}}))
    assert quantization_config("bf16", rows(project(masters(0), "bf16"))) is None
    write_quantization_config(p, "bf16", rows(project(masters(0), "bf16")))
    assert json.loads(p.read_text()) == HF_CONFIG
    assert write_quantization_config(tmp_path / "absent.json", "nvfp4", {}) is None
    assert not (tmp_path / "absent.json").exists()


def _publish(root: Path, spec: str) -> tuple[Path, dict[str, torch.Tensor]]:
    cfg_dir = root / "hf"
    cfg_dir.mkdir()
    (cfg_dir / "config.json").write_text(json.dumps(HF_CONFIG))
    prev = None
    with Publisher(str(root / "board"), RUN, spec, snapshot_every=4, config_dir=cfg_dir) as pub:
        for step in range(3):  # a snapshot and two patches
            m = masters(0)
            m = {n: t + 1e-3 * step * torch.randn(t.shape, generator=torch.Generator()
                                                  .manual_seed(step)) for n, t in m.items()}
            pub.publish(step, m)
            prev = project(m, spec, previous=prev)
        pub.flush()
    return root / "board", prev


@pytest.mark.parametrize("spec", ["fp8-e4m3-block", "nvfp4"])
async def test_pull_of_a_quantized_run_writes_its_quantization_config(tmp_path, spec):
    board, view = _publish(tmp_path, spec)
    out = tmp_path / "pulled"
    await pull(LocalBoard(board), RUN, None, out, tmp_path / "cache", quiet=True)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"] == quantization_config(spec, rows(view))
    assert {k: v for k, v in cfg.items() if k != "quantization_config"} == HF_CONFIG
    got = {}
    with safe_open(out / "model.safetensors", framework="pt") as f:
        for n in f.keys():  # noqa: SIM118 - safe_open API
            got[n] = f.get_tensor(n)
    assert got.keys() == view.keys()
    for n, t in view.items():
        assert got[n].dtype == t.dtype and got[n].shape == t.shape, n
        assert torch.equal(dtypes.int_view(got[n]), dtypes.int_view(t)), n
    if spec == "fp8-e4m3-block":
        assert got["model.layers.0.mlp.up_proj.weight"].dtype == torch.float8_e4m3fn
        assert "model.layers.0.mlp.up_proj.weight_scale_inv" in got
        assert got["lm_head.weight"].dtype == torch.bfloat16
    try:
        from transformers import AutoConfig
    except ImportError:
        return
    parsed = AutoConfig.from_pretrained(out)
    qc = parsed.quantization_config
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    assert qc["quant_method"] == cfg["quantization_config"]["quant_method"]
    if spec == "fp8-e4m3-block":  # transformers' own reader of the fp8 config
        from transformers.quantizers.auto import AutoQuantizationConfig

        fp8 = AutoQuantizationConfig.from_dict(qc)
        assert type(fp8).__name__ == "FineGrainedFP8Config"
        assert list(fp8.weight_block_size) == [128, 128] and fp8.activation_scheme == "dynamic"
