#!/usr/bin/env python3
"""Engine apply benchmark: the pause of an in-place apply in a real engine (vLLM or SGLang), and
publish -> serving latency through the engine's real HTTP server with the Stitch plugin.

Targets (from the issue; benchmarks, not tests):

A. Engine pause per apply scales with the patch, not the model: per applied version, the rank's
   write call (the engine pause) vs a bare ``index_put_`` of the same elements at the same engine
   positions of the same tensors (``stitch_dev.rank_baseline``), goal <= 5x; a fit pause = a + b *
   changed per model size (tiny test model, ~10x, ~55x); the engine's own full reload of the same
   model as the model-size reference. On the CPU the write also re-packs every linear layer it
   touched when vLLM packed it (oneDNN/AMX hosts); that part is timed separately (GPUs do not
   pay it).
B. Publish -> engine serving the new version on loopback <= 2 s for the test model: a trainer
   (transformers, AdamW, random tokens) publishes to a local board + a real nats-server; a real
   ``vllm.entrypoints.openai.api_server`` with ``--worker-extension-cls``/``--middleware`` follows.
   Timed from just before ``publish()`` (and from its return) until ``/stitch/status`` shows the
   version (polled every 10 ms). Baseline, same run and weights: a full snapshot of the same
   model state published to a second board, then ``stitch pull`` of it into a fresh directory
   with a fresh cache: the full-checkpoint path up to where the engine would reload (the
   engine's own reload of this model is measured in A).

Process layout (vLLM 0.32 CPU cannot start an engine in a process that imported numba): this
driver trains, publishes and pulls; every engine runs in a child process (A: this script in
``--engine-job`` mode with an in-process engine created before anything imports numba; B: the
OpenAI server).

    .venv-vllm/bin/python benchmarks/engine_apply.py --quick     # ~2-3 min: tiny, B short
    .venv-vllm/bin/python benchmarks/engine_apply.py             # ~3.5-5 min: 3 sizes
    .venv-vllm/bin/python benchmarks/engine_apply.py --json out.json --md out.md

SGLang (``--engine sglang``, run with the SGLang venv's python; report
``results/engine_apply_sglang.md``): the same A and B through the ``stitch_sglang`` plugin.
A: the child creates an in-process ``sglang.Engine`` (CPU, torch_native attention, no CUDA graph,
no overlap schedule, 8192 KV tokens); its TokenizerManager lives in the child, the scheduler (the
rank, with its ``RankReplica``) is SGLang's subprocess, reached through ``SglangFollower.rpc``;
the Coordinator holds engine steps with the follower's ``pause``/``resume``
(``pause_generation(mode="in_place")`` / ``continue_generation``). The replica is in another
process, so the vLLM-only columns (re-pack, fp-delta, bare gather, tensors, packed layers) are
absent. B: ``python -m sglang.launch_server`` with the plugin's entry point and STITCH_* variables
(as in tests/sglang); start-up waits for v0 and then for SGLang's own warm-up (/health 200).
No CPU build of ``sgl_kernel`` exists: the stand-in ``tests/sglang/stub`` is put first on
PYTHONPATH of every SGLang process when torch sees no CUDA device, or with ``--sgl-kernel-stub``.

    .venv-sglang/bin/python benchmarks/engine_apply.py --engine sglang --quick
    .venv-sglang/bin/python benchmarks/engine_apply.py --engine sglang
"""

from __future__ import annotations

# Only the standard library and stitch_dev's process helpers (httpx, nothing of stitch_core) at
# module level: the --engine-job child must create its engine before anything imports numba
# (stitch_core's codec / fingerprint).
import argparse
import asyncio
import json
import os
import platform
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # stitch_dev (the development harness) lives in the checkout
    sys.path.append(str(ROOT))

from stitch_dev.ports import free_port  # noqa: E402
from stitch_dev.procs import (  # noqa: E402
    SGL_KERNEL_STUB,
    sglang_cmd,
    sglang_env,
    stitch_env,
    vllm_cmd,
    vllm_env,
)
from stitch_dev.server import ServerProcess  # noqa: E402

EXT = "stitch_vllm.worker.StitchWorkerExtension"

# name -> build_tiny_model overrides (qwen2 unless `arch`; head_dim 32/64 for vLLM's CPU attention)
SIZES = {
    "tiny": {},  # the test model: hidden 128, 2 layers, vocab 500 (~0.42M params)
    "10x": {"hidden_size": 256, "num_layers": 4, "intermediate_size": 768, "vocab_size": 2000},
    # ~55x the test model (23M params)
    "50x": {"hidden_size": 512, "num_layers": 6, "num_heads": 8, "num_kv_heads": 4,
            "intermediate_size": 1536, "vocab_size": 4000},
    # the shapes of Qwen2.5-0.5B (0.63B params with an untied lm_head; random weights): not in
    # the default run (its trainer needs ~10 GB and minutes per step on 2 cores), for
    # `--sizes q05b --lrs 1e-6 --versions 2 --skip-b`
    "q05b": {"hidden_size": 896, "num_layers": 24, "num_heads": 14, "num_kv_heads": 2,
             "intermediate_size": 4864, "vocab_size": 151936, "max_position_embeddings": 256},
    # the same shapes as a Qwen3-MoE (4 experts of a quarter of the intermediate size, top-2:
    # as many expert parameters per layer as q05b's dense MLP), for vLLM's grouped-GEMM packed
    # experts (`moe-packed`): `--sizes q05b-moe --lrs 1e-6 --versions 3 --skip-b`
    "q05b-moe": {"arch": "qwen3_moe", "hidden_size": 896, "num_layers": 24, "num_heads": 14,
                 "num_kv_heads": 2, "intermediate_size": 4864, "vocab_size": 151936,
                 "max_position_embeddings": 256},
    # the shapes of Qwen2.5-1.5B (1.54B params, tied embedding as there). Its AdamW trainer would
    # need ~25 GB (masters, grads, two moments): versions come from `SynthTrainer` instead (fp32
    # masters only, Adam-like steps): `--sizes q15b --lrs 1e-6 --versions 3 --skip-b`
    "q15b": {"hidden_size": 1536, "num_layers": 28, "num_heads": 12, "num_kv_heads": 2,
             "intermediate_size": 8960, "vocab_size": 151936, "max_position_embeddings": 256,
             "tie_word_embeddings": True, "synthetic": True},
}
# sglang.Engine / launch_server settings for SGLang's CPU engine (as stitch_dev.procs.sglang_cmd)
SGLANG_ENGINE = {"device": "cpu", "attention_backend": "torch_native", "disable_cuda_graph": True,
                 "disable_overlap_schedule": True, "max_total_tokens": 8192, "random_seed": 0}


def _engine_env(**stitch: str) -> dict[str, str]:
    """A vLLM process's environment: the engine suites' (stitch_dev.procs.vllm_env, TP=1)."""
    env = vllm_env(os.environ, **stitch)
    env["TOKENIZERS_PARALLELISM"] = "false"
    return env


def _sglang_env(stub: bool, **stitch: str) -> dict[str, str]:
    """An SGLang process's environment (stitch_dev.procs.sglang_env: SGLANG_USE_CPU_ENGINE=1, the
    stand-in sgl_kernel first on PYTHONPATH), without the stand-in unless `stub`."""
    env = sglang_env(1)
    if not stub:
        paths = [p for p in env["PYTHONPATH"].split(os.pathsep)
                 if p and p != str(SGL_KERNEL_STUB)]
        env["PYTHONPATH"] = os.pathsep.join(paths)
        if not paths:
            del env["PYTHONPATH"]
    env["TOKENIZERS_PARALLELISM"] = "false"
    env.update(stitch_env(**stitch))
    return env


