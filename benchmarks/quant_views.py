"""Served views side by side under RL-like AdamW updates: changed fraction, patch bytes and bits
per changed element for bf16, fp8-e4m3-block (pinned scales), online fp8 (engine-quantized at
load, emulated), mxfp4 and nvfp4, at several learning rates.

    .venv/bin/python benchmarks/quant_views.py [--quick] [--layers 4] [--steps 2]
        [--lrs 1e-6,3e-6,1e-5] [--json PATH] [--md PATH] [--png PATH]
    .venv-vllm/bin/python benchmarks/quant_views.py --check-vllm   # emulation vs vLLM's code

Data. A Qwen2.5-0.5B-like decoder (hidden 896, intermediate 4864, 14 heads, 2 KV heads, head
dim 64; `--layers` layers; a small vocabulary, see below) with benchmarks/squash.py's
`pretrained_like` start (heavy tails, row/column scales, outlier columns; imported, not copied:
it sizes its model with `shape_for`, which this script points at the Qwen-like shape for the
call) and benchmarks/adam_data.py's `Gradients`; torch.optim.AdamW (betas (0.9, 0.999), weight
decay 0.01) runs `--warm-steps` steps at the lr first (warm moments, as squash.py does), then
`--steps` measured steps. Every lr starts from the same masters and sees the same gradients.
No package of the main venv ships pretrained model weights, so there is no real-weight run.

Measured: the decoder layers (`model.layers.*`: the seven linear weights and two norms per
layer). Embeddings and the LM head are trained but left out of the measured state: every view
keeps them bf16, so they would add the same bytes to every row (the vocabulary is 1024 to keep
the run short). For each measured step, versions k and k+1 of the masters are projected:

* Stitch's views with `stitch_core.format.views.project(masters, view, previous=view_k)` (k+1
  pinned to k's scales, as the Publisher does): bf16, fp8-e4m3-block, mxfp4, nvfp4;
* online fp8: the engine is started on the bf16 view and quantizes at load with no pinned
  scales; emulated in plain torch (`online_fp8`), mirroring vLLM 0.32
  `vllm/model_executor/layers/quantization/online/fp8.py`:
  - per tensor (`--quantization fp8_per_tensor`, `Fp8PerTensorOnlineLinearMethod.
    process_weights_after_loading`): amax = `weight_amax(w)` (`utils/quant_utils.py`,
    max(|aminmax|)) of the fused bf16 layer (q/k/v, gate/up are one layer in vLLM),
    scale = `_fp8_scale(amax)` = amax.float() / tensor(448.) (a true division), codes =
    `ops.scaled_fp8_quant(w, scale=scale)`, whose CUDA kernel (`csrc/quantization/w8a8/fp8/
    common.cu`, `scaled_fp8_quant_kernel_strided`) computes `inv = 1.0f / scale` and
    `clamp(float(w) * inv, -448, 448)` cast to e4m3 (round to nearest even): a multiply by the
    reciprocal, as the comment above `_fp8_quant_per_channel` in fp8.py also says;
  - per 128x128 block (`--quantization fp8_per_block`, `Fp8PerBlockOnlineLinearMethod`):
    `vllm/utils/deep_gemm.py::per_block_cast_to_fp8(w, [128, 128], use_ue8m0=False)`: zero
    padding, amax = |x|.float().amax per block clamped to 1e-4, sf = amax / 448.0,
    codes = (x * (1.0 / sf)).to(float8_e4m3fn), no clamp. `--check-vllm` (run with the vLLM
    venv's python) compares this emulation with vLLM's own function bit for bit; the CPU build
    of vLLM has no `static_scaled_fp8_quant` kernel, so the per-tensor path is checked against
    the formula above only (tests/test_quant_views_bench.py).
  A follower that receives the bf16 patch must re-quantize every group (block, resp. fused
  tensor) that the patch touches: the group's amax may have moved, and a group whose amax moves
  re-scales entirely. Reported: fp8 codes changed, groups touched by the bf16 patch, groups
  whose scale changed, the elements in touched groups, and, for comparison, the bytes of a
  Stitch patch of the engine-quantized tensors themselves (what shipping that view would cost).

Each pair (k, k+1) of every view is encoded with Stitch's `PatchBuilder` (tensors in sorted
order, base fingerprints known: what `stitch diff` and the Publisher write), applied with
`stitch_core.format.patch.apply` and compared bit for bit with version k+1 (abort if not).
Columns: elements changed / all elements, for codes (fp8 weights; packed FP4 bytes, two codes
each, the element the patch carries) and scales separately, norms apart; patch bytes (whole
`.stp`, header included); bits per changed element = 8 * patch bytes / changed elements (all
tensors); bytes relative to bf16's patch of the same step. Sums over the measured steps.
Torch runs single-threaded (--threads).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

import squash  # noqa: E402  (pretrained_like: the pretrained-like start)
from adam_data import HEAD_DIM, Gradients, ModelShape  # noqa: E402

from stitch_core.format import dtypes, views  # noqa: E402
from stitch_core.format import fingerprint as fpr  # noqa: E402
from stitch_core.format.fp4 import FUSED, fused_key  # noqa: E402
from stitch_core.format.patch import PatchBuilder, apply  # noqa: E402

Tensors = Mapping[str, torch.Tensor]
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # vLLM get_fp8_min_max() on CUDA (OCP e4m3fn): torch.finfo(float8_e4m3fn).max
BLOCK = [128, 128]
STITCH_VIEWS = ("bf16", "fp8-e4m3-block", "mxfp4", "nvfp4")
ONLINE = ("online-fp8-tensor", "online-fp8-block")
ALL_VIEWS = (*STITCH_VIEWS, *ONLINE)


def qwen_like(layers: int, vocab: int = 1024) -> ModelShape:
    """Qwen2.5-0.5B's layer shapes (hidden 896, intermediate 4864, 14/2 heads of 64)."""
    assert HEAD_DIM == 64
    return ModelShape(hidden=896, intermediate=4864, layers=layers, vocab=vocab, heads=14,
                      kv_heads=2)


