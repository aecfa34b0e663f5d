#!/usr/bin/env python3
"""Demo, engine part: a trainer and a stock vLLM or SGLang server following it, on this machine.

A real nats-server and a board directory; a small Qwen2 built here (random weights, a tokenizer
trained here: nothing is downloaded); the trainer (transformers + AdamW) publishes v0 and
`stitch pull` materialises it; the engine's own OpenAI server starts from that directory with the
Stitch plugin, from the engine's venv (each engine pins its own torch, so each has a venv of its
own, see `scripts/dev.py`):

* `--engine vllm` (default): `python -m vllm.entrypoints.openai.api_server` with the Stitch worker
  extension and middleware;
* `--engine sglang`: `python -m sglang.launch_server`, unchanged: the installed `stitch-rl`
  registers the plugin through SGLang's `sglang.srt.plugins` entry point. Without a GPU it runs
  SGLang's CPU engine with the stand-in `sgl_kernel` of tests/sglang/stub (the package index has
  no CPU build of SGLang's kernels; a dense model calls none of them).

Then every step the trainer publishes a patch and a completion asks for at least that version
(`X-Stitch-Min-Version`, `X-Stitch-Wait`): the response tells which version served it. Also a 409
for a version the engine cannot serve, `/stitch/status` and the `stitch_*` metrics.

Run through `python3 scripts/dev.py demo [--engine sglang]` (builds the venvs), or with .venv's
python: `python scripts/demo_engine.py [--engine sglang] [--engine-python <venv>/bin/python]`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

from stitch_core.versions.board import LocalBoard
from stitch_core.versions.materialize import pull
from stitch_core.versions.natsserver import NatsServer
from stitch_trainer import Publisher

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # stitch_dev (the tiny model builder, the server helpers): a
    sys.path.append(str(ROOT))  # checkout's dev harness, not installed; the installed stitch
                                # packages come first
from stitch_dev.ports import free_port  # noqa: E402
from stitch_dev.procs import SGL_KERNEL_STUB, sglang_cmd, vllm_cmd  # noqa: E402
from stitch_dev.server import ServerProcess  # noqa: E402

ENGINES = ("vllm", "sglang")
PROMPT = "The quick brown"
MAX_TOKENS = 12


def default_python(engine: str) -> Path:
    """The engine venv's python: $STITCH_VLLM_VENV / $STITCH_SGLANG_VENV, else .venv-<engine>."""
    venv = Path(os.environ.get(f"STITCH_{engine.upper()}_VENV", ROOT / f".venv-{engine}"))
    return venv / "bin" / "python"


class Engine(ServerProcess):
    """An engine's OpenAI server, started as a user would, in its own process group (from the
    log's folder: the engine imports Stitch from its venv's installed distribution, as a user's
    does)."""

    title = "engine"
    boot = ""  # what happens while it starts, for the waiting message
    signal_group = False  # SIGTERM the server (it stops its own workers), SIGKILL leftovers

    def __init__(self, python: Path, model_dir: Path, log: Path, board: Path, nats: str,
                 run: str):
        self.port = free_port()
        self.model = str(model_dir)
        stitch = {"STITCH_BOARD": str(board), "STITCH_NATS_URL": nats, "STITCH_RUN": run,
                  "STITCH_CACHE_DIR": str(log.parent / f"{log.stem}-cache")}
        self.shown_env = {**self.engine_env(), **stitch}  # what a user would set
        env = dict(os.environ, **self.shown_env)
        # the engine imports Stitch from its venv's installed distribution, as a user's does
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [*self.pythonpath(),
                                                          os.environ.get("PYTHONPATH")]))
        self.cmd = self.command(str(python))
        self.t0 = time.monotonic()
        super().__init__(self.cmd, env, self.port, self.model, log)
        self.name = self.title

    # ------------------------------------------------------------ per engine
    def engine_env(self) -> dict[str, str]:
        return {}

    def pythonpath(self) -> list[str]:
        return []

    def command(self, python: str) -> list[str]:
        raise NotImplementedError

    def ready(self) -> bool:
        """Extra readiness beyond /stitch/status saying "serving"."""
        return True

    # ------------------------------------------------------------ common
    def describe(self) -> str:
        """The command line, as a user would type it."""
        shown = dict(self.shown_env)
        if self.pythonpath():
            shown["PYTHONPATH"] = os.pathsep.join(self.pythonpath())
        words = [f"{k}={v}" for k, v in shown.items()] + [self.cmd[0], " ".join(self.cmd[1:3])]
        for a in self.cmd[3:]:  # keep each flag with its value
            words[-1:] = [f"{words[-1]} {a}"] if not a.startswith("-") else [words[-1], a]
        lines = [""]
        for w in words:
            if lines[-1] and len(lines[-1]) + len(w) > 90:
                lines.append("")
            lines[-1] += (" " if lines[-1] else "") + w
        return ("$ " + " \\\n    ".join(lines) + f"\nlog: {self.log}\n"
                f"waiting for GET /stitch/status to say \"serving\" ({self.boot})")

    def wait_serving(self, timeout: float = 900) -> dict:
        t0 = self.t0
        last, shown = "not listening yet", 0.0
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the {self.title} server exited with code "
                                   f"{self.proc.returncode}")
            try:
                st = self.http.get("/stitch/status", timeout=5).json()
                if st.get("state") == "serving" and self.ready():
                    return st
                last = f"state {st.get('state')!r}" + (f", {st['error']}" if "error" in st
                                                       else "")
            except (httpx.HTTPError, ValueError):
                pass
            if time.monotonic() - shown >= 10:
                shown = time.monotonic()
                print(f"  ... {shown - t0:3.0f} s since the start: {last}", flush=True)
            time.sleep(0.5)
        raise TimeoutError(f"the {self.title} server was not serving after {timeout:.0f} s "
                           f"({last})")

    def complete(self, headers: dict[str, str]) -> httpx.Response:
        body = {"model": self.model, "prompt": PROMPT, "max_tokens": MAX_TOKENS,
                "temperature": 0.0}
        return self.http.post("/v1/completions", json=body, headers=headers)