def _ms(s: float | None) -> str:
    return "n/a" if s is None or s != s else f"{1e3 * s:.1f}"


def _phases(ph: dict[str, float] | None) -> str:
    """A build ahead's steps (`last_apply.prebuild_phases_s`) as ' [a / b / c / d]' ms."""
    return f" [{' / '.join(f'{1e3 * v:.0f}' for v in ph.values())}]" if ph else ""


def _med(xs):
    xs = [x for x in xs if x is not None and x == x]
    return statistics.median(xs) if xs else float("nan")


def _fit(xs, ys) -> tuple[float, float]:
    """Least squares y = a + b x (nan when x does not vary)."""
    n = len(xs)
    if n < 2:
        return float("nan"), float("nan")
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if not sxx:
        return float("nan"), float("nan")
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    return my - b * mx, b


# =========================================================================== A: engine child


class _JobEngine:
    """An engine in the --engine-job child: RPC to its rank(s) (timed per method), the
    Coordinator's pause/resume hooks, and per-apply instrumentation of the rank where the rank
    lives in this process (no-ops here; see _VllmJob)."""

    start_s = float("nan")

    def __init__(self) -> None:
        self.rpc_s: dict[str, float] = {}
        self.hooks: dict = {}  # Coordinator(pause=..., resume=...)

    async def _call(self, req) -> list:
        raise NotImplementedError

    async def rpc(self, req) -> list:
        """The Coordinator's transport, timed per request type (e.g. rpc_s["loadfiles"])."""
        t = time.perf_counter()
        out = await self._call(req)
        self.rpc_s[type(req).__name__.lower()] = time.perf_counter() - t
        return out

    def run(self, coro):
        return asyncio.run(coro)

    def attach(self) -> None:
        """After Coordinator.start (the rank's replica exists)."""

    def reset(self) -> None:
        """Before an apply or a reload."""

    def row(self) -> dict:
        """Extra columns of an applied version (after the `baseline` RPC)."""
        return dict.fromkeys(("repack_s", "repacked_layers", "dirty_params", "fp_delta_s",
                              "bare_gather_s", "tensors"))

    def reload(self) -> dict:
        return {"repack_s": None, "repacked_layers": None}

    def info(self) -> dict:
        return {"packed_layers": None, "linear_layers": None, "engine_params": None}

    def close(self) -> None:
        pass


class _TimedFpr:
    def __init__(self, mod):
        self._mod, self.seconds = mod, 0.0

    def __getattr__(self, name):
        return getattr(self._mod, name)

    def sum_at(self, *a, **k):
        t = time.perf_counter()
        try:
            return self._mod.sum_at(*a, **k)
        finally:
            self.seconds += time.perf_counter() - t


class _VllmJob(_JobEngine):
    """An in-process vLLM engine (engine core + worker in this process) reached through
    collective_rpc; the rank's replica is instrumented here (no stitch_core edits): the re-pack
    hook, the fingerprint-delta calls of the write, a bare gather."""

    def __init__(self, job: dict):
        super().__init__()
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core + worker in this process
        os.environ.update({k: v for k, v in _engine_env().items()
                           if k.startswith(("VLLM_", "TOK"))})
        from vllm import LLM  # the engine first: nothing has imported numba yet

        t0 = time.perf_counter()
        self.llm = LLM(model=job["model_dir"], dtype="bfloat16", max_model_len=256,
                       enforce_eager=True, seed=0, max_num_seqs=4, worker_extension_cls=EXT,
                       disable_log_stats=True)
        self.start_s = time.perf_counter() - t0

        import stitch_core.engine.replica as replica_mod

        self.worker = self.llm.collective_rpc(lambda w: getattr(w, "worker", w))[0]
        self.timed_fpr = _TimedFpr(replica_mod.fpr)
        replica_mod.fpr = self.timed_fpr
        self.repack = {"seconds": 0.0, "layers": 0, "dirty": 0}

    async def _call(self, req) -> list:
        from stitch_core.engine import rpc

        return [rpc.decode(r) for r in
                self.llm.collective_rpc("stitch_call", args=(rpc.encode(req),))]

    def attach(self) -> None:
        rep = self.rep = self.worker._stitch_replica()
        on_dirty = rep.on_dirty

        def timed_dirty(dirty):
            t = time.perf_counter()
            out = on_dirty(dirty)
            self.repack["seconds"] += time.perf_counter() - t
            # the worker's hook returns nothing; it keeps the re-packed layers' names
            self.repack["layers"] += len(getattr(self.worker, "_stitch_repacked", None) or ())
            self.repack["dirty"] += len(dirty)
            return out

        rep.on_dirty = timed_dirty

    def reset(self) -> None:
        self.repack.update(seconds=0.0, layers=0, dirty=0)
        self.timed_fpr.seconds = 0.0

    def row(self) -> dict:
        return {"repack_s": self.repack["seconds"], "repacked_layers": self.repack["layers"],
                "dirty_params": self.repack["dirty"], "fp_delta_s": self.timed_fpr.seconds,
                "bare_gather_s": self._bare_gather(), "tensors": len(self.rep.last_write)}

    def reload(self) -> dict:
        return {"repack_s": self.repack["seconds"], "repacked_layers": self.repack["layers"]}

    def info(self) -> dict:
        mods = list(self.rep.model.modules())
        from stitch_core.engine import derived

        return {"packed_layers": sum(derived.kinds(self.rep.model).values()),
                "linear_layers": sum(hasattr(m, "cpu_linear") for m in mods),
                "engine_params": sum(p.numel() for p in self.rep._params().values())}

    def _bare_gather(self) -> float:
        """Best of 5: a bare `flat[eng]` of the last write's positions (one indexed read)."""
        best = float("inf")
        for _ in range(5):
            t = time.perf_counter()
            for flat, eng in self.rep.last_write:
                flat[eng]
            best = min(best, time.perf_counter() - t)
        return best


class _SglangJob(_JobEngine):
    """An in-process `sglang.Engine`: its TokenizerManager in this process, the scheduler (the
    rank, with its RankReplica, installed by the plugin) a subprocess. RPC, pause and resume are
    `stitch_sglang.server.SglangFollower`'s (the follower itself is not started)."""

    def __init__(self, job: dict):
        super().__init__()
        import sglang  # loads the plugins (stitch_sglang's scheduler hook) in every process

        t0 = time.perf_counter()
        self.engine = sglang.Engine(model_path=job["model_dir"], **SGLANG_ENGINE)
        self.start_s = time.perf_counter() - t0

        from stitch_core.node import Settings
        from stitch_sglang.server import SglangFollower

        self.follower = SglangFollower(self.engine.tokenizer_manager, Settings())
        self.hooks = {"pause": self.follower.pause, "resume": self.follower.resume}

    async def _call(self, req) -> list:
        return await self.follower.rpc(req)

    def run(self, coro):
        return self.engine.loop.run_until_complete(coro)

    def close(self) -> None:
        self.engine.shutdown()


JOB_ENGINES = {"vllm": _VllmJob, "sglang": _SglangJob}