def tiny_shape() -> ModelShape:
    """For --quick and the test: odd block splits (kv rows 64: fused q/k/v blocks straddle)."""
    return ModelShape(hidden=256, intermediate=704, layers=1, vocab=128, heads=4, kv_heads=1)


def pretrained_start(shape: ModelShape, seed: int) -> dict[str, torch.Tensor]:
    """squash.pretrained_like at `shape` (it sizes its model with shape_for: pointed at ours)."""
    with mock.patch.object(squash, "shape_for", lambda _n: shape):
        return squash.pretrained_like(float(shape.n_params), seed)


# ---------------------------------------------------------------- online fp8 (vLLM), emulated


def fused_groups(names: list[str]) -> dict[str, list[str]]:
    """{vLLM layer: member weights in vLLM's order} for the quantized weights in `names`:
    q/k/v and gate/up are one layer each (packed_modules_mapping), the rest alone."""
    order = {m: i for members in FUSED for i, m in enumerate(members)}
    groups: dict[str, list[str]] = {}
    for n in names:
        groups.setdefault(fused_key(n), []).append(n)
    for members in groups.values():
        members.sort(key=lambda n: order.get(n.rsplit(".", 2)[-2], 0))
    return groups


def vllm_fp8_per_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scale (1,)) of bf16 `w` as vLLM's Fp8PerTensorOnlineLinearMethod makes them."""
    lo, hi = w.aminmax()  # quant_utils.weight_amax
    amax = torch.maximum(lo.abs(), hi.abs()).reshape(1)
    scale = amax.to(torch.float32) / torch.tensor(FP8_MAX, dtype=torch.float32)  # _fp8_scale
    inv = torch.reciprocal(scale)  # common.cu: inv_scale = 1.0f / (*scale)
    x = w.to(torch.float32) * inv  # scaled_fp8_conversion<true>: val * scale
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def vllm_fp8_per_block(w: torch.Tensor, block_size: list[int] = BLOCK):
    """(codes, scale_inv (ceil(m/bm), ceil(n/bn))): deep_gemm.per_block_cast_to_fp8, verbatim
    in plain torch (use_ue8m0=False)."""
    m, n = w.shape
    bm, bn = block_size
    x_padded = torch.zeros((-(-m // bm) * bm, -(-n // bn) * bn), dtype=w.dtype, device=w.device)
    x_padded[:m, :n] = w
    x_view = x_padded.view(-1, bm, x_padded.size(1) // bn, bn)
    x_amax = x_view.abs().float().amax(dim=(1, 3), keepdim=True).clamp(1e-4)
    sf = x_amax / FP8_MAX
    x_scaled = (x_view * (1.0 / sf)).to(FP8)
    return (x_scaled.view_as(x_padded)[:m, :n].contiguous(),
            sf.view(x_view.size(0), x_view.size(2)))


def online_fp8(bf16_view: Tensors, kind: str) -> dict[str, torch.Tensor]:
    """The weights an engine started on `bf16_view` holds after online fp8 quantization (kind
    "online-fp8-tensor" or "online-fp8-block"): per vLLM layer its fp8 weight (a fused layer
    named `<module>.q_proj+k_proj+v_proj.weight`, ...) and its float32 `..._scale` (per
    tensor) or `..._scale_inv` (per block); other tensors as they are."""
    out: dict[str, torch.Tensor] = {}
    quant = [n for n, t in bf16_view.items() if views.is_quantized_weight(n, t)]
    for name, t in bf16_view.items():
        if name not in quant:
            out[name] = t
    for key, members in fused_groups(quant).items():
        w = torch.cat([bf16_view[n] for n in members])
        name = key if key.endswith(".weight") else key + ".weight"  # a fused layer: q+k+v...
        if kind == "online-fp8-tensor":
            out[name], out[name + "_scale"] = vllm_fp8_per_tensor(w)
        else:
            out[name], out[name + "_scale_inv"] = vllm_fp8_per_block(w)
    return out


def fused_bf16(bf16_view: Tensors) -> dict[str, torch.Tensor]:
    """{vLLM layer: its fused bf16 weight} of the quantized weights."""
    quant = [n for n, t in bf16_view.items() if views.is_quantized_weight(n, t)]
    return {k: torch.cat([bf16_view[n] for n in ms]) for k, ms in fused_groups(quant).items()}


def requant_groups(a: Tensors, b: Tensors, kind: str) -> dict[str, int]:
    """What a follower applying the bf16 patch a -> b must re-quantize: groups (128x128 blocks,
    or whole fused layers) with at least one changed bf16 element, and their elements."""
    touched = total = elems = 0
    fb = fused_bf16(b)
    for key, wa in fused_bf16(a).items():
        diff = (dtypes.int_view(wa) != dtypes.int_view(fb[key])).reshape(wa.shape)
        if kind == "online-fp8-tensor":
            total += 1
            if bool(diff.any()):
                touched += 1
                elems += wa.numel()
            continue
        (m, n), (bm, bn) = wa.shape, BLOCK
        d = F.pad(diff.to(torch.uint8), (0, -(-n // bn) * bn - n, 0, -(-m // bm) * bm - m))
        hit = d.view(-1, bm, d.size(1) // bn, bn).amax(dim=(1, 3)).bool()
        ones = F.pad(torch.ones(m, n, dtype=torch.int32), (0, d.size(1) - n, 0, d.size(0) - m))
        size = ones.view(-1, bm, d.size(1) // bn, bn).sum(dim=(1, 3))
        total += hit.numel()
        touched += int(hit.sum())
        elems += int(size[hit].sum())
    return {"groups_total": total, "groups_touched": touched, "elements_requantized": elems}


# ---------------------------------------------------------------- one pair, one view


def kind_of(name: str, t: torch.Tensor) -> str:
    """'scales', 'norms' (1-D tensors, bf16 in every view) or 'weights' (the linear weights:
    bf16 values, fp8 codes, or packed FP4 bytes of two codes each)."""
    if name.endswith(("_scale_inv", "_global_scale", "_scale")):
        return "scales"
    return "norms" if t.dim() == 1 else "weights"


def patch_of(prev: Tensors, cur: Tensors, view: str, fps: Mapping[str, int], k: int):
    """(bytes, header) of the Stitch patch prev -> cur: PatchBuilder over the sorted names with
    known base fingerprints, as `stitch diff` (stitch_core/cli/main.py) and the Publisher do."""
    buf = io.BytesIO()
    b = PatchBuilder(buf, run="quant-views", base_version=k, target_version=k + 1, view=view)
    for name in sorted(set(prev) | set(cur)):
        b.add(name, prev.get(name), cur.get(name), fps.get(name))
    header = b.finish()
    return buf.getvalue(), header


def measure(prev: Tensors, cur: Tensors, view: str, k: int, _tamper=None) -> dict:
    """Changed elements per kind, patch bytes, and a bit-exact round trip of one pair
    (`_tamper`, for the test, alters the applied result before the check)."""
    fps = fpr.state_fingerprints(prev)
    data, header = patch_of(prev, cur, view, fps, k)
    got = apply({n: t.clone() for n, t in prev.items()}, data, base_fingerprints=fps)
    if _tamper is not None:
        _tamper(got)
    if set(got) != set(cur) or not all(
            got[n].dtype == t.dtype and torch.equal(dtypes.int_view(got[n]), dtypes.int_view(t))
            for n, t in cur.items()):
        raise AssertionError(f"{view} step {k}: the patch does not rebuild version k+1 exactly")
    row = {"view": view, "patch_bytes": len(data)}
    for kind in ("weights", "scales", "norms"):
        row[kind + "_total"] = row[kind + "_changed"] = row[kind + "_payload"] = 0
    by_name = {e.name: e for e in header.tensors}
    for name, t in cur.items():
        kind = kind_of(name, t)
        changed = int((dtypes.int_view(prev[name]) != dtypes.int_view(t)).sum())
        chunks = by_name[name].chunks
        if sum(c.count for c in chunks) != changed:
            raise AssertionError(f"{view} {name}: the header's count differs from the compare")
        row[kind + "_total"] += t.numel()
        row[kind + "_changed"] += changed
        row[kind + "_payload"] += sum(c.pos_bytes + c.val_bytes for c in chunks)
    row["changed"] = header.changed_elements
    row["total"] = header.total_elements
    return row


def layer_state(masters: Tensors) -> dict[str, torch.Tensor]:
    """The measured part of the model: the decoder layers."""
    return {n: t for n, t in masters.items() if n.startswith("model.layers.")}


def measure_step(m_prev: Tensors, m_cur: Tensors, k: int, view_list=ALL_VIEWS) -> list[dict]:
    """One row per view for the pair of master versions (m_prev, m_cur) (the decoder layers)."""
    rows = []
    bf16 = {}
    for v in STITCH_VIEWS:
        if v not in view_list and not (v == "bf16" and set(view_list) & set(ONLINE)):
            continue
        a = views.project(m_prev, v)
        b = views.project(m_cur, v, previous=a)
        if v == "bf16":
            bf16 = {"a": a, "b": b}
        if v in view_list:
            rows.append(measure(a, b, v, k))
    for v in ONLINE:
        if v in view_list:
            a, b = online_fp8(bf16["a"], v), online_fp8(bf16["b"], v)
            row = measure(a, b, v, k)
            row.update(requant_groups(bf16["a"], bf16["b"], v))
            sname = ".weight_scale" if v == "online-fp8-tensor" else ".weight_scale_inv"
            row["groups_rescaled"] = sum(
                int((dtypes.int_view(a[n]) != dtypes.int_view(b[n])).sum())
                for n in b if n.endswith(sname))
            rows.append(row)
    return rows


# ---------------------------------------------------------------- the run


def run_lr(shape: ModelShape, lr: float, warm: int, steps: int, seed: int,
           view_list=ALL_VIEWS, start: Tensors | None = None) -> list[dict]:
    """AdamW from the pretrained-like start at one lr: `warm` unmeasured steps, then `steps`
    measured pairs. Returns one row per (step, view)."""
    init = start if start is not None else pretrained_start(shape, seed)
    masters = {n: t.clone().requires_grad_(True) for n, t in init.items()}
    opt = torch.optim.AdamW(masters.values(), lr=lr, betas=(0.9, 0.999), weight_decay=0.01)
    grads = Gradients(masters, shape.vocab, seed)
    plain = {n: t.detach() for n, t in masters.items()}

    def adam_step() -> None:
        grads.step(masters)
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(warm):
        adam_step()
    rows = []
    prev = {n: t.clone() for n, t in layer_state(plain).items()}
    for k in range(steps):
        adam_step()
        cur = {n: t.clone() for n, t in layer_state(plain).items()}
        for row in measure_step(prev, cur, k, view_list):
            rows.append({"lr": lr, "step": k, **row})
        prev = cur
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    """Per (lr, view): sums over steps, fractions and ratios of sums."""
    out = []
    for lr in sorted({r["lr"] for r in rows}):
        here = [r for r in rows if r["lr"] == lr]
        bf16 = sum(r["patch_bytes"] for r in here if r["view"] == "bf16")
        for v in ALL_VIEWS:
            rs = [r for r in here if r["view"] == v]
            if not rs:
                continue
            s = {k: sum(r[k] for r in rs) for k in rs[0] if isinstance(rs[0][k], int)
                 and k != "step"}
            s.update(view=v, lr=lr, steps=len(rs))
            for kind in ("weights", "scales", "norms"):
                s[kind + "_frac"] = s[kind + "_changed"] / s[kind + "_total"] \
                    if s[kind + "_total"] else None
            s["changed_frac"] = s["changed"] / s["total"]
            s["bits_per_changed"] = 8 * s["patch_bytes"] / s["changed"] if s["changed"] else None
            s["payload_bytes"] = s["weights_payload"] + s["scales_payload"] + s["norms_payload"]
            s["payload_bits_per_changed"] = 8 * s["payload_bytes"] / s["changed"] \
                if s["changed"] else None
            s["vs_bf16"] = s["patch_bytes"] / bf16 if bf16 else None
            s["bf16_patch_bytes"] = bf16
            if "groups_total" in s:
                s["groups_touched_frac"] = s["groups_touched"] / s["groups_total"]
                s["groups_rescaled_frac"] = s["groups_rescaled"] / s["groups_total"]
                s["requant_frac"] = s["elements_requantized"] / s["weights_total"]
            out.append(s)
    return out


# ---------------------------------------------------------------- output


def pct(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{100 * x:.3f}%" if x < 0.1 else f"{100 * x:.1f}%"


LABEL = {"bf16": "bf16", "fp8-e4m3-block": "fp8-e4m3-block (pinned)", "mxfp4": "mxfp4 (pinned)",
         "nvfp4": "nvfp4 (pinned)", "online-fp8-tensor": "online fp8, per tensor (vLLM)",
         "online-fp8-block": "online fp8, 128x128 (vLLM)"}


def tables(summary: list[dict]) -> str:
    out = []
    for lr in sorted({s["lr"] for s in summary}):
        here = [s for s in summary if s["lr"] == lr]
        out += [f"### lr {lr:g}", "",
                "| view | weights changed | scales changed | norms changed | patch bytes | "
                "bits / changed element | payload bits / changed | vs bf16 patch |",
                "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for s in here:
            out.append(
                f"| {LABEL[s['view']]} | {pct(s['weights_frac'])} | {pct(s['scales_frac'])} | "
                f"{pct(s['norms_frac'])} | "
                f"{s['patch_bytes']:,} | "
                f"{s['bits_per_changed']:.2f} | {s['payload_bits_per_changed']:.2f} | "
                f"{s['vs_bf16']:.3f}x |")
        online = [s for s in here if "groups_total" in s]
        if online:
            out += ["", "Online fp8 (the engine re-quantizes what the bf16 patch touches; counts "
                    "summed over the measured steps):", "",
                    "| online fp8 | groups touched by the bf16 patch | groups re-scaled | "
                    "elements re-quantized | fp8 codes changed | bf16 patch bytes | "
                    "patch of the fp8 tensors (if shipped) |",
                    "|---|---:|---:|---:|---:|---:|---:|"]
            for s in online:
                unit = "tensors" if s["view"] == "online-fp8-tensor" else "blocks"
                out.append(
                    f"| {LABEL[s['view']]} | {s['groups_touched']:,} / {s['groups_total']:,} "
                    f"{unit} ({pct(s['groups_touched_frac'])}) | "
                    f"{s['groups_rescaled']:,} ({pct(s['groups_rescaled_frac'])}) | "
                    f"{pct(s['requant_frac'])} | {pct(s['weights_frac'])} | "
                    f"{s['bf16_patch_bytes']:,} | {s['patch_bytes']:,} |")
        out.append("")
    return "\n".join(out)


def compact(summary: list[dict]) -> str:
    """One row per view: weights changed, patch KB per step and bytes vs bf16, per lr."""
    lrs = sorted({s["lr"] for s in summary})
    out = ["| view | " + " | ".join(f"lr {lr:g}: changed, KB/step, vs bf16" for lr in lrs)
           + " |", "|---|" + "---:|" * len(lrs)]
    for v in ALL_VIEWS:
        ss = [next((s for s in summary if s["lr"] == lr and s["view"] == v), None) for lr in lrs]
        if None in ss:
            continue
        out.append(f"| {LABEL[v]} | " + " | ".join(
            f"{pct(s['weights_frac'])}, {s['patch_bytes'] / s['steps'] / 1e3:,.0f}, "
            f"{s['vs_bf16']:.3f}" for s in ss) + " |")
    return "\n".join(out)


def plot(summary: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lrs = sorted({s["lr"] for s in summary})
    fig, axes = plt.subplots(1, 2, figsize=(10.5, 4.4))
    for v in ALL_VIEWS:
        ss = [next((s for s in summary if s["lr"] == lr and s["view"] == v), None) for lr in lrs]
        if None in ss:
            continue
        style = "--" if v in ONLINE else "-"
        frac = [s["weights_frac"] for s in ss]
        axes[0].plot(lrs, [100 * f for f in frac], "o" + style, label=LABEL[v])
        axes[1].plot(lrs, [s["patch_bytes"] / s["steps"] / 1e6 for s in ss], "o" + style,
                     label=LABEL[v])
    axes[0].set_ylabel("weight elements changed per step (%)")
    axes[1].set_ylabel("patch MB per step")
    for ax in axes:
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("AdamW lr")
        ax.grid(alpha=0.3, which="both")
    axes[0].set_title("weight elements changed (codes; bf16 values)")
    axes[1].set_title("Stitch patch (online fp8: of the fp8 tensors)")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.savefig(path, dpi=110)


def check_vllm() -> int:
    """Compare vllm_fp8_per_block with vLLM's own per_block_cast_to_fp8 (needs vLLM)."""
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    w = {n: t.to(torch.bfloat16) for n, t in pretrained_start(tiny_shape(), 0).items()}
    bad = 0
    for key, t in fused_bf16(layer_state(w)).items():
        q1, s1 = per_block_cast_to_fp8(t, block_size=BLOCK, use_ue8m0=False)
        q2, s2 = vllm_fp8_per_block(t)
        same = torch.equal(q1.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(
            s1.view(torch.int32), s2.view(torch.int32))
        bad += not same
        print(f"{key} {tuple(t.shape)}: {'identical' if same else 'DIFFERS'}")
    print("per_block_cast_to_fp8 emulation:", "bit-identical" if not bad else f"{bad} differ")
    return 1 if bad else 0


def header_lines(a: argparse.Namespace, shape: ModelShape, n_measured: int,
                 seconds: float) -> str:
    try:
        commit = subprocess.run(["git", "-C", str(HERE.parent), "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(HERE.parent), "status", "--porcelain", "--",
                                "benchmarks/quant_views.py"], capture_output=True, text=True)
        commit += " (benchmarks/quant_views.py uncommitted)" if dirty.stdout.strip() else ""
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError, StopIteration):
        cpu = next(line.split(":", 1)[1].strip() for line in
                   Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name"))
    cmd = " ".join(["benchmarks/quant_views.py", *map(shlex.quote, sys.argv[1:])])
    return (
        f"# Quantized views under AdamW updates\n\n"
        f"`{cmd}` at git {commit}, {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, on {cpu} "
        f"({platform.machine()}, {len(os.sched_getaffinity(0))} cores), "
        f"torch {torch.__version__}, {a.threads} thread(s); {seconds:.0f} s.\n\n"
        f"Model: {shape.layers} decoder layer(s) of "
        f"{'a tiny test shape' if a.quick else 'a Qwen2.5-0.5B-like shape'} (hidden "
        f"{shape.hidden}, intermediate {shape.intermediate}, {shape.heads} heads / "
        f"{shape.kv_heads} KV heads), {n_measured / 1e6:.1f}M measured elements (the decoder "
        f"layers; embeddings and LM head, bf16 in every view, left out); pretrained-like start "
        f"(benchmarks/squash.py `pretrained_like`), {a.warm_steps} warm AdamW steps at the lr, "
        f"then {a.steps} measured step(s); sums over the measured steps. Real pretrained "
        f"weights: none (no package of the main venv ships any), so none measured.\n\n"
        "Weights changed: elements of the linear weights (bf16 values; fp8 codes; packed FP4 "
        "bytes, two codes each). Patch bytes: whole `.stp` files (PatchBuilder, as `stitch "
        "diff`), header included (one JSON entry per tensor: a fixed cost per step, about "
        "60% of the FP4 patches at lr 1e-6); payload bits: positions and values only. "
        "Every patch was applied and matched version k+1 bit for bit. Online fp8 emulates "
        "vLLM 0.32's online quantization (`--quantization fp8_per_tensor` / `fp8_per_block`, "
        "vllm/model_executor/layers/quantization/online/fp8.py; per block: "
        "vllm/utils/deep_gemm.py `per_block_cast_to_fp8`; per tensor: `ops.scaled_fp8_quant`, "
        "CUDA kernel csrc/quantization/w8a8/fp8/common.cu) on the fused layers vLLM quantizes "
        "(q/k/v, gate/up); `.venv-vllm/bin/python benchmarks/quant_views.py --check-vllm` "
        "compares the per-block emulation with vLLM's function bit for bit.\n"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a tiny shape, 1 step, one lr")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--lrs", default="1e-6,3e-6,1e-5")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--warm-steps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--md", default=None, help="markdown out (default: results/quant_views.md)")
    ap.add_argument("--json", default=None, help="JSON out (default: results/quant_views.json)")
    ap.add_argument("--png", default=None, help="plot (default: docs/img/quant_views.png)")
    ap.add_argument("--plot-only", action="store_true", help="redraw --png from --json")
    ap.add_argument("--check-vllm", action="store_true",
                    help="compare the per-block emulation with vLLM's function, then exit")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if a.check_vllm:
        sys.exit(check_vllm())
    if a.plot_only:
        summary = json.loads(Path(a.json or HERE / "results" / "quant_views.json").read_text())
        plot(summary["summary"], Path(a.png or HERE.parent / "docs" / "img" / "quant_views.png"))
        return
    if a.quick:
        shape, a.lrs, a.steps, a.warm_steps = tiny_shape(), "1e-5", 1, 2
    else:
        shape = qwen_like(a.layers, a.vocab)
    t0 = time.perf_counter()
    start = pretrained_start(shape, a.seed)
    rows = []
    for lr in (float(x) for x in a.lrs.split(",")):
        t1 = time.perf_counter()
        rows += run_lr(shape, lr, a.warm_steps, a.steps, a.seed, start=start)
        print(f"lr {lr:g}: {time.perf_counter() - t1:.0f} s", file=sys.stderr)
    summary = summarize(rows)
    n = sum(t.numel() for t in layer_state(start).values())
    md = (header_lines(a, shape, n, time.perf_counter() - t0) + "\n## Summary\n\n"
          + compact(summary) + "\n\n## Per learning rate\n\n" + tables(summary))
    print(md)
    quick = a.quick and a.md is None
    if not quick:  # --quick writes only where told to
        Path(a.md or HERE / "results" / "quant_views.md").write_text(md)
        Path(a.json or HERE / "results" / "quant_views.json").write_text(json.dumps(
            {"shape": shape.__dict__, "measured_elements": n, "args": vars(a),
             "summary": summary, "rows": rows}, indent=1))
        plot(summary, Path(a.png or HERE.parent / "docs" / "img" / "quant_views.png"))
    elif a.json:
        Path(a.json).write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
