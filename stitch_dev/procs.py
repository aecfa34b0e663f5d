"""Engine server processes without a client library (standard library only, so that
tests/sglang/smoke.py runs on its own): stopping a server's process group, and the command
lines and environments of vLLM's and SGLang's OpenAI servers on the CPU with the Stitch plugin."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from .ports import free_port  # noqa: F401 (re-exported: the smoke script's one import)

ROOT = Path(__file__).resolve().parents[1]
# the stand-in sgl_kernel: no CPU build of SGLang's kernels exists, dense models on the
# torch_native backend call none of them
SGL_KERNEL_STUB = ROOT / "tests" / "sglang" / "stub"


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def stop(proc: subprocess.Popen, grace: float = 30.0, signal_group: bool = False) -> None:
    """SIGTERM the server (only its leader, or its whole group with `signal_group`), wait for its
    process group to empty, SIGKILL whatever is left after `grace` seconds. The server must have
    been started with start_new_session=True. SGLang's launcher stops its own schedulers and
    detokenizer; signalling its whole group makes it treat their exit as a crash (SIGQUIT
    diagnostics, 5 s sleep)."""
    pgid = proc.pid  # the leader of its own group
    if proc.poll() is None:
        if signal_group:
            os.killpg(pgid, signal.SIGTERM)
        else:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and group_alive(pgid):
        proc.poll()  # reap the leader so that the group can empty
        time.sleep(0.2)
    if group_alive(pgid):
        os.killpg(pgid, signal.SIGKILL)
    proc.wait()


# ---------------------------------------------------------------- vLLM

def vllm_cmd(python: str, model: str, port: int, tp: int = 1,
             max_model_len: int = 256, plain: bool = False) -> list[str]:
    """`python -m vllm.entrypoints.openai.api_server` with the Stitch worker extension and
    middleware (not when `plain`), small CPU settings."""
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
           "--dtype", "bfloat16", "--max-model-len", str(max_model_len), "--enforce-eager",
           "--max-num-seqs", "4", "--port", str(port), "--seed", "0",
           "--generation-config", "vllm"]
    if not plain:
        cmd += ["--worker-extension-cls", "stitch_vllm.worker.StitchWorkerExtension",
                "--middleware", "stitch_vllm.server.StitchMiddleware"]
    if tp > 1:
        cmd += ["-tp", str(tp), "--distributed-executor-backend", "mp"]
    return cmd


def vllm_env(base: Mapping[str, str], tp: int = 1, plain: bool = False,
             **stitch: str) -> dict[str, str]:
    """`base` with vLLM's CPU settings (1 GB KV cache, one core per rank) and STITCH_* set from
    `stitch`; `plain`: no STITCH_* at all and no entry-point plugin (``VLLM_PLUGINS=none``), so
    no part of Stitch loads."""
    env = dict(base)
    if plain:
        env = {k: v for k, v in env.items() if not k.startswith("STITCH_")}
        env["VLLM_PLUGINS"] = "none"
    env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_LOGGING_LEVEL="WARNING",
               VLLM_CPU_OMP_THREADS_BIND="nobind" if tp == 1 else "|".join(
                   str(i % (os.cpu_count() or 1)) for i in range(tp)))
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    env.update(stitch_env(**stitch))
    if env.get("STITCH_DEV_FP8_KERNEL"):  # the stand-in lives in stitch_dev (not in the wheel)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (dev_plugin_path(), env.get("PYTHONPATH")) if p)
    return env


def dev_plugin_path() -> str:
    """A directory holding only `stitch_dev` (a symlink to this package), for an engine's
    PYTHONPATH: dev-only code the plugin imports (STITCH_DEV_FP8_KERNEL) becomes importable while
    stitch_core and the plugins still come from the installed wheel."""
    import hashlib
    import tempfile

    key = hashlib.sha256(str(ROOT).encode()).hexdigest()[:12]
    d = Path(tempfile.gettempdir()) / f"stitch-dev-path-{os.getuid()}-{key}"
    link = d / "stitch_dev"
    if not link.exists():
        d.mkdir(mode=0o700, exist_ok=True)
        tmp = d / f".stitch_dev.{os.getpid()}"
        tmp.symlink_to(ROOT / "stitch_dev", target_is_directory=True)
        os.replace(tmp, link)
    return str(d)


def stitch_env(**stitch: object) -> dict[str, str]:
    """STITCH_<NAME> = str(value) for each keyword."""
    return {f"STITCH_{k.upper()}": str(v) for k, v in stitch.items()}


# ---------------------------------------------------------------- SGLang

def sglang_env(tp: int, extra_pythonpath: list[str] | None = None) -> dict[str, str]:
    """Environment for SGLang's CPU engine with the stand-in kernel first on PYTHONPATH."""
    env = dict(os.environ)
    paths = [str(SGL_KERNEL_STUB), *(extra_pythonpath or [])]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    if tp > 1:
        # one core per rank; no NCCL library on the CPU (gloo is used)
        env["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(str(i % (os.cpu_count() or 1))
                                                       for i in range(tp))
        env["SGLANG_NCCL_SO_PATH"] = "/nonexistent"
    return env


SGLANG_CPU_FLAGS = ["--device", "cpu", "--attention-backend", "torch_native",
                    "--disable-cuda-graph", "--disable-overlap-schedule"]


def sglang_cmd(python: str, model_dir: str, port: int, tp: int, extra: Sequence[str] = (),
               cpu: bool = True, sleep_on_idle: bool = True) -> list[str]:
    """`python -m sglang.launch_server` on 127.0.0.1:`port` (SGLang's CPU engine unless not
    `cpu`), its KV pool capped, sleeping when idle, then `extra` flags."""
    return [python, "-m", "sglang.launch_server", "--model-path", model_dir,
            "--host", "127.0.0.1", "--port", str(port),
            *(SGLANG_CPU_FLAGS if cpu else []),
            # without a cap the CPU KV pool takes ~70% of free memory (15 GB here)
            "--max-total-tokens", "8192",
            # an idle scheduler waits in a zmq poll (woken by any request, Stitch's control
            # requests included) instead of spinning cores the trainer and the next engine's
            # start need (figures: benchmarks/results/engine_idle.md)
            *(["--sleep-on-idle"] if sleep_on_idle else []),
            "--tp", str(tp), *extra]