def engine_job(job_path: str) -> None:
    """Child process: an in-process engine driven by a Coordinator through the engine's RPC."""
    job = json.loads(Path(job_path).read_text())
    eng = JOB_ENGINES[job.get("engine", "vllm")](job)  # before anything imports numba

    import gc

    from stitch_core.engine.coordinator import Coordinator
    from stitch_core.versions.board import LocalBoard
    from stitch_core.versions.store import fetch_object, fetch_patch, read_manifest
    from stitch_dev.rank_baseline import Baseline  # registers the rank handler (also on unpickle)

    board = LocalBoard(job["board"])
    cache = Path(job["cache"])
    rows: list[dict] = []
    reloads: list[dict] = []
    rpc_s = eng.rpc_s

    async def go() -> dict:
        runs = job["runs"]
        stage = {} if job.get("stage_memory") is None else {"stage_memory": job["stage_memory"]}
        coord = Coordinator(eng.rpc, run=runs[0]["run"], **eng.hooks, **stage)
        t = time.perf_counter()
        await coord.start(job["model_dir"])
        start_s = time.perf_counter() - t
        eng.attach()
        for i, r in enumerate(runs):
            if i:  # back to this run's v0 through the engine's own loader: the full-reload cost
                m0 = await read_manifest(board, r["run"], 0)
                snap = None
                for ref in m0.weights:
                    snap = (await fetch_object(board, m0, ref, cache)).parent
                coord.run = r["run"]
                eng.reset()
                gc.collect()
                t = time.perf_counter()
                await coord.load_snapshot(m0, snap)
                reloads.append({"run": r["run"], "seconds": time.perf_counter() - t,
                                "load_files_s": rpc_s.get("loadfiles"),
                                "sums_s": rpc_s.get("sums"), **eng.reload()})
            for v in range(1, r["versions"] + 1):
                m = await read_manifest(board, r["run"], v)
                paths = await fetch_patch(board, m, cache)
                gc.collect()  # outside the timers: no collection lands in one apply by chance
                eng.reset()
                st = await coord.apply_patch(m, paths)
                base = (await eng.rpc(Baseline(repeat=5)))[0]
                rows.append({
                    "run": r["run"], "lr": r["lr"], "version": v, "changed": st["changed"],
                    "total_elements": m.total_elements, "patch_bytes": st["patch_bytes"],
                    "gather_s": st["gather_s"], "gather_rank_s": st["gather_rank_s"],
                    "write_s": st["write_s"], "write_rank_s": st["write_rank_s"],
                    "pause_s": st["pause_s"], "total_s": st["total_s"],
                    "batches": st.get("batches"), "staged_batches": st.get("staged_batches"),
                    "index_put_s": base.index_put_s, "index_put_elements": base.elements,
                    "prebuild_s": st.get("prebuild_s"), "prebuilt": st.get("prebuilt"),
                    "derived_ahead": st.get("derived_ahead"),
                    "prebuild_phases_s": st.get("prebuild_phases_s"),
                    **eng.row(), "cold": i == 0 and v == 1,
                })
        t = time.perf_counter()
        check = await coord.verify()
        verify_s = time.perf_counter() - t
        if not check["ok"]:
            raise SystemExit(f"final full check failed: {check}")
        return {"start_s": start_s, "verify_s": verify_s, "version": coord.version,
                "fallback": sorted(coord.fallback), "setup_rank": rpc_s.get("setup"),
                **eng.info()}

    info = eng.run(go())
    Path(job["out"]).write_text(json.dumps({
        "rows": rows, "reloads": reloads, "engine_start_s": eng.start_s, **info}))
    eng.close()
    os._exit(0)  # skip the engine's slow interpreter teardown


# =========================================================================== driver: trainer


class SweepTrainer:
    """A real HF model trained by transformers with AdamW (weight decay, a learning rate the
    sweep sets per run) on random tokens, publishing when asked."""

    def __init__(self, model_dir: Path, board: Path, run: str, lr: float, nats: str | None,
                 seed: int = 0):
        import torch
        from transformers import AutoModelForCausalLM

        from stitch_trainer import Publisher

        torch.manual_seed(seed)
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.01)
        self.g = torch.Generator().manual_seed(seed + 1)
        self.pub = Publisher(str(board), run, "bf16", nats=nats, config_dir=model_dir)
        self.step = 0

    def set_lr(self, lr: float) -> None:
        for g in self.opt.param_groups:
            g["lr"] = lr

    def train_step(self) -> None:
        x = self.torch.randint(0, self.model.config.vocab_size, (4, 32), generator=self.g)
        loss = self.model(input_ids=x, labels=x).loss
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        self.step += 1

    def publish(self):
        return self.pub.publish(self.step, self.model)


class SynthTrainer:
    """Versions of a model too large for a real AdamW on this box: fp32 masters read from the
    checkpoint, and per step every element moves as Adam's normalised update moves it, by
    lr x N(0, 1), after decoupled weight decay (0.01). Only the masters are held (4 bytes per
    parameter), not gradients or moments. The report gives each version's changed fraction (at
    lr 1e-6 one such step changes 0.7-2.2% of a random q05b-shape matrix, 0.05-0.06% of its
    embedding); the bare `index_put_` baseline writes the same elements, so the pause ratio does
    not depend on which trainer made them."""

    def __init__(self, model_dir: Path, board: Path, run: str, lr: float, nats: str | None,
                 seed: int = 0):
        import torch
        from safetensors import safe_open

        from stitch_trainer import Publisher

        self.torch, self.lr, self.step = torch, lr, 0
        with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
            self.masters = {k: f.get_tensor(k).float() for k in f.keys()}  # noqa: SIM118
        self.g = torch.Generator().manual_seed(seed + 1)
        self.pub = Publisher(str(board), run, "bf16", nats=nats, config_dir=model_dir)

    def train_step(self) -> None:
        torch = self.torch
        for w in self.masters.values():
            w.mul_(1 - self.lr * 0.01).add_(torch.randn(w.shape, generator=self.g), alpha=self.lr)
        self.step += 1

    def publish(self):
        return self.pub.publish(self.step, self.masters)


def prepare_size(work: Path, size: str, cfg: dict, lrs: list[float], versions: int) -> dict:
    """Build the model, publish v0..vN for each lr (one run per lr, same v0), pull v0."""
    from stitch_core.versions.board import LocalBoard
    from stitch_core.versions.materialize import pull
    from stitch_dev.tinymodel import build_tiny_model

    d = work / size
    cfg = dict(cfg)
    trainer = SynthTrainer if cfg.pop("synthetic", False) else SweepTrainer
    model_dir = build_tiny_model(d / "model", arch=cfg.pop("arch", "qwen2"), **cfg)
    board = d / "board"
    runs = []
    t0 = time.perf_counter()
    for i, lr in enumerate(lrs):
        run = f"{size}-lr{lr:.0e}".replace("+", "").replace(".", "p")
        tr = trainer(model_dir, board, run, lr, None)
        tr.publish().result()
        n = versions + (i == 0)  # the first apply in the engine process is cold (numba JIT)
        for _ in range(n):
            tr.train_step()
            tr.publish()
        tr.pub.close()
        tr = None  # the masters go before the pull and the engine (q15b: 6 GB)
        runs.append({"run": run, "lr": lr, "versions": n})
    publish_s = time.perf_counter() - t0
    asyncio.run(pull(LocalBoard(board), runs[0]["run"], 0, d / "v0", d / "pull-cache",
                     quiet=True))
    return {"model_dir": str(d / "v0"), "board": str(board), "cache": str(d / "engine-cache"),
            "runs": runs, "out": str(d / "engine.json"), "prep_s": publish_s}


