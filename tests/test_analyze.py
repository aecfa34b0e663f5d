"""`stitch analyze`: a tiny random HF Llama trained for a few steps, and a board's versions."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch

from stitch_core.cli import main
from stitch_core.format import dtypes
from stitch_core.format.views import project
from stitch_core.versions.board import LocalBoard
from stitch_core.versions.store import list_manifests
from stitch_trainer.analyze.estimate import ulp
from stitch_trainer.analyze.experiment import analyze_training
from stitch_trainer.analyze.groups import GROUPS, group_of
from stitch_trainer.publisher import Publisher

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny matmuls: threads only contend on the shared cores (several times slower)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    d = tmp_path_factory.mktemp("tiny") / "llama"
    LlamaForCausalLM(cfg).save_pretrained(d)
    return d


def _state(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(model_dir / "model.safetensors")


def _run(capsys, *args: str) -> dict:
    capsys.readouterr()
    assert main(["analyze", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _changed(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, int]:
    return {n: int((dtypes.int_view(a[n]) != dtypes.int_view(b[n])).sum()) for n in a}


def test_groups_and_ulp():
    assert group_of("model.layers.3.self_attn.q_proj.weight") == "attn_q"
    assert group_of("model.layers.3.self_attn.o_proj.weight_scale_inv") == "attn_o"
    assert group_of("model.layers.0.mlp.down_proj.weight") == "mlp_down"
    assert group_of("model.layers.0.self_attn.q_norm.weight") == "norm"
    assert group_of("model.embed_tokens.weight") == "embed"
    assert group_of("lm_head.weight") == "lm_head"
    assert group_of("model.layers.0.mlp.gate.weight") == "other"
    # ULP = distance to the next representable value up, for normals, subnormals and zero
    for dt in (torch.bfloat16, torch.float16, torch.float8_e4m3fn):
        x = torch.tensor([0.0, 1e-6, 0.013, 0.5, 1.0, 3.7, 100.0]).to(dt)
        bits = dtypes.int_view(x)
        up = (bits + 1).view(dt).float()
        assert torch.equal(ulp(x.float(), dt), up - x.float()), dt


def test_adamw_bf16_cli_json_plot_and_recount(tiny, tmp_path, capsys):
    png = tmp_path / "changed.png"
    rep = _run(capsys, str(tiny), "--steps", "3", "--lr", "1e-5", "--plot", str(png))
    assert rep["mode"] == "train" and rep["optimizer"] == "adamw" and rep["view"] == "bf16"
    assert rep["loss"] == "causal-lm" and len(rep["steps"]) == 3
    state = _state(tiny)
    numel = sum(t.numel() for t in state.values())
    want_groups = {group_of(n) for n in state}
    assert "other" not in want_groups and want_groups <= set(GROUPS)
    for r in rep["steps"]:
        assert 0 < r["changed_fraction"] <= 1 and r["patch_bytes"] > 0
        assert r["total_elements"] == numel
        assert set(r["groups"]) == want_groups  # groups cover every tensor, once
        assert sum(g["total_elements"] for g in r["groups"].values()) == numel
        assert sum(g["changed_elements"] for g in r["groups"].values()) == r["changed_elements"]
        assert r["changed_fraction"] == r["changed_elements"] / numel
        for g in r["groups"].values():
            assert 0 <= g["changed_fraction"] <= 1 and 0 <= g["predicted_fraction"] <= 1
        # the rule is a heuristic but not wild: it undercounts (ignores rounding position),
        # the uniform-position estimate tracks the measurement
        assert r["changed_fraction"] / 10 < r["predicted_fraction"] <= r["changed_fraction"]
        assert 0.8 < r["expected_fraction"] / r["changed_fraction"] < 1.25
    assert rep["summary"]["total"]["changed_elements"] == sum(
        r["changed_elements"] for r in rep["steps"]
    )
    assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 5000

    # the same run through the API, recounting every step from two views projected here
    recount: list[dict[str, int]] = []

    def on_step(step, old, new):
        recount.append(_changed(project(old, "bf16"), project(new, "bf16")))

    api = analyze_training(tiny, steps=3, lr=1e-5, on_step=on_step)
    for r, mine, cli in zip(api["steps"], recount, rep["steps"], strict=True):
        assert r["changed_elements"] == sum(mine.values()) == cli["changed_elements"]
        for g, c in r["groups"].items():
            assert c["changed_elements"] == sum(v for n, v in mine.items() if group_of(n) == g)


def test_table_output(tiny, capsys):
    assert main(["analyze", str(tiny), "--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "changed %" in out and "predicted %" in out and "mlp_down" in out and "total" in out


def test_muon(tiny, capsys, monkeypatch):
    if hasattr(torch.optim, "Muon"):
        rep = _run(capsys, str(tiny), "--optimizer", "muon", "--steps", "2", "--lr", "1e-5")
        assert rep["optimizer"] == "muon" and len(rep["steps"]) == 2
        for r in rep["steps"]:
            assert 0 < r["changed_fraction"] <= 1 and r["patch_bytes"] > 0
        monkeypatch.delattr(torch.optim, "Muon")
    assert main(["analyze", str(tiny), "--optimizer", "muon", "--steps", "1"]) == 1
    assert "Muon not available in this torch" in capsys.readouterr().err


def test_fp8_on_bare_safetensors(tiny, capsys):
    rep = _run(
        capsys,
        str(tiny / "model.safetensors"),
        "--view",
        "fp8-e4m3-block",
        "--steps",
        "2",
        "--lr",
        "1e-5",
    )
    assert rep["loss"] == "synthetic" and "synthetic" in rep["note"]
    numel = sum(t.numel() for t in project(_state(tiny), "fp8-e4m3-block").values())
    for r in rep["steps"]:
        assert r["total_elements"] == numel and 0 < r["changed_fraction"] <= 1
        assert 0.5 < r["expected_fraction"] / r["changed_fraction"] < 2


def test_board_mode(tmp_path, capsys):
    g = torch.Generator().manual_seed(1)
    masters = {
        "model.layers.0.self_attn.q_proj.weight": torch.randn(64, 64, generator=g) * 0.02,
        "model.layers.0.mlp.down_proj.weight": torch.randn(64, 96, generator=g) * 0.02,
        "model.norm.weight": torch.ones(64),
    }
    board = tmp_path / "board"
    with Publisher(str(board), "r1", "bf16") as pub:
        for step in range(3):
            masters = {k: v + torch.randn(v.shape, generator=g) * 1e-4 for k, v in masters.items()}
            pub.publish(step, masters).result()
    ms = asyncio.run(list_manifests(LocalBoard(board), "r1"))
    png = tmp_path / "b.png"
    rep = _run(capsys, "--board", str(board), "--run", "r1", "--plot", str(png))
    assert [r["version"] for r in rep["steps"]] == [0, 1, 2]
    for r, m in zip(rep["steps"], ms, strict=True):
        assert r["changed_elements"] == m.changed_elements
        assert r["total_elements"] == m.total_elements
        assert r["patch_bytes"] == (m.patch_bytes or None)
        if m.changed_elements is None:
            assert r["groups"] is None
        else:
            assert sum(c["changed_elements"] for c in r["groups"].values()) == m.changed_elements
            assert set(r["groups"]) == {"attn_q", "mlp_down", "norm"}
    assert rep["steps"][1]["changed_elements"] > 0
    assert png.read_bytes()[:8] == PNG_MAGIC


def test_usage_errors(capsys):
    assert main(["analyze"]) == 1
    assert main(["analyze", "--board", "/nonexistent"]) == 1
    assert "--board needs --run" in capsys.readouterr().err
    assert main(["analyze", "/nonexistent", "--steps", "0"]) == 1
    assert "at least 1" in capsys.readouterr().err


@pytest.mark.parametrize("view", ["mxfp4", "nvfp4"])
def test_fp4_views(tiny, capsys, view):
    """The FP4 views analyze like the others: each step's changed fraction over the whole view,
    and the estimate (in E2M1 code units, per packed byte) near it."""
    rep = _run(capsys, str(tiny / "model.safetensors"), "--view", view, "--steps", "2",
               "--lr", "1e-5")
    numel = sum(t.numel() for t in project(_state(tiny), view).values())
    for r in rep["steps"]:
        assert r["total_elements"] == numel and 0 < r["changed_fraction"] <= 1
        assert 0.5 < r["expected_fraction"] / r["changed_fraction"] < 2, r
