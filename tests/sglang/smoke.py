#!/usr/bin/env python3
"""Smoke check: start SGLang's real engine on the CPU, send one completion, print the reply.

Run with the SGLang venv's python (sglang 0.5.23, torch 2.14.1, stitch installed editable):

    /work/sglang-venv/bin/python tests/sglang/smoke.py [--tp 2] [--model-dir DIR] [--port P]

With no --model-dir a tiny random Qwen2 checkpoint is built in a temporary folder
(``stitch_dev.tinymodel.build_tiny_model``). The stand-in ``sgl_kernel`` (tests/sglang/stub) is put
first on PYTHONPATH: the registry has no CPU build of ``sglang-kernel``, and dense models on the
torch_native backend call none of its functions. Start-up takes about 1.5-2.5 minutes on 2 busy
cores. The server runs in its own process group and is stopped (SIGTERM, then SIGKILL) at exit.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE.parent.parent) not in sys.path:  # run as a script: the repository root
    sys.path.insert(0, str(HERE.parent.parent))

# standard library only: the smoke script runs on its own
from stitch_dev.procs import free_port, sglang_cmd, sglang_env, stop  # noqa: E402


def post(url: str, body: dict, timeout: float = 60.0) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def wait_ready(base: str, proc: subprocess.Popen, timeout: float) -> float:
    """/health answers 503 until SGLang's own warm-up request succeeded, then 200."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=5) as r:
                if r.status == 200:
                    return time.monotonic() - t0
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(1.0)
    raise TimeoutError(f"server not ready after {timeout:.0f}s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--python", default=sys.executable, help="python of the SGLang venv")
    ap.add_argument("--model-dir", help="HF checkpoint dir (default: build a tiny Qwen2)")
    ap.add_argument("--arch", default="qwen2", help="tiny model: qwen2 | qwen3 | llama")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=600.0, help="start-up limit, seconds")
    ap.add_argument("--log", help="server log file (default: in the temp folder)")
    ap.add_argument("extra", nargs="*", help="extra SGLang flags (after --)")
    a = ap.parse_args()

    tmp = tempfile.TemporaryDirectory(prefix="stitch-sglang-smoke-")
    model_dir = a.model_dir
    if model_dir is None:
        from stitch_dev.tinymodel import build_tiny_model

        model_dir = str(Path(tmp.name) / f"tiny-{a.arch}")
        build_tiny_model(model_dir, arch=a.arch)
    port = a.port or free_port()
    base = f"http://127.0.0.1:{port}"
    log_path = a.log or str(Path(tmp.name) / "server.log")
    cmd = sglang_cmd(a.python, model_dir, port, a.tp, a.extra)
    print("+", " ".join(cmd), f"> {log_path}", flush=True)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, env=sglang_env(a.tp), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        startup = wait_ready(base, proc, a.timeout)
        print(f"ready after {startup:.1f}s", flush=True)
        comp = post(base + "/v1/completions", {
            "model": model_dir, "prompt": "Hello world", "max_tokens": 8,
            "temperature": 0, "logprobs": 1})
        print("completion:", json.dumps(comp, indent=1))
        gen = post(base + "/generate", {
            "text": "Hello world", "sampling_params": {"max_new_tokens": 8, "temperature": 0},
            "return_logprob": True})
        print("generate output_ids:", gen["output_ids"])
        print("generate weight_versions:", gen["meta_info"].get("weight_versions"))
        ok = (comp["choices"][0]["logprobs"]["tokens"] and len(gen["output_ids"]) == 8)
        print("SMOKE OK" if ok else "SMOKE FAILED", flush=True)
        return 0 if ok else 1
    except Exception:
        print(f"--- last lines of {log_path}", file=sys.stderr)
        with open(log_path, "rb") as f:
            sys.stderr.write(f.read()[-6000:].decode(errors="replace"))
        raise
    finally:
        t = time.monotonic()
        stop(proc)
        print(f"stopped in {time.monotonic() - t:.1f}s", flush=True)
        if a.log is None:
            tmp.cleanup()


if __name__ == "__main__":
    sys.exit(main())