def run_engine_job(job: dict, log: Path, timeout: float, env: dict[str, str]) -> dict:
    jp = Path(job["out"]).with_suffix(".job.json")
    jp.write_text(json.dumps(job))
    with open(log, "wb") as f:
        # its own process group: an engine's subprocesses (SGLang's scheduler) go with it
        p = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--engine-job",
                              str(jp)], stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                             start_new_session=True)
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            raise SystemExit(f"engine job timed out after {timeout:.0f} s; log {log}") from None
        finally:
            if p.poll() is None:  # interrupted: take the engine down with us
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    if p.returncode != 0 or not Path(job["out"]).exists():
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
        raise SystemExit(f"engine job failed ({p.returncode}); log {log}:\n{tail}")
    return json.loads(Path(job["out"]).read_text())


# =========================================================================== B: server


class Server(ServerProcess):
    """`python -m vllm.entrypoints.openai.api_server` with the Stitch worker extension and
    middleware (stitch_dev.procs.vllm_cmd, as stitch_dev.engines.VllmServer; TP=1, CPU), run
    from this process's directory."""

    name = "vLLM server"

    def __init__(self, model_dir: Path, log: Path, *, stub: bool = False, **stitch: str):
        port = free_port()
        super().__init__(self.command(model_dir, port), self.environment(stub, **stitch), port,
                         str(model_dir), log, cwd=None, timeout=30)

    def command(self, model_dir: Path, port: int) -> list[str]:
        return vllm_cmd(sys.executable, str(model_dir), port)

    def environment(self, stub: bool, **stitch: str) -> dict[str, str]:
        env = _engine_env(**stitch)
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        return env

    def status(self) -> dict | None:  # type: ignore[override]
        """/stitch/status, or None while it does not answer."""
        import httpx

        try:
            return self.http.get("/stitch/status", timeout=5).json()
        except (httpx.HTTPError, ValueError):
            return None

    def wait_ready(self, timeout: float) -> None:
        """Serving the loaded version (v0)."""
        self.wait_version(0, timeout)


class SglangServer(Server):
    """`python -m sglang.launch_server` (CPU flags of stitch_dev.procs.sglang_cmd) made a
    follower by the installed plugin and STITCH_* variables, as stitch_dev.engines.SglangServer
    (TP=1)."""

    name = "SGLang server"
    signal_group = False  # SIGTERM the launcher (it stops its schedulers), SIGKILL leftovers

    def command(self, model_dir: Path, port: int) -> list[str]:
        return sglang_cmd(sys.executable, str(model_dir), port, 1, ["--random-seed", "0"])

    def environment(self, stub: bool, **stitch: str) -> dict[str, str]:
        return _sglang_env(stub, **stitch)

    def wait_ready(self, timeout: float) -> None:
        """v0 proven, then SGLang's own warm-up (a /generate, held until v0) passed: /health."""
        t0 = time.monotonic()
        self.wait_version(0, timeout)
        self.wait_healthy(max(0.0, timeout - (time.monotonic() - t0)))


def serve_latency(work: Path, lrs: list[float], per_lr: int, poll: float,
                  server_cls: type[Server] = Server, stub: bool = False) -> dict:
    from stitch_core.versions.board import LocalBoard
    from stitch_core.versions.materialize import pull
    from stitch_core.versions.natsserver import NatsServer
    from stitch_dev.tinymodel import build_tiny_model
    from stitch_trainer import Publisher

    d = work / "serve"
    model_dir = build_tiny_model(d / "model", arch="qwen2")
    board, snap_board = d / "board", d / "snapshot-board"
    run = "serve"
    rows, warm = [], None
    with NatsServer(store_dir=d / "nats", port=None) as ns:
        tr = SweepTrainer(model_dir, board, run, lrs[0], ns.url)
        tr.publish().result()
        asyncio.run(pull(LocalBoard(board), run, 0, d / "v0", d / "pull-cache", quiet=True))
        t = time.perf_counter()
        server = server_cls(d / "v0", d / "server.log", stub=stub, board=str(board),
                            nats_url=ns.url, run=run, cache_dir=str(d / "engine-cache"),
                            reconcile_interval="5")
        try:
            server.wait_ready(timeout=600)
            server_start_s = time.perf_counter() - t
            plan = [None] + [lr for lr in lrs for _ in range(per_lr)]  # first: warm-up (cold)
            for lr in plan:
                tr.set_lr(lr if lr is not None else lrs[0])
                tr.train_step()  # outside every timer
                time.sleep(0.3)
                stamp: dict[str, float] = {}
                t0 = time.perf_counter()
                info = tr.publish()
                t_ret = time.perf_counter()
                info.future.add_done_callback(  # when the manifest is on the board + announced
                    lambda _f, s=stamp: s.setdefault("board", time.perf_counter()))
                v = info.version
                while True:
                    st = server.status()
                    sv = st.get("version") if st else None
                    if sv is not None and sv >= v and st.get("state") == "serving":
                        t_serve = time.perf_counter()
                        break
                    if server.proc.poll() is not None or time.perf_counter() - t0 > 120:
                        raise SystemExit(f"v{v} not served; log {server.log}")
                    time.sleep(poll)
                m = info.result(60)
                for _ in range(500):  # last_apply is set just after the version becomes visible
                    st = server.status() or {}
                    if (st.get("last_apply") or {}).get("version") == v:
                        break
                    time.sleep(0.01)
                la = st.get("last_apply") or {}
                # baseline, same weights: a full snapshot published by a fresh Publisher (no
                # base: snapshot only, no patch encode) to a second board, then `stitch pull`
                # of it into a fresh directory with a fresh cache
                snap_pub = Publisher(str(snap_board), run, "bf16", config_dir=model_dir)
                tp = time.perf_counter()
                ms = snap_pub.publish(tr.step, tr.model).result(120)
                snap_publish_s = time.perf_counter() - tp
                snap_pub.close()
                assert ms.kind == "snapshot" and ms.fingerprints == m.fingerprints
                pd, pc = d / f"pull-{v}", d / f"pull-cache-{v}"
                tp = time.perf_counter()
                asyncio.run(pull(LocalBoard(snap_board), run, ms.version, pd, pc, quiet=True))
                pull_s = time.perf_counter() - tp
                shutil.rmtree(pd, ignore_errors=True)
                shutil.rmtree(pc, ignore_errors=True)
                row = {"version": v, "lr": lr, "changed": m.changed_elements,
                       "total_elements": m.total_elements, "patch_bytes": m.patch_bytes,
                       "publish_call_s": t_ret - t0,
                       "board_s": stamp.get("board", float("nan")) - t0,
                       "serve_s": t_serve - t0, "serve_after_return_s": t_serve - t_ret,
                       "apply_total_s": la.get("total_s"), "gather_s": la.get("gather_s"),
                       "write_s": la.get("write_s"), "pause_s": la.get("pause_s"),
                       "write_rank_s": la.get("write_rank_s"),
                       "gather_rank_s": la.get("gather_rank_s"),
                       "gate_apply_s": st.get("last_apply_seconds"),
                       "snapshot_publish_s": snap_publish_s, "pull_s": pull_s,
                       "baseline_s": snap_publish_s + pull_s}
                if lr is None:
                    warm = row
                else:
                    rows.append(row)
            final = server.status() or {}
        finally:
            server.stop()
            tr.pub.close()
    return {"rows": rows, "warmup": warm, "server_start_s": server_start_s,
            "params": rows[0]["total_elements"] if rows else None,
            "final_check": final.get("fingerprint_check"), "final_version": final.get("version")}


# =========================================================================== report


# =========================================================================== report


def _cold(r) -> str:
    return " (cold: first apply, JIT)" if r.get("cold") else ""