class VllmEngine(Engine):
    title = "vLLM"
    boot = ("30-60 s: vLLM starts, then\nthe plugin proves the loaded weights against v0's "
            "fingerprints")

    def engine_env(self) -> dict[str, str]:
        return {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}

    def command(self, python: str) -> list[str]:
        return vllm_cmd(python, self.model, self.port)


class SglangEngine(Engine):
    title = "SGLang"
    boot = ("1-3 min on a small CPU box:\nSGLang starts, the plugin proves the loaded weights "
            "against v0's fingerprints,\nthen SGLang runs its own warm-up request")

    @staticmethod
    def on_cpu() -> bool:
        return shutil.which("nvidia-smi") is None

    def engine_env(self) -> dict[str, str]:
        return {"SGLANG_USE_CPU_ENGINE": "1"} if self.on_cpu() else {}

    def pythonpath(self) -> list[str]:
        return [str(SGL_KERNEL_STUB)] if self.on_cpu() else []

    def command(self, python: str) -> list[str]:
        return sglang_cmd(python, self.model, self.port, 1, ["--random-seed", "0",
                                                            "--enable-metrics"],
                          cpu=self.on_cpu())

    def ready(self) -> bool:  # SGLang's own warm-up ran (it starts once a version is proven)
        return self.http.get("/health", timeout=5).status_code == 200


ENGINE_CLASSES: dict[str, type[Engine]] = {"vllm": VllmEngine, "sglang": SglangEngine}


class CorpusTrainer:
    """A HF causal LM trained with AdamW on a few sentences, publishing each step."""

    def __init__(self, model_dir: Path, board: Path, nats: str, lr: float, run: str):
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        from stitch_dev.tinymodel import CORPUS

        hf_logging.disable_progress_bar()
        torch.manual_seed(0)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.01)
        tok = AutoTokenizer.from_pretrained(model_dir)
        ids = [tok(t)["input_ids"] for t in CORPUS]
        n = max(map(len, ids))
        self.x = torch.tensor([s + [-100] * (n - len(s)) for s in ids])
        self.pub = Publisher(str(board), run, "bf16", nats=nats, config_dir=model_dir)
        self.step = 0

    def train_step(self) -> float:
        labels = self.x
        inputs = labels.clamp(min=0)
        loss = self.model(input_ids=inputs, attention_mask=(labels >= 0).long(),
                          labels=labels).loss
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        self.step += 1
        return loss.item()

    def publish(self):
        return self.pub.publish(self.step, self.model)


def show_error(r: httpx.Response) -> str:
    try:
        return json.dumps(r.json()["error"])
    except (ValueError, KeyError):
        return r.text[:300]


