#!/usr/bin/env python3
"""The pause of an in-place apply against the engine's own reload: vLLM serving a bf16 checkpoint
as bf16 and with online FP8 (``quantization="fp8_per_block"``, ``"fp8_per_tensor"``,
``"fp8_per_channel"``), the same versions, one run.

Per version k (1..V) of one model, two engines one after the other (in-process ``LLM``, TP=1, CPU):

* **follower**: started on v0 with the Stitch worker extension; applies the bf16 patch v(k-1)->vk
  through the rank's one write path (``stitch_apply``: gather, write, read-back, derived copies
  rebuilt: for online FP8 the touched layers re-quantized by vLLM's own method). Timed: the rank
  write (the work inside an engine pause), of which the re-quantization/re-pack; a bare
  ``index_put_`` of the same elements at the same engine positions (``stitch_dev.rank_baseline``).
* **reload**: started on v0 without following; loads vk through vLLM's own in-place
  ``reload_weights`` (its loaders, then every layer's post-load step: for online FP8 vLLM
  re-quantizes every layer). Timed: the reload call.

After each version both engines' parameters (the kernels' state: fp8 codes and scales for online
FP8) are hashed and compared: "same bits" says the in-place apply and vLLM's reload serve the same
numbers (tests/vllm/test_fp8_online.py checks the follower against a *fresh* engine).

Data: the realistic test shape (``stitch_dev.tinymodel.REALISTIC``: Llama, 24 layers, hidden 512,
GQA 8/2, MLP 1376, 32.8k vocab, tied embeddings; 83M parameters) from its random bf16 weights as
fp32 masters, each version the bf16 cast of the masters after an Adam-like step (every element
moves by ``lr * sign(noise)``). vLLM's CPU FP8 kernels need AMX: on hosts without it the
dev stand-in kernel serves (``STITCH_DEV_FP8_KERNEL=auto``); the stand-in kernel does not take
part in either timed path (re-quantization is vLLM's method). vLLM's CPU build has no static
per-tensor quantization op: ``fp8_per_tensor`` quantizes with the stand-in's torch copy of the
CUDA kernel's arithmetic, in both paths.

    .venv-vllm/bin/python benchmarks/fp8_online.py [--versions 3] [--lr 1e-6] [--md FILE]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("STITCH_DEV_FP8_KERNEL", "auto")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
EXT = "stitch_vllm.worker.StitchWorkerExtension"


def make_versions(work: Path, versions: int, lr: float) -> list[Path]:
    import torch
    from safetensors.torch import load_file, save_file

    from stitch_dev.tinymodel import REALISTIC, build_tiny_model

    v0 = build_tiny_model(work / "v0", seed=0, **REALISTIC)
    masters = {k: v.float() for k, v in load_file(str(v0 / "model.safetensors")).items()}
    dirs = [v0]
    g = torch.Generator().manual_seed(1)
    for k in range(1, versions + 1):
        for v in masters.values():
            v.add_(lr * torch.sign(torch.randn(v.shape, generator=g)))
        d = work / f"v{k}"
        shutil.copytree(v0, d, ignore=shutil.ignore_patterns("model.safetensors"))
        save_file({n: v.to(torch.bfloat16) for n, v in masters.items()},
                  str(d / "model.safetensors"), metadata={"format": "pt"})
        dirs.append(d)
    return dirs


def chunks(a: Path, b: Path) -> list:
    import torch
    from safetensors.torch import load_file

    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    out = []
    for n, t in wb.items():
        pos = (t.reshape(-1).view(torch.int16) != wa[n].reshape(-1).view(torch.int16)
               ).nonzero().squeeze(1)
        if pos.numel():
            out.append((n, pos, t.reshape(-1)[pos]))
    return out


def _served(worker) -> dict[str, str]:
    """A digest of every parameter the model holds (the kernels' state, not kept masters)."""
    import torch

    return {n: hashlib.blake2b(p.detach().contiguous().view(-1).view(torch.uint8).numpy()
                               .tobytes(), digest_size=16).hexdigest()
            for n, p in worker.model_runner.get_model().named_parameters()}


def _timed_repack(worker) -> None:
    rep = worker._stitch_replica()
    inner = rep.on_dirty
    worker._bench_repack_s = 0.0

    def on_dirty(dirty):
        t = time.perf_counter()
        out = inner(dirty)
        worker._bench_repack_s += time.perf_counter() - t
        return out

    rep.on_dirty = on_dirty


def _engine(model_dir: Path, quant: str | None):
    from vllm import LLM

    kw = {"quantization": quant} if quant else {}
    return LLM(model=str(model_dir), dtype="bfloat16", max_model_len=256, enforce_eager=True,
               seed=0, max_num_seqs=4, worker_extension_cls=EXT, disable_log_stats=True, **kw)


def _shutdown(llm) -> None:
    import contextlib
    import gc

    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    with contextlib.suppress(Exception):
        llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    cleanup_dist_env_and_memory()


def follow(dirs: list[Path], quant: str | None) -> list[dict]:
    from stitch_core.engine import rpc
    from stitch_dev.rank_baseline import Baseline

    llm = _engine(dirs[0], quant)
    rows = []
    try:
        llm.collective_rpc("stitch_learn_layout")
        llm.collective_rpc(_timed_repack)
        for k in range(1, len(dirs)):
            ch = chunks(dirs[k - 1], dirs[k])
            llm.collective_rpc(lambda w: setattr(w, "_bench_repack_s", 0.0))
            t = time.perf_counter()
            res = llm.collective_rpc("stitch_apply", args=(ch,))[0]
            write_s = time.perf_counter() - t
            repack_s = llm.collective_rpc(lambda w: w._bench_repack_s)[0]
            base = rpc.decode(llm.collective_rpc(
                "stitch_call", args=(rpc.encode(Baseline(repeat=3)),))[0])
            rows.append({"version": k, "changed": res["written"], "write_s": write_s,
                         "requant_s": repack_s, "layers": len(res["repacked"]),
                         "index_put_s": base.index_put_s,
                         "served": llm.collective_rpc(_served)[0]})
    finally:
        _shutdown(llm)
    return rows


def reload(dirs: list[Path], quant: str | None) -> list[dict]:
    llm = _engine(dirs[0], quant)
    rows = []
    try:
        for k in range(1, len(dirs)):
            t = time.perf_counter()
            llm.collective_rpc("reload_weights", kwargs={"weights_path": str(dirs[k])})
            rows.append({"version": k, "reload_s": time.perf_counter() - t,
                         "served": llm.collective_rpc(_served)[0]})
    finally:
        _shutdown(llm)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--versions", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--md", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--quant", default="bf16,fp8_per_block,fp8_per_tensor,fp8_per_channel",
                    help="engines to run: bf16 and/or vLLM online FP8 methods")
    a = ap.parse_args()
    from stitch_vllm.fp8 import install_fp8_keeper

    install_fp8_keeper()  # what the plugin does in every vLLM process
    from stitch_dev import fp8_kernel

    fp8_kernel.install()
    work = Path(tempfile.mkdtemp(prefix="stitch-fp8-online-"))
    t_all = time.perf_counter()
    try:
        dirs = make_versions(work, a.versions, a.lr)
        out = {}
        for q in a.quant.split(","):
            label, quant = ("bf16", None) if q == "bf16" else (f"online fp8 ({q})", q)
            f, r = follow(dirs, quant), reload(dirs, quant)
            for fr, rr in zip(f, r, strict=True):
                fr["reload_s"] = rr["reload_s"]
                fr["same_bits"] = fr.pop("served") == rr.pop("served")
            out[label] = f
    finally:
        shutil.rmtree(work, ignore_errors=True)
    meta = {"host": f"{platform.machine()} {os.cpu_count()} CPUs", "lr": a.lr,
            "python": platform.python_version(), "total_s": time.perf_counter() - t_all,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    md = render(out, meta)
    print(md)
    if a.md:
        a.md.write_text(md)
    if a.json:
        a.json.write_text(json.dumps({"meta": meta, "rows": out}, indent=1))


def render(out: dict, meta: dict) -> str:
    import vllm

    lines = ["# In-place apply vs vLLM's own reload: bf16 and online FP8", "",
             f"`benchmarks/fp8_online.py` (read its docstring for the method); {meta['date']}; "
             f"{meta['host']}, vLLM {vllm.__version__}, lr {meta['lr']:g}, total "
             f"{meta['total_s']:.0f} s. Shared 2-core box: compare within a row.", "",
             "| engine | v | changed | layers rebuilt | rank write ms | of which re-quant/re-pack "
             "ms | bare index_put_ ms | vLLM reload ms | reload / write | same bits as reload |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for label, rows in out.items():
        for r in rows:
            lines.append(
                f"| {label} | {r['version']} | {r['changed']:,} | {r['layers']} | "
                f"{r['write_s'] * 1e3:.1f} | {r['requant_s'] * 1e3:.1f} | "
                f"{r['index_put_s'] * 1e3:.2f} | {r['reload_s'] * 1e3:.0f} | "
                f"{r['reload_s'] / r['write_s']:.1f}x | {'yes' if r['same_bits'] else 'NO'} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