# per applied version: (header, cell(row, size, params), which runs have it: None all of them,
# True only those with the in-process rank probe (vLLM), False only those without (SGLang))
A_ROW_COLS = [
    ("model", lambda r, s, n: f"{s} ({n / 1e6:.2f}M)", None),
    ("lr", lambda r, s, n: f"{r['lr']:.0e}", None),
    ("v", lambda r, s, n: f"{r['version']}{_cold(r)}", None),
    ("changed", lambda r, s, n: f"{r['changed']:,}", None),
    ("changed %", lambda r, s, n: f"{100 * r['changed'] / r['total_elements']:.3f}", None),
    ("patch KB", lambda r, s, n: f"{r['patch_bytes'] / 1e3:.1f}", None),
    ("gather ms", lambda r, s, n: _ms(r["gather_s"]), True),
    ("gather ms (on the rank)",
     lambda r, s, n: f"{_ms(r['gather_s'])} ({_ms(r['gather_rank_s'])})", False),
    ("built ahead ms (copies, installed) [copy / write / build / digest ms, slowest rank]",
     lambda r, s, n: f"{_ms(r.get('prebuild_s'))} ({r.get('prebuilt')}, "
     f"{r.get('derived_ahead')})" + _phases(r.get("prebuild_phases_s")), True),
    ("**rank write ms**", lambda r, s, n: f"**{_ms(r['write_rank_s'])}**", None),
    ("of which re-pack ms (layers)",
     lambda r, s, n: f"{_ms(r['repack_s'])} ({r['repacked_layers']})", True),
    ("fp-delta ms", lambda r, s, n: _ms(r["fp_delta_s"]), True),
    ("rest ms", lambda r, s, n: _ms(r["write_rank_s"] - r["repack_s"] - r["fp_delta_s"]), True),
    ("write RPC ms", lambda r, s, n: _ms(r["write_s"]), False),
    ("**bare index_put_ ms**", lambda r, s, n: f"**{_ms(r['index_put_s'])}**", None),
    ("bare gather ms", lambda r, s, n: _ms(r.get("bare_gather_s")), True),
    ("**write / index_put_**", lambda r, s, n: f"**{r['ratio']:.1f}**", None),
    ("(write - re-pack) / index_put_", lambda r, s, n: f"{r['ratio_norepack']:.1f}", True),
    ("ns per changed elem (write - re-pack)", lambda r, s, n: f"{r['ns_per_elem']:.0f}", True),
    ("ns per changed elem (rank write)", lambda r, s, n: f"{r['ns_per_elem']:.0f}", False),
    ("coordinator pause ms", lambda r, s, n: _ms(r["pause_s"]), None),
    # over STITCH_APPLY_MEMORY an apply is decoded in batches, the later ones inside the pause
    # ... unless every batch is staged on the ranks ahead of it (STITCH_STAGE_MEMORY)
    ("batches (staged ahead)",
     lambda r, s, n: f"{r.get('batches', '?')} ({r.get('staged_batches', '?')})", None),
    ("apply total ms", lambda r, s, n: _ms(r["total_s"]), None),
]


def _by_lr(d: dict) -> str:
    return ", ".join(f"{lr}: {v:.1f}" for lr, v in d.items())


def _fits(s: dict) -> str:
    return f"a={_ms(s['fit_fixed_s'])}, b={1e9 * s['fit_ns_per_elem']:.0f}"


# per model: (header, cell(size, summary), which runs have it, as above)
A_MODEL_COLS = [
    ("model", lambda z, s: z, None),
    ("params", lambda z, s: f"{s['params'] / 1e6:.2f}M", None),
    ("tensors written", lambda z, s: f"{s['tensors']}", True),
    ("packed linear layers", lambda z, s: f"{s['packed_layers']} of {s['linear_layers']}", True),
    ("median write / index_put_ (max)",
     lambda z, s: f"{s['median_ratio']:.1f} ({s['max_ratio']:.1f})", None),
    ("median (write - re-pack) / index_put_",
     lambda z, s: f"{s['median_ratio_norepack']:.1f}", True),
    ("re-pack share of write", lambda z, s: f"{100 * s['repack_share']:.0f}%", True),
    ("median rank write ms by lr", lambda z, s: _by_lr(s["write_ms_by_lr"]), None),
    ("write - re-pack = a + b * changed (fit to the per-lr medians): a ms, b ns/elem",
     lambda z, s: _fits(s), True),
    ("rank write = a + b * changed (fit to the per-lr medians): a ms, b ns/elem",
     lambda z, s: _fits(s), False),
    ("same fit for bare index_put_",
     lambda z, s: f"a={_ms(s['index_put_fit_fixed_s'])}, "
                  f"b={1e9 * s['index_put_fit_ns_per_elem']:.0f}", None),
    ("full reload via the engine's loader ms (+ full sums)",
     lambda z, s: f"{_ms(s['reload_load_files_s'])} ({_ms(s['reload_s'])})", None),
    ("full fingerprint check ms", lambda z, s: _ms(s["verify_s"]), None),
    ("engine start s", lambda z, s: f"{s['engine_start_s']:.1f}", None),
    ("Stitch start-up: layout learning + full sums s", lambda z, s: f"{s['start_s']:.1f}", None),
]


def _table(cols, probe: bool) -> tuple[list[str], list]:
    cols = [c for c in cols if c[2] is None or c[2] == probe]
    return ["| " + " | ".join(c[0] for c in cols) + " |", "|" + "---|" * len(cols)], cols


def _probed(sizes: dict[str, dict]) -> bool:
    """The rows carry the in-process rank probe's columns (vLLM's job)."""
    return all(r.get("repack_s") is not None for res in sizes.values() for r in res["rows"])


def report_a(sizes: dict[str, dict], title: str) -> tuple[list[str], dict]:
    probe = _probed(sizes)
    head, cols = _table(A_ROW_COLS, probe)
    out = [f"### A. {title}, per applied version", "", *head]
    summary: dict = {}
    for size, res in sizes.items():
        n = res["rows"][0]["total_elements"] if res["rows"] else 0
        for r in res["rows"]:
            w, ip = r["write_rank_s"], r["index_put_s"]
            rp = r["repack_s"] or 0.0  # no probe: nothing to take out
            r["ratio"] = w / ip if ip else float("nan")
            r["ratio_norepack"] = ((w - rp) / ip if ip else float("nan")) if probe else None
            r["ns_per_elem"] = 1e9 * (w - rp) / max(1, r["changed"])
            out.append("| " + " | ".join(c[1](r, size, n) for c in cols) + " |")
        rows = [r for r in res["rows"] if not r.get("cold")]
        rl = res["reloads"]
        # a + b * changed, fitted through the per-lr medians (one spike cannot tilt it)
        lr_set = sorted({r["lr"] for r in rows})
        by_lr = [[r for r in rows if r["lr"] == lr] for lr in lr_set]
        xs = [_med([r["changed"] for r in g]) for g in by_lr]
        fixed, per_elem = _fit(xs, [_med([r["write_rank_s"] - (r["repack_s"] or 0.0) for r in g])
                                    for g in by_lr])
        ip_fixed, ip_per_elem = _fit(xs, [_med([r["index_put_s"] for r in g]) for g in by_lr])
        summary[size] = {
            "fit_fixed_s": fixed, "fit_ns_per_elem": per_elem,
            "index_put_fit_fixed_s": ip_fixed, "index_put_fit_ns_per_elem": ip_per_elem,
            "tensors": max((r.get("tensors") or 0 for r in rows), default=0),
            "params": n,
            "packed_layers": res.get("packed_layers"), "linear_layers": res.get("linear_layers"),
            "median_ratio": _med([r["ratio"] for r in rows]),
            "max_ratio": max((r["ratio"] for r in rows), default=None),
            "median_ratio_norepack": _med([r["ratio_norepack"] for r in rows]) if probe else None,
            "median_write_s": _med([r["write_rank_s"] for r in rows]),
            "median_repack_s": _med([r["repack_s"] for r in rows]),
            "repack_share": (sum(r["repack_s"] for r in rows)
                             / max(1e-12, sum(r["write_rank_s"] for r in rows))) if probe else None,
            "ns_per_elem_by_lr": {f"{lr:.0e}": _med([r["ns_per_elem"] for r in rows
                                                     if r["lr"] == lr])
                                  for lr in sorted({r["lr"] for r in rows})},
            "write_ms_by_lr": {f"{lr:.0e}": 1e3 * _med([r["write_rank_s"] for r in rows
                                                        if r["lr"] == lr])
                               for lr in sorted({r["lr"] for r in rows})},
            "reload_s": min((x["seconds"] for x in rl), default=None),
            "reload_load_files_s": min((x["load_files_s"] or 0 for x in rl), default=None),
            "reload_repack_s": min((x["repack_s"] for x in rl), default=None) if probe else None,
            "verify_s": res["verify_s"], "engine_start_s": res["engine_start_s"],
            "start_s": res["start_s"],
        }
    head, cols = _table(A_MODEL_COLS, probe)
    out += ["", "Per model (cold first apply excluded):", "", *head]
    out += ["| " + " | ".join(c[1](size, s) for c in cols) + " |" for size, s in summary.items()]
    return out, summary


