#!/usr/bin/env python3
"""Does this venv's engine load Stitch's FP4 checkpoints on the CPU? (docs/engines.md, "FP4 views")

    .venv-vllm/bin/python benchmarks/fp4_engines.py            # vLLM, both views
    .venv-sglang/bin/python benchmarks/fp4_engines.py          # SGLang (stand-in sgl_kernel)

A tiny Llama (stitch_dev.tinymodel) is published in the `mxfp4` and `nvfp4` views and pulled (the
path `stitch pull` takes) into compressed-tensors checkpoints; then the engine of the running
venv is built on each in a child process (vLLM: `vllm.LLM`; SGLang: `sglang.Engine` on the CPU)
and asked for 8 greedy tokens. Prints, per view, LOADED (with the tokens) or the engine's error.
Not a timing: a probe that says when an engine gains a CPU FP4 path.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # stitch_dev (the development harness) lives in the checkout
    sys.path.append(str(ROOT))
CHILD = r"""
import sys, traceback
engine, path = sys.argv[1], sys.argv[2]
try:
    if engine == "vllm":
        from vllm import LLM, SamplingParams
        llm = LLM(model=path, dtype="bfloat16", max_model_len=256, enforce_eager=True,
                  max_num_seqs=4, seed=0)
        out = llm.generate(["The quick brown fox"], SamplingParams(max_tokens=8, temperature=0))
        print("RESULT: LOADED", list(out[0].outputs[0].token_ids))
    else:
        import sglang
        e = sglang.Engine(model_path=path, device="cpu", attention_backend="torch_native",
                          disable_cuda_graph=True, disable_overlap_schedule=True,
                          max_total_tokens=8192)
        out = e.generate("The quick brown fox", {"max_new_tokens": 8, "temperature": 0})
        print("RESULT: LOADED", out.get("output_ids"))
        e.shutdown()
except BaseException as exc:
    traceback.print_exc()
    print("RESULT: FAILED", type(exc).__name__, str(exc).splitlines()[0][:300] if str(exc) else "")
"""


def checkpoints(work: Path, views: list[str]) -> dict[str, Path]:
    import torch
    from safetensors.torch import load_file

    from stitch_core.versions.board import LocalBoard
    from stitch_core.versions.materialize import pull
    from stitch_dev.tinymodel import build_tiny_model
    from stitch_trainer.publisher import Publisher

    src = work / "tiny-llama"
    build_tiny_model(src, arch="llama")
    out = {}
    for view in views:
        m = {k: v.to(torch.float32) for k, v in load_file(src / "model.safetensors").items()}
        board = work / f"board-{view}"
        with Publisher(str(board), "fp4", view, config_dir=src) as pub:
            pub.publish(0, m).result()
        out[view] = work / f"ckpt-{view}"
        asyncio.run(pull(LocalBoard(board), "fp4", None, out[view], work / "cache", quiet=True))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--views", default="nvfp4,mxfp4")
    ap.add_argument("--timeout", type=float, default=300)
    a = ap.parse_args()
    try:
        import vllm  # noqa: F401
        engine = "vllm"
    except ImportError:
        engine = "sglang"
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_CPU_OMP_THREADS_BIND="nobind", VLLM_ENABLE_V1_MULTIPROCESSING="0",
               SGLANG_USE_CPU_ENGINE="1")
    if engine == "sglang":  # no CPU sgl-kernel on the registry: the tests' stand-in
        env["PYTHONPATH"] = os.pathsep.join(
            [str(ROOT / "tests" / "sglang" / "stub"), env.get("PYTHONPATH", "")])
    with tempfile.TemporaryDirectory(prefix="stitch-fp4-engines-") as tmp:
        cks = checkpoints(Path(tmp), a.views.split(","))
        for view, ck in cks.items():
            try:
                r = subprocess.run([sys.executable, "-c", CHILD, engine, str(ck)], env=env,
                                   capture_output=True, text=True, timeout=a.timeout)
                lines = [x for x in r.stdout.splitlines() if x.startswith("RESULT:")]
                # an engine whose worker died (SGLang's scheduler) leaves its error in stderr
                errs = [x.strip() for x in r.stderr.splitlines()
                        if "Error:" in x or "Error(" in x]
                res = lines[-1] if lines else f"RESULT: FAILED (exit {r.returncode}) " + (
                    errs[-1][:300] if errs else "no error line")
            except subprocess.TimeoutExpired:
                res = f"RESULT: no answer in {a.timeout:.0f} s"
            print(f"{engine} {view}: {res.removeprefix('RESULT: ')}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