class EngineDemo:
    """The engine part as a context manager: entering starts nats-server, the trainer (v0 is
    published and pulled) and the engine's server, quietly, so that the server can boot while
    something else runs; `show()` then runs the part; leaving stops everything."""

    def __init__(self, work: Path, versions: int = 6, lr: float = 3e-3,
                 engine: str = "vllm", python: Path | None = None):
        if engine not in ENGINE_CLASSES:
            raise SystemExit(f"unknown engine {engine!r}: one of {', '.join(ENGINES)}")
        self.kind, self.python = ENGINE_CLASSES[engine], python or default_python(engine)
        if not self.python.exists():
            raise SystemExit(f"no {self.kind.title} venv at {self.python.parent.parent}: "
                             f"`python3 scripts/dev.py demo --engine {engine}` builds it (or set "
                             f"STITCH_{engine.upper()}_VENV; --no-engine skips the engine part)")
        self.run = f"demo-{engine}"
        self.work, self.versions, self.lr = work, versions, lr
        self.stack = contextlib.ExitStack()
        self.engine: Engine | None = None

    def __enter__(self) -> EngineDemo:
        from stitch_dev.tinymodel import build_tiny_model

        try:
            work = self.work
            work.mkdir(parents=True, exist_ok=True)
            self.board = work / "board"
            model_dir = build_tiny_model(work / "model", arch="qwen2", max_position_embeddings=256)
            self.nats = self.stack.enter_context(NatsServer(work / "nats", port=0))
            self.trainer = CorpusTrainer(model_dir, self.board, self.nats.url, self.lr, self.run)
            self.stack.callback(self.trainer.pub.close)
            self.v0 = self.trainer.publish().result(120)
            asyncio.run(pull(LocalBoard(self.board), self.run, 0, work / "v0", work / "cache",
                             quiet=True))
            self.engine = self.kind(self.python, work / "v0",
                                    work / f"{self.kind.title.lower()}-server.log", self.board,
                                    self.nats.url, self.run)
            self.stack.callback(self.engine.stop)
        except BaseException:
            self.stack.close()
            raise
        return self

    def __exit__(self, typ, exc, tb) -> None:
        if typ is KeyboardInterrupt:
            print(f"\ninterrupted: stopping the {self.kind.title} server and nats-server",
                  file=sys.stderr)
        elif (typ is not None and self.engine is not None
              and not (typ is SystemExit and isinstance(exc.code, int))):  # not SIGTERM
            print(f"\n--- last lines of {self.engine.log} ---\n{self.engine.tail(40)}\n---",
                  file=sys.stderr)
        self.stack.close()
        print(f"\nstopped the {self.kind.title} server and nats-server ({self.work})")

    def show(self) -> None:
        engine, trainer = self.engine, self.trainer
        assert engine is not None
        n = sum(p.numel() for p in trainer.model.parameters())
        print(f"nats-server {self.nats.url}, board {self.board}\n"
              f"model: Qwen2 {n / 1e6:.2f}M params (built here, random init), "
              f"AdamW lr={self.lr}, served view bf16\n"
              f"the trainer published v{self.v0.version} ({self.v0.kind}); "
              f"`stitch pull` -> {self.work / 'v0'}\n")
        print(engine.describe(), flush=True)
        st = engine.wait_serving()
        print(f"serving v{st['version']} {time.monotonic() - engine.t0:.0f} s after the "
              f"start (fingerprint check ok: {(st.get('fingerprint_check') or {}).get('ok')})\n")
        r = engine.complete({"X-Stitch-Version": "0"})
        r.raise_for_status()
        print(f"v0 says: {PROMPT!r} -> {r.json()['choices'][0]['text']!r}\n")
        run_versions(engine, trainer, self.versions)
        show_409_status_metrics(engine)


def engine_demo(work: Path, versions: int = 6, lr: float = 3e-3,
                engine: str = "vllm", python: Path | None = None) -> None:
    with EngineDemo(work, versions, lr, engine, python) as demo:
        demo.show()