def report_b(res: dict, title: str) -> tuple[list[str], dict]:
    rows = res["rows"]
    out = [f"### B. {title}", "",
           "| v | lr | changed % | patch KB | publish() returns ms | on board + announced ms | "
           "**serving ms** | serving after publish() returned ms | engine apply ms | "
           "gather ms (on the rank) | write = pause ms (rank write) | decode + verify ms | "
           "notify + fetch + poll ms | baseline: full snapshot publish -> on board ms | "
           "+ stitch pull ms | **baseline total ms** |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def line(r, tag=""):
        app = r["apply_total_s"] or float("nan")
        rest = r["serve_s"] - r["board_s"] - app if r["board_s"] == r["board_s"] else None
        lr = "-" if r["lr"] is None else f"{r['lr']:.0e}"
        return (f"| {r['version']}{tag} | {lr} | "
                f"{100 * (r['changed'] or 0) / r['total_elements']:.2f} | "
                f"{(r['patch_bytes'] or 0) / 1e3:.1f} | {_ms(r['publish_call_s'])} | "
                f"{_ms(r['board_s'])} | **{_ms(r['serve_s'])}** | "
                f"{_ms(r['serve_after_return_s'])} | {_ms(app)} | {_ms(r['gather_s'])} "
                f"({_ms(r.get('gather_rank_s'))}) | {_ms(r['pause_s'])} "
                f"({_ms(r['write_rank_s'])}) | "
                f"{_ms(app - (r['gather_s'] or 0) - (r['pause_s'] or 0))} | "
                f"{_ms(rest)} | {_ms(r['snapshot_publish_s'])} | "
                f"{_ms(r['pull_s'])} | **{_ms(r['baseline_s'])}** |")

    if res["warmup"]:
        out.append(line(res["warmup"], " (warm-up, not in the summary)"))
    out += [line(r) for r in rows]
    serve = [r["serve_s"] for r in rows]
    after = [r["serve_after_return_s"] for r in rows]
    baselines = [r["baseline_s"] for r in rows]
    s = {"median_serve_s": _med(serve), "max_serve_s": max(serve) if serve else None,
         "median_after_return_s": _med(after), "max_after_return_s": max(after) if after else None,
         "median_baseline_s": _med(baselines),
         "median_apply_s": _med([r["apply_total_s"] for r in rows]),
         "median_board_s": _med([r["board_s"] for r in rows]),
         "warmup_serve_s": res["warmup"]["serve_s"] if res["warmup"] else None,
         "server_start_s": res["server_start_s"]}
    out += ["", f"publish -> serving: median {_ms(s['median_serve_s'])} ms, max "
            f"{_ms(s['max_serve_s'])} ms (target <= 2000 ms); from publish() returning: median "
            f"{_ms(s['median_after_return_s'])} ms, max {_ms(s['max_after_return_s'])} ms. "
            f"Baseline (same weights as a full snapshot: publish -> on board + `stitch pull`, "
            f"before any engine reload): median {_ms(s['median_baseline_s'])} ms. First version "
            f"after start-up (cold: first imports + numba cache load in the server, first patch "
            f"encode in the trainer): {_ms(s['warmup_serve_s'])} ms. Final fingerprint check: "
            f"{(res.get('final_check') or {}).get('ok')} at v{res.get('final_version')}."]
    return out, s


@dataclass(frozen=True)
class EngineSpec:
    """What differs between the engines in the driver and the report."""

    name: str
    md: str  # default report, under benchmarks/results
    title: str  # of the report
    a_title: str
    b_title: str
    server: type[Server]
    notes: str

    version: Callable[[bool], str]  # (stub) -> engine and version for the machine line
    job_env: Callable[[bool], dict[str, str]]  # (stub) -> environment of the A child


def _vllm_version(stub: bool) -> str:
    import vllm

    return f"vLLM {vllm.__version__} (CPU backend)"


def _sglang_version(stub: bool) -> str:
    from importlib.metadata import version

    return (f"SGLang {version('sglang')} (CPU engine, torch_native attention"
            f"{', stand-in sgl_kernel' if stub else ''})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--engine", choices=sorted(ENGINES), default="vllm",
                    help="engine and plugin under test (run with that engine's venv python)")
    ap.add_argument("--quick", action="store_true",
                    help="small run (~2-3 min): the test model only, 2 lrs, short B")
    ap.add_argument("--sizes", default=None, help=f"comma list of {list(SIZES)}")
    ap.add_argument("--lrs", default=None, help="A: AdamW learning rates, one run each")
    ap.add_argument("--versions", type=int, default=None, help="A: versions per learning rate")
    ap.add_argument("--serve-lrs", default="1e-5,1e-4", help="B: learning rates, in turn")
    ap.add_argument("--serve-versions", type=int, default=None, help="B: versions per lr")
    ap.add_argument("--poll", type=float, default=0.01, help="B: status poll interval (s)")
    ap.add_argument("--omp-wait-policy", default="PASSIVE",
                    help="OMP_WAIT_POLICY for every process ('' leaves libgomp's spinning "
                         "default; see the notes)")
    ap.add_argument("--sgl-kernel-stub", action="store_true",
                    help="SGLang: put the stand-in sgl_kernel (tests/sglang/stub) first on "
                         "PYTHONPATH even when CUDA is available (always without CUDA)")
    ap.add_argument("--stage-memory", default=None,
                    help="A: comma list of STITCH_STAGE_MEMORY values (bytes, 4GiB, 0), one engine "
                         "run each on the same versions (default: the setting's default)")
    ap.add_argument("--skip-a", action="store_true")
    ap.add_argument("--skip-b", action="store_true")
    ap.add_argument("--json", help="write all measurements as JSON here")
    ap.add_argument("--md", default=None,
                    help="markdown report ('' for none; default benchmarks/results/"
                         "engine_apply.md, engine_apply_sglang.md for SGLang)")
    ap.add_argument("--md-append", action="store_true",
                    help="append this run to the markdown report as an additional run")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    ap.add_argument("--engine-job", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.engine_job:
        engine_job(a.engine_job)
        return
    spec = ENGINES[a.engine]
    if a.md is None:
        a.md = str(ROOT / "benchmarks/results" / spec.md)
    sizes = (a.sizes or ("tiny" if a.quick else "tiny,10x,50x")).split(",")
    lrs = [float(x) for x in (a.lrs or ("1e-5,1e-4" if a.quick else "1e-6,1e-5,1e-4")).split(",")]
    versions = a.versions or (2 if a.quick else 3)
    serve_versions = a.serve_versions or (2 if a.quick else 5)
    serve_lrs = [float(x) for x in a.serve_lrs.split(",")]

    if a.omp_wait_policy:  # before torch starts its OpenMP runtime; children inherit it
        os.environ["OMP_WAIT_POLICY"] = a.omp_wait_policy
    else:
        os.environ.pop("OMP_WAIT_POLICY", None)
    t_all = time.perf_counter()
    cmd = "$ " + shlex.join([Path(sys.executable).as_posix(), "benchmarks/engine_apply.py",
                             *sys.argv[1:]])
    load0 = os.getloadavg()
    import torch

    stub = spec.name == "sglang" and (a.sgl_kernel_stub or not torch.cuda.is_available())
    machine = (f"{platform.machine()} {os.cpu_count()} CPUs, no GPU, torch {torch.__version__}, "
               f"{spec.version(stub)}, OMP_WAIT_POLICY="
               f"{a.omp_wait_policy or '(unset)'}, load average at start {load0[0]:.2f}")
    print(cmd)
    print(machine, flush=True)
    work = Path(tempfile.mkdtemp(prefix="stitch-engine-bench-"))
    res: dict = {"command": cmd, "machine": machine, "engine": spec.name, "A": {}, "B": None}
    lines: list[str] = []
    summary: dict = {}
    try:
        if not a.skip_a:
            from stitch_core.settings import parse_bytes

            stages = [None] if a.stage_memory is None else a.stage_memory.split(",")
            for size in sizes:
                t = time.perf_counter()
                job = prepare_size(work, size, SIZES[size], lrs, versions)
                job["engine"] = spec.name
                print(f"A/{size}: trained + published {len(lrs)} x {versions} versions in "
                      f"{job['prep_s']:.1f} s; starting the engine", flush=True)
                for stage in stages:
                    label = size if stage is None else f"{size} stage={stage}"
                    job["stage_memory"] = None if stage is None else parse_bytes(stage)
                    r = run_engine_job(job, work / f"engine-{size}-{stage}.log", timeout=900,
                                       env=spec.job_env(stub))
                    r["prep_s"] = job["prep_s"]
                    res["A"][label] = r
                    print(f"A/{label}: done in {time.perf_counter() - t:.1f} s (engine start "
                          f"{r['engine_start_s']:.1f} s)", flush=True)
            la, summary["A"] = report_a(res["A"], spec.a_title)
            lines += la + [""]
        if not a.skip_b:
            t = time.perf_counter()
            res["B"] = serve_latency(work, serve_lrs, serve_versions, a.poll, spec.server, stub)
            print(f"B: done in {time.perf_counter() - t:.1f} s (server start "
                  f"{res['B']['server_start_s']:.1f} s)", flush=True)
            lb, summary["B"] = report_b(res["B"], spec.b_title)
            lines += lb + [""]
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"work directory kept: {work}")
    total = time.perf_counter() - t_all
    load1 = os.getloadavg()
    res["summary"], res["total_s"] = summary, total
    verdict = []
    for size, s in summary.get("A", {}).items():
        meets = "meets" if s["median_ratio"] <= 5 else "misses"
        if s["median_ratio_norepack"] is None:  # no re-pack to take out (SGLang)
            verdict.append(
                f"* A/{size}: rank write / bare index_put_ median {s['median_ratio']:.1f}x "
                f"({meets} <= 5x), max {s['max_ratio']:.1f}x; rank write = "
                f"{_ms(s['fit_fixed_s'])} ms + {1e9 * s['fit_ns_per_elem']:.0f} ns x changed.")
            continue
        verdict.append(
            f"* A/{size}: rank write / bare index_put_ median {s['median_ratio']:.1f}x "
            f"({meets} <= 5x); without the CPU "
            f"re-pack {s['median_ratio_norepack']:.1f}x "
            f"({'meets' if s['median_ratio_norepack'] <= 5 else 'misses'} <= 5x); re-pack is "
            f"{100 * s['repack_share']:.0f}% of the write.")
    if "B" in summary:
        s = summary["B"]
        verdict.append(f"* B: publish -> serving median {_ms(s['median_serve_s'])} ms, max "
                       f"{_ms(s['max_serve_s'])} ms "
                       f"({'meets' if (s['max_serve_s'] or 9) <= 2 else 'misses'} <= 2 s).")
    print()
    print("\n".join(lines + verdict))
    print(f"\ntotal {total:.0f} s, load average at end {load1[0]:.2f}")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1, default=str))
    if a.md:
        run_md = ["```", cmd, "```", "",
                  f"Machine: {machine}; load average at end {load1[0]:.2f}; total run "
                  f"{total:.0f} s. A shared 2-core box: absolute times are noise, compare each "
                  "number with its baseline in the same row.", ""]
        p = Path(a.md)
        p.parent.mkdir(parents=True, exist_ok=True)
        if a.md_append and p.exists():
            md = [p.read_text().rstrip("\n"), "", "## Additional run", "", *run_md, *verdict,
                  "", *[ln.replace("### ", "#### ", 1) for ln in lines]]
        else:
            md = [f"# {spec.title}", "",
                  "Generated by `benchmarks/engine_apply.py` (read its docstring for the method).",
                  "", *run_md, "## Verdict", "", *verdict, "", "## Results", "", *lines,
                  spec.notes]
        p.write_text("\n".join(md) + "\n")
        print(f"wrote {a.md}")


