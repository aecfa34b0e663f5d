#!/usr/bin/env python3
"""The pause of an in-place apply against SGLang's own reload: SGLang serving a bf16 checkpoint as
bf16 and with online FP8 (``--quantization fp8``), the same versions, one run.

Per engine configuration, two SGLang HTTP servers side by side (CPU, TP=1, each idle while the
other is timed):

* **follower**: the Stitch plugin, started on `stitch pull` of v0; each version k is published to
  a local board and applied in place (gather, write, read-back, derived copies rebuilt: for
  online FP8 every touched layer re-quantized by SGLang's own post-load step, for bf16 on the AMX
  backend every touched layer re-packed). Read from ``/stitch/status`` ``last_apply``: the
  engine pause, the slowest rank's write, of which the rebuild, and how many copies it rebuilt.
* **reload**: a plain SGLang server (no plugin) started on v0, loading vk with SGLang's own
  ``/update_weights_from_disk`` (its loader, then every layer's post-load step: for online FP8
  SGLang re-quantizes every layer), timed from the client (the request includes SGLang's cache
  flush). Where SGLang's reload of a configuration fails, the table says why and the baseline
  is a fresh start of a plain server on each version (launch to healthy).

After each version both answer the same greedy prompts; "same outputs" compares tokens and top
logprobs (tests/sglang/test_fp8_online.py checks the follower against a *fresh* engine).

Data: the realistic test shape (``stitch_dev.tinymodel.REALISTIC``: Llama, 24 layers, hidden 512,
83M parameters) from its random bf16 weights as fp32 masters, each version the bf16 cast of the
masters after an Adam-like step (``benchmarks/fp8_online.py``'s ``make_versions``). SGLang's CPU
FP8 and packed layers run on its AMX backend; without the CPU build of sgl-kernel both servers
run it on the dev stand-in (``STITCH_DEV_FP8_KERNEL=standin``, ``stitch_dev.sgl_cpu_kernel``),
so bf16 layers are packed too; the stand-in's matmuls are not part of either timed path.

    .venv-sglang/bin/python benchmarks/fp8_online_sglang.py [--versions 3] [--lr 1e-6] [--md F]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
RUN = "bench-sg-online"
KERNEL = "standin"


def _pull(board: Path, run: str, version: int, out: Path, cache: Path) -> Path:
    import asyncio

    from stitch_core.versions.board import LocalBoard
    from stitch_core.versions.materialize import pull

    asyncio.run(pull(LocalBoard(board), run, version, out, cache, quiet=True))
    return out


def one(dirs: list[Path], work: Path, label: str, extra: list[str],
        failed: dict[str, str]) -> list[dict]:
    """Follower and reload side by side for one engine configuration (where SGLang's reload
    fails, `failed` gets why and a fresh start of each version is the baseline)."""
    from safetensors.torch import load_file

    from stitch_dev.engines import SglangServer
    from stitch_trainer import Publisher

    tag = label.replace(" ", "-")
    board = work / f"board-{tag}"
    pub = Publisher(str(board), f"{RUN}-{tag}", "bf16", config_dir=str(dirs[0]))
    plain = follower = None
    rows = []
    try:
        pub.publish(0, load_file(str(dirs[0] / "model.safetensors"))).result()
        v0 = _pull(board, f"{RUN}-{tag}", 0, work / f"pulled-{tag}", work / f"cache-{tag}")
        plain = SglangServer(v0, work / f"plain-{tag}.log", plain=True, extra=extra,
                             dev_fp8_kernel=KERNEL)
        plain.wait_healthy()
        follower = SglangServer(v0, work / f"follower-{tag}.log", extra=extra,
                                run=f"{RUN}-{tag}", board=str(board),
                                cache_dir=str(work / f"ec-{tag}"), reconcile_interval="0.2",
                                dev_fp8_kernel=KERNEL)
        copies = follower.wait_version(0, timeout=900)["derived_copies"]
        baseline = "reload"
        for k in range(1, len(dirs)):
            pub.publish(k, load_file(str(dirs[k] / "model.safetensors"))).result()
            last = follower.wait_applied(k, timeout=900)["last_apply"]
            if baseline == "reload":
                t = time.perf_counter()
                try:
                    plain.load_weights(dirs[k])
                except Exception as e:  # noqa: BLE001 - SGLang's reload of this configuration
                    failed[label] = f"{type(e).__name__}: {e}; server log: " + " | ".join(
                        ln for ln in plain.tail(400).splitlines() if "Error" in ln)[-600:]
                    print(f"{label}: SGLang's reload failed ({failed[label]}); a fresh start "
                          "of each version is the baseline instead", flush=True)
                    plain.stop()
                    baseline = "fresh start"
            if baseline == "fresh start":
                plain.stop()
                t = time.perf_counter()
                plain = SglangServer(dirs[k], work / f"plain-{tag}-v{k}.log", plain=True,
                                     extra=extra, dev_fp8_kernel=KERNEL)
                plain.wait_healthy()
            base_s = time.perf_counter() - t
            rows.append({"version": k, "changed": last["changed"],
                         "copies": sum(copies.values()), "rebuilt": last["derived_rebuilt"],
                         "pause_s": last["pause_s"], "write_s": last["write_rank_s"],
                         "rebuild_s": last["rebuild_rank_s"], "baseline": baseline,
                         "baseline_s": base_s,
                         "same": follower.outputs(k) == plain.outputs()})
            print(f"{label} v{k}: {rows[-1]}", flush=True)
    finally:
        pub.close()
        for s in (follower, plain):
            if s is not None:
                s.stop()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--versions", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--md", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--keep", action="store_true", help="keep the work directory (logs)")
    a = ap.parse_args()
    from fp8_online import make_versions

    work = Path(tempfile.mkdtemp(prefix="stitch-fp8-online-sglang-"))
    t_all = time.perf_counter()
    try:
        dirs = make_versions(work, a.versions, a.lr)
        failed: dict[str, str] = {}
        out = {label: one(dirs, work, label, extra, failed)
               for label, extra in (("bf16", []), ("online fp8", ["--quantization", "fp8"]))}
    finally:
        if a.keep:
            print(f"work directory kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    import sglang

    meta = {"host": f"{platform.machine()} {os.cpu_count()} CPUs", "lr": a.lr,
            "sglang": sglang.__version__, "reload_failed": failed,
            "total_s": time.perf_counter() - t_all,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    md = render(out, meta)
    print(md)
    if a.md:
        a.md.write_text(md)
    if a.json:
        a.json.write_text(json.dumps({"meta": meta, "rows": out}, indent=1))


def render(out: dict, meta: dict) -> str:
    lines = ["# In-place apply vs SGLang's own reload: bf16 and online FP8 (AMX backend)", "",
             f"`benchmarks/fp8_online_sglang.py` (read its docstring for the method); "
             f"{meta['date']}; {meta['host']}, SGLang {meta['sglang']}, lr {meta['lr']:g}, total "
             f"{meta['total_s']:.0f} s. Shared 2-core box: compare within a row.", "",
             "| engine | v | changed | copies rebuilt / kept | engine pause ms | rank write ms | "
             "of which rebuild ms | SGLang baseline | baseline ms | baseline / pause | "
             "same outputs |",
             "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---|"]
    for label, rows in out.items():
        for r in rows:
            lines.append(
                f"| {label} | {r['version']} | {r['changed']:,} | {r['rebuilt']} / {r['copies']} "
                f"| {r['pause_s'] * 1e3:.1f} | {r['write_s'] * 1e3:.1f} | "
                f"{r['rebuild_s'] * 1e3:.1f} | {r['baseline']} | {r['baseline_s'] * 1e3:.0f} | "
                f"{r['baseline_s'] / r['pause_s']:.1f}x | {'yes' if r['same'] else 'NO'} |")
    for label, why in meta["reload_failed"].items():
        lines += ["", f"SGLang's own reload (`/update_weights_from_disk`) of the {label} engine "
                  f"failed: {why}"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