def run_versions(engine: Engine, trainer: CorpusTrainer, versions: int) -> None:
    print("each step: train, publish, then POST /v1/completions with X-Stitch-Min-Version: <v>, "
          "X-Stitch-Wait: 30\n(a tiny model at a high lr, so most weights change each step; part 1 "
          "shows an RL-sized lr)\n"
          "upload: publish() until the version is on the board and announced; applied: publish() "
          "until the\nengine serves it (its apply took `apply`); answered: publish() until the "
          "completion came back")
    field = '"stitch"'
    print(f"{'ver':>3} {'loss':>5} {'patch KB':>8} {'changed %':>9} {'headers':>7} {field:>8} "
          f"{'upload ms':>9} {'apply ms':>8} {'applied ms':>10} {'answered ms':>11}  "
          f"completion of {PROMPT!r}")
    for _ in range(versions):
        loss = trainer.train_step()
        t0, wall0 = time.perf_counter(), time.time()
        m = trainer.publish().result(120)
        upload = time.perf_counter() - t0
        r = engine.complete({"X-Stitch-Min-Version": str(m.version), "X-Stitch-Wait": "30"})
        answered = time.perf_counter() - t0
        if r.status_code != 200:
            raise SystemExit(f"v{m.version}: HTTP {r.status_code} {show_error(r)}")
        body = r.json()
        s = body["stitch"]
        hdr = f"{r.headers['X-Stitch-Version-Start']}/{r.headers['X-Stitch-Version-End']}"
        st = engine.http.get("/stitch/status").json()
        apply_s = (st.get("last_apply") or {}).get("total_s") or 0.0
        applied = (st.get("last_apply_time") or wall0) - wall0
        changed = 100 * m.changed_elements / m.total_elements if m.changed_elements else 0.0
        text = body["choices"][0]["text"]
        body_v = f"{s['version_start']}/{s['version_end']}"
        print(f"{m.version:>3} {loss:>5.2f} {(m.patch_bytes or 0) / 1e3:>8.1f} {changed:>9.2f} "
              f"{hdr:>7} {body_v:>8} {1e3 * upload:>9.0f} {1e3 * apply_s:>8.0f} "
              f"{1e3 * applied:>10.0f} {1e3 * answered:>11.0f}  {text[:40]!r}", flush=True)
        if not (s["version_start"] == s["version_end"] == m.version):
            raise SystemExit(f"v{m.version} was not served: {s}")


def show_409_status_metrics(engine: Engine) -> None:
    v = engine.http.get("/stitch/status").json()["version"]
    print("\nPOST /v1/completions with X-Stitch-Version: 0 (engines never go back)")
    r = engine.complete({"X-Stitch-Version": "0"})
    print(f"  HTTP {r.status_code}, Retry-After {r.headers.get('Retry-After')}: {show_error(r)}")
    print(f"POST /v1/completions with X-Stitch-Min-Version: {v + 1} (not published yet), no wait")
    r = engine.complete({"X-Stitch-Min-Version": str(v + 1)})
    print(f"  HTTP {r.status_code}: {show_error(r)}")
    if r.status_code != 409:
        raise SystemExit("expected a 409")
    st = engine.http.get("/stitch/status").json()
    keys = ["run", "version", "latest", "lag", "state", "mode", "applies", "last_apply_seconds",
            "last_apply", "not_ready_total", "patch_bytes_total", "ranks", "fingerprint_check",
            "engine"]
    compact = {k: st[k] for k in keys if k in st}
    for k, v in list(compact.items()):
        if isinstance(v, float):
            compact[k] = round(v, 3)
    if isinstance(compact.get("last_apply"), dict):
        compact["last_apply"] = {k: round(v, 3) if isinstance(v, float) else v
                                 for k, v in compact["last_apply"].items()}
    if isinstance(compact.get("fingerprint_check"), dict):
        compact["fingerprint_check"] = {k: compact["fingerprint_check"].get(k)
                                        for k in ("ok", "tensors")}
    print(f"\nGET /stitch/status\n  {json.dumps(compact)}")
    print("GET /metrics | grep ^stitch_  (histogram buckets and _created left out)")
    for line in engine.http.get("/metrics").text.splitlines():
        name = line.split("{")[0].split(" ")[0]
        if name.startswith("stitch_") and not name.endswith(("_bucket", "_created")):
            print(f"  {line}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--versions", type=int, default=6, help="versions to publish after v0")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--out", type=Path, default=None, help="work directory (default: a temp dir)")
    ap.add_argument("--engine", choices=ENGINES, default="vllm")
    ap.add_argument("--engine-python", type=Path, default=None,
                    help="python of the engine's venv (default: $STITCH_VLLM_VENV or "
                         ".venv-vllm; $STITCH_SGLANG_VENV or .venv-sglang)")
    a = ap.parse_args()
    install_sigterm()
    engine_demo(a.out or Path(tempfile.mkdtemp(prefix=f"stitch-demo-{a.engine}-")),
                a.versions, a.lr, a.engine, a.engine_python)


def install_sigterm() -> None:
    """SIGTERM unwinds like Ctrl-C, so the servers are stopped."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # the servers are stopped by now
        sys.exit(130)