NOTES = """## How to read it

* **A, columns.** *rank write*: `RankReplica.write` on the rank (the engine pause, as reported in
  the apply stats `write_rank_s`): index_put_ of the new bits, read-back and compare, fingerprint
  delta, then the `on_dirty` hook. *re-pack*: that hook, timed in the engine process by wrapping
  it; on vLLM's CPU backend it re-runs the CPU GEMM dispatch (weight packing) for every linear
  layer the patch touched, so it scales with the size of the touched layers, not with the changed
  elements; GPUs do not pay it. *fp-delta*: the `fingerprint.sum_at` calls of the write (timed by
  wrapping the module attribute in that process). *rest*: the remainder (index_put_, the
  read-back compare, the gather-time check that nothing moved, per-tensor Python overhead).
  *bare index_put_*: `stitch_dev.rank_baseline` (a registered rank handler, best of 5): the same
  elements,
  engine positions and tensors, in the same process, right after the apply. *coordinator pause*:
  what the Coordinator held (its write RPC incl. pickling + the commit RPC). *apply total*: the
  whole `apply_patch` (position decode, gather, value decode + verification, write).
* **A, baselines of model size.** *full reload*: the engine loading a whole checkpoint through
  its own loader (`load_files`, incl. re-packing every layer) when the benchmark switches to the
  next learning rate's run (its v0); *total* adds the full fingerprint recomputation that
  `load_snapshot` does. *full fingerprint check*: `Coordinator.verify()` at the end (every
  version applied was also verified against its manifest on the way). *engine start*: the
  engine object's construction (weights loaded, KV cache allocated); *Stitch start-up*:
  `Coordinator.start` on the pulled v0 (every rank learns its layout map through the model's
  loaders and sums its weights; the sums are checked against the manifest's fingerprints).
* **B.** Times from just before `Publisher.publish()`; *on board + announced* is when the
  version's future resolved (trainer side: diff + encode + board write + NATS announce); the
  engine's breakdown is `/stitch/status` `last_apply` (Coordinator stats); *notify + fetch +
  poll* = serving - on board - engine apply (NATS delivery, the follower's fetch from the board
  directory, and the 10 ms poll granularity; slightly negative when the engine finished before
  the trainer's future resolved). The follower's reconcile timer is 5 s, so the announcement is
  what triggers each apply. Gather and write are as the Coordinator sees them (RPC into vLLM's
  engine-core process included); in parentheses the time on the rank.
* **B, baseline** (same run, same weights, outside the timers above): a fresh `Publisher` (no
  base, so snapshot only, no patch encode) publishes the same model state as a full snapshot to
  a second board, then `stitch pull` of that version into a fresh directory with a fresh cache
  (fetch, checksum, full fingerprints, write the checkpoint). That is the full-checkpoint path up
  to the point where the engine would reload; the engine's own reload of this model (A, "tiny")
  comes on top.
* The trainer (transformers, fp32 masters, AdamW, weight decay 0.01, batches of 4 x 32 random
  tokens) runs in this driver process; the engines run in child processes (vLLM 0.32's CPU
  backend cannot start in a process that imported numba).
* **OMP_WAIT_POLICY=PASSIVE** is set for every process by default. vLLM's CPU platform
  LD_PRELOADs torch's libgomp into its engine-core process, whose threads spin after every
  parallel region; on this shared, oversubscribed 2-core box, with the API server (patch decode)
  and the engine core (gather/write) taking turns, the spinning made the rank's gather and write
  5-30x slower than the same calls in A and publish -> serving erratic (see the additional run
  with `--omp-wait-policy ''` below, when present). This is an artifact of too few cores, not of
  Stitch; a GPU server with cores to spare does not see it."""


