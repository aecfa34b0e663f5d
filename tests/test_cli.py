"""The `stitch` CLI contract: diff, apply, inspect on real safetensors files and HF dirs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

STITCH = [sys.executable, "-m", "stitch_core.cli"]


def stitch(*args: str | Path, ok: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run([*STITCH, *map(str, args)], capture_output=True, text=True)
    if ok:
        assert r.returncode == 0, r.stderr
    return r


def _versions(seed: int = 0) -> tuple[dict, dict]:
    g = torch.Generator().manual_seed(seed)
    masters = {f"model.layers.{i}.mlp.up_proj.weight": torch.randn(64, 96, generator=g) * 0.02
               for i in range(3)}
    masters["model.norm.weight"] = torch.ones(96)
    base = {k: v.bfloat16() for k, v in masters.items()}
    new = {k: (v + torch.randn(v.shape, generator=g) * 2e-4).bfloat16() for k, v in masters.items()}
    return base, new


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and torch.equal(a[k].view(torch.int16), b[k].view(torch.int16))
        for k in a)


@pytest.fixture()
def files(tmp_path: Path) -> dict[str, Path]:
    base, new = _versions()
    save_file(base, tmp_path / "base.safetensors")
    save_file(new, tmp_path / "new.safetensors")
    for name, d in (("A", base), ("B", new)):
        root = tmp_path / name
        root.mkdir()
        names = sorted(d)
        save_file({k: d[k] for k in names[:2]}, root / "model-00001-of-00002.safetensors")
        save_file({k: d[k] for k in names[2:]}, root / "model-00002-of-00002.safetensors")
        (root / "config.json").write_text('{"model_type": "llama"}')
    return {"base": tmp_path / "base.safetensors", "new": tmp_path / "new.safetensors",
            "A": tmp_path / "A", "B": tmp_path / "B", "tmp": tmp_path}


def test_file_round_trip_and_inspect(files):
    p = files["tmp"] / "p.stp"
    stitch("diff", files["base"], files["new"], "-o", p, "--run", "r1", "--base-version", "3",
           "--target-version", "4")
    out = files["tmp"] / "out.safetensors"
    stitch("apply", files["base"], p, "-o", out)
    assert _same(load_file(out), load_file(files["new"]))
    info = json.loads(stitch("inspect", p, "--json").stdout)
    for key in ("changed_elements", "total_elements", "patch_bytes", "tensors"):
        assert key in info
    assert info["patch_bytes"] == p.stat().st_size
    assert info["run"] == "r1" and info["base_version"] == 3 and info["target_version"] == 4
    assert info["total_elements"] == 3 * 64 * 96 + 96
    new, base = load_file(files["new"]), load_file(files["base"])
    true_changed = sum(int((new[k].view(torch.int16) != base[k].view(torch.int16)).sum())
                       for k in new)
    assert info["changed_elements"] == true_changed > 0
    for t in info["tensors"]:
        assert {"name", "dtype", "changed", "encoding", "bytes"} <= t.keys()
    norm = next(t for t in info["tensors"] if t["name"] == "model.norm.weight")
    assert norm["changed"] == 0 and norm["bytes"] == 0
    assert "changed" in stitch("inspect", p).stdout


def test_directory_round_trip_keeps_layout(files):
    p = files["tmp"] / "d.stp"
    stitch("diff", files["A"], files["B"], "-o", p)
    out = files["tmp"] / "C"
    stitch("apply", files["A"], p, "-o", out)
    assert sorted(os.listdir(out)) == ["config.json", "model-00001-of-00002.safetensors",
                                       "model-00002-of-00002.safetensors",
                                       "model.safetensors.index.json"]
    got = {}
    for f in out.glob("*.safetensors"):
        got.update(load_file(f))
    assert _same(got, load_file(files["new"]))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(got)


def test_applied_output_records_version_and_rejects_wrong_version(files):
    p = files["tmp"] / "p.stp"
    stitch("diff", files["base"], files["new"], "-o", p, "--run", "r", "--base-version", "1",
           "--target-version", "2")
    v2 = files["tmp"] / "v2.safetensors"
    stitch("apply", files["base"], p, "-o", v2)
    # v2 now says it is version 2: applying the 1->2 patch again must be refused up front
    r = stitch("apply", v2, p, "-o", files["tmp"] / "v3.safetensors", ok=False)
    assert r.returncode != 0 and "version" in r.stderr
    assert not (files["tmp"] / "v3.safetensors").exists()


@pytest.mark.parametrize("damage", ["truncate", "bitflip", "wrong_base", "wrong_model", "garbage"])
def test_bad_input_exits_nonzero_with_one_line_and_writes_nothing(files, damage):
    p = files["tmp"] / "p.stp"
    stitch("diff", files["base"], files["new"], "-o", p)
    base = files["base"]
    data = bytearray(p.read_bytes())
    if damage == "truncate":
        p.write_bytes(data[: len(data) // 2])
    elif damage == "bitflip":
        data[len(data) // 3] ^= 0x10
        p.write_bytes(bytes(data))
    elif damage == "garbage":
        p.write_bytes(os.urandom(4096))
    elif damage == "wrong_base":
        base = files["new"]
    elif damage == "wrong_model":
        other = {"something.else": torch.zeros(3)}
        base = files["tmp"] / "other.safetensors"
        save_file(other, base)
    out = files["tmp"] / "out.safetensors"
    r = stitch("apply", base, p, "-o", out, ok=False)
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("stitch: error: "), r.stderr
    assert not out.exists()
    assert not [f for f in files["tmp"].iterdir() if ".tmp-" in f.name]


def test_apply_refuses_to_overwrite_without_force(files):
    p = files["tmp"] / "p.stp"
    stitch("diff", files["base"], files["new"], "-o", p)
    out = files["tmp"] / "exists.safetensors"
    out.write_bytes(b"keep me")
    r = stitch("apply", files["base"], p, "-o", out, ok=False)
    assert r.returncode == 1 and out.read_bytes() == b"keep me"
    stitch("apply", files["base"], p, "-o", out, "--force")
    assert _same(load_file(out), load_file(files["new"]))


def test_added_removed_reshaped_are_carried_whole(files):
    base, new = load_file(files["base"]), load_file(files["new"])
    new["extra.bias"] = torch.arange(5, dtype=torch.float32)
    del new["model.norm.weight"]
    k = "model.layers.0.mlp.up_proj.weight"
    new[k] = new[k].reshape(96, 64).contiguous()
    save_file(new, files["new"])
    p = files["tmp"] / "p.stp"
    stitch("diff", files["base"], files["new"], "-o", p)
    info = {t["name"]: t for t in json.loads(stitch("inspect", p, "--json").stdout)["tensors"]}
    assert info["extra.bias"]["kind"] == "full" and info["extra.bias"]["note"] == "added"
    assert info[k]["kind"] == "full" and info[k]["note"] == "reshaped"
    assert info["model.norm.weight"]["kind"] == "removed"
    out = files["tmp"] / "out.safetensors"
    stitch("apply", files["base"], p, "-o", out)
    got = load_file(out)
    assert set(got) == set(new)
    assert torch.equal(got["extra.bias"], new["extra.bias"]) and got[k].shape == (96, 64)
    assert torch.equal(got[k].view(torch.int16), new[k].view(torch.int16))
    del base
