#!/usr/bin/env python3
"""Demo: an AdamW run on a small model, shipped as lossless patches with the `stitch` CLI.

Builds a small Llama-shaped set of fp32 master weights, trains it a few steps with AdamW at an RL
learning rate, saves each step's bf16 served view as an HF directory, then for each step:
`stitch diff` -> `stitch inspect` -> `stitch apply`, and checks the rebuilt version bit for bit.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from stitch_core.views import project


def small_llama(layers: int, hidden: int, inter: int, vocab: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    sd: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": torch.randn(vocab, hidden, generator=g) * 0.02
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        for n, shape in [
            ("self_attn.q_proj", (hidden, hidden)),
            ("self_attn.k_proj", (hidden // 4, hidden)),
            ("self_attn.v_proj", (hidden // 4, hidden)),
            ("self_attn.o_proj", (hidden, hidden)),
            ("mlp.gate_proj", (inter, hidden)),
            ("mlp.up_proj", (inter, hidden)),
            ("mlp.down_proj", (hidden, inter)),
        ]:
            sd[p + n + ".weight"] = torch.randn(*shape, generator=g) * 0.02
        sd[p + "input_layernorm.weight"] = torch.ones(hidden)
        sd[p + "post_attention_layernorm.weight"] = torch.ones(hidden)
    sd["model.norm.weight"] = torch.ones(hidden)
    sd["lm_head.weight"] = torch.randn(vocab, hidden, generator=g) * 0.02
    return sd


def stitch(*args: object) -> str:
    r = subprocess.run(
        [sys.executable, "-m", "stitch_core.cli", *map(str, args)], capture_output=True, text=True
    )
    if r.returncode != 0:
        raise SystemExit(f"stitch {args[0]} failed: {r.stderr.strip()}")
    return r.stdout


def save_view(view: dict[str, torch.Tensor], d: Path, version: int) -> None:
    d.mkdir(parents=True)
    save_file(
        view,
        d / "model.safetensors",
        metadata={"stitch.run": "demo", "stitch.version": str(version)},
    )
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "note": "stitch demo"}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-6)
    ap.add_argument("--out", type=Path, default=None, help="keep the files here")
    a = ap.parse_args()
    work = a.out or Path(tempfile.mkdtemp(prefix="stitch-demo-"))
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)

    masters = small_llama(layers=4, hidden=512, inter=1408, vocab=8000)
    params = {k: torch.nn.Parameter(v) for k, v in masters.items()}
    opt = torch.optim.AdamW(params.values(), lr=a.lr, weight_decay=0.01)
    n = sum(p.numel() for p in params.values())
    print(f"model: {n / 1e6:.1f}M params, AdamW lr={a.lr}, bf16 served view; files in {work}\n")
    prev = project({k: p.detach() for k, p in params.items()}, "bf16")
    save_view(prev, work / "v0", 0)
    full = (work / "v0" / "model.safetensors").stat().st_size
    print(
        f"{'step':>4} {'changed %':>10} {'patch bytes':>12} {'full bytes':>12} {'ratio':>8} "
        f"{'bits/chg':>9} {'diff s':>7} {'apply s':>8}  verified"
    )
    for step in range(1, a.steps + 1):
        for p in params.values():  # noisy gradients with a little shared signal
            p.grad = torch.randn_like(p) * 1e-2 + 1e-3 * torch.randn(1)
        opt.step()
        cur = project({k: p.detach() for k, p in params.items()}, "bf16")
        save_view(cur, work / f"v{step}", step)
        patch = work / f"v{step}.stp"
        t0 = time.perf_counter()
        stitch("diff", work / f"v{step - 1}", work / f"v{step}", "-o", patch, "--view", "bf16")
        t1 = time.perf_counter()
        stitch("apply", work / f"v{step - 1}", patch, "-o", work / f"r{step}")
        t2 = time.perf_counter()
        info = json.loads(stitch("inspect", patch, "--json"))
        got = load_file(work / f"r{step}" / "model.safetensors")
        ok = all(torch.equal(got[k].view(torch.int16), cur[k].view(torch.int16)) for k in cur)
        frac = info["changed_elements"] / info["total_elements"]
        print(
            f"{step:>4} {100 * frac:>10.3f} {info['patch_bytes']:>12,} {full:>12,} "
            f"{full / info['patch_bytes']:>7.0f}x {info['bits_per_changed_element']:>9.2f} "
            f"{t1 - t0:>7.2f} {t2 - t1:>8.2f}  {'bit-exact' if ok else 'MISMATCH'}"
        )
        if not ok:
            raise SystemExit("reconstruction mismatch")
        prev = cur
    print("\nper-tensor view of the last patch (`stitch inspect`):")
    print("\n".join(stitch("inspect", work / f"v{a.steps}.stp").splitlines()[:8]))
    bad = bytearray((work / "v1.stp").read_bytes())
    bad[len(bad) // 2] ^= 1
    (work / "bad.stp").write_bytes(bytes(bad))
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "stitch_core.cli",
            "apply",
            work / "v0",
            work / "bad.stp",
            "-o",
            work / "bad-out",
        ],
        capture_output=True,
        text=True,
    )
    print(
        f"\na corrupted patch: exit {r.returncode}, {r.stderr.strip()!r}; "
        f"output written: {(work / 'bad-out').exists()}"
    )


if __name__ == "__main__":
    main()