NOTES_SGLANG = """## How to read it

* **Process layout.** A: the `--engine-job` child creates an in-process `sglang.Engine` (CPU
  engine, torch_native attention, no CUDA graph, no overlap schedule, 8192 KV tokens); its
  TokenizerManager is in that child, the rank (SGLang's scheduler, with the plugin's
  `RankReplica`) is SGLang's subprocess. The Coordinator runs in the child and reaches the rank
  through `SglangFollower.rpc` (a `StitchCallReqInput` over SGLang's ZMQ scheduler channel,
  handled between engine steps); it holds engine steps with the follower's `pause`/`resume`
  (`pause_generation(mode="in_place")`, `continue_generation`). The follower itself is not
  started (no gate, no board polling). B: `python -m sglang.launch_server` with the installed
  plugin entry point and STITCH_* variables; the follower runs in SGLang's HTTP process.
* **A, columns.** *rank write*: `RankReplica.write` in the scheduler process (the engine pause,
  as reported in the apply stats `write_rank_s`): index_put_ of the new bits, read-back and
  compare, fingerprint delta, then the `on_dirty` hook (a no-op for SGLang: no re-pack).
  *gather* / *write RPC*: the Coordinator's gather and write calls as it sees them (pickling +
  the ZMQ round trip to the scheduler included; the write also checks the ranks' fingerprint
  deltas); in parentheses the gather on the rank. *bare index_put_*: `stitch_dev.rank_baseline`
  through the same RPC (dispatch `baseline`, best of 5): the same elements, engine positions and
  tensors, in the scheduler process, right after the apply. *coordinator pause*: what the
  Coordinator held: `pause_generation` + the write RPC + `continue_generation`. *apply total*:
  the whole `apply_patch` (position decode, gather, value decode + verification, write). The
  replica lives in another process, so the vLLM run's in-process columns (re-pack, fp-delta,
  bare gather, tensors written, packed layers) are not measured here; the fit is of the whole
  rank write.
* **A, baselines of model size.** *full reload*: the `load_files` RPC (the model's own
  `load_weights` in the scheduler) when the benchmark switches to the next learning rate's run
  (its v0); *total* adds `pause_generation`/`continue_generation` and the full fingerprint
  recomputation that `load_snapshot` does. *full fingerprint check*: `Coordinator.verify()` at
  the end (every version applied was also verified against its manifest on the way). *engine
  start*: the engine object's construction (weights loaded, KV cache allocated); *Stitch
  start-up*:
  `Coordinator.start` on the pulled v0 (every rank learns its layout map through the model's
  loaders and sums its weights; the sums are checked against the manifest's fingerprints).
* **B.** Times from just before `Publisher.publish()`; *on board + announced* is when the
  version's future resolved (trainer side: diff + encode + board write + NATS announce); the
  engine's breakdown is `/stitch/status` `last_apply` (Coordinator stats); *notify + fetch +
  poll* = serving - on board - engine apply (NATS delivery, the follower's fetch from the board
  directory, and the 10 ms poll granularity; slightly negative when the engine finished before
  the trainer's future resolved). The follower's reconcile timer is 5 s, so the announcement is
  what triggers each apply. Gather and write are as the Coordinator sees them (RPC from the HTTP
  process into SGLang's scheduler process included); in parentheses the time on the rank. The
  pause also covers setting SGLang's `weight_version` (`after_apply`, while steps are held).
  Server start-up is counted until v0 is proven and SGLang's own warm-up request (held until
  then) passed, i.e. `/health` answers 200.
* **B, baseline** (same run, same weights, outside the timers above): a fresh `Publisher` (no
  base, so snapshot only, no patch encode) publishes the same model state as a full snapshot to
  a second board, then `stitch pull` of that version into a fresh directory with a fresh cache
  (fetch, checksum, full fingerprints, write the checkpoint). That is the full-checkpoint path up
  to the point where the engine would reload; the engine's own reload of this model (A, "tiny")
  comes on top.
* The trainer (transformers, fp32 masters, AdamW, weight decay 0.01, batches of 4 x 32 random
  tokens) runs in this driver process; the engines run in child processes, as for vLLM.
* **sgl_kernel.** No CPU build of `sglang-kernel` exists; without CUDA (or with
  `--sgl-kernel-stub`) the stand-in `tests/sglang/stub` is first on PYTHONPATH of every SGLang
  process (dense models on torch_native call none of its functions; any call would raise).
* **OMP_WAIT_POLICY=PASSIVE** is set for every process by default, as in the vLLM run."""


ENGINES = {
    "vllm": EngineSpec(
        "vllm", "engine_apply.md", "Engine apply: pause vs patch size, publish -> serving",
        "In-place apply in an in-process vLLM engine (TP=1, CPU)",
        "Publish -> serving on loopback (real nats-server, OpenAI server + plugin, test model)",
        Server, NOTES, _vllm_version, lambda stub: _engine_env()),
    "sglang": EngineSpec(
        "sglang", "engine_apply_sglang.md",
        "Engine apply (SGLang): pause vs patch size, publish -> serving",
        "In-place apply in an in-process SGLang engine (`sglang.Engine`, scheduler subprocess, "
        "TP=1, CPU)",
        "Publish -> serving on loopback (real nats-server, SGLang HTTP server + plugin, test "
        "model)", SglangServer, NOTES_SGLANG, _sglang_version, _sglang_env),
}


if __name__ == "__main__":
    main()
