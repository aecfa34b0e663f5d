"""The engine suites' servers and engine adapters: one set of scenarios (tests/engines) runs on
either engine, each difference between vLLM and SGLang stated here as data or one small method.

* ``VllmServer`` / ``SglangServer``: the engine's OpenAI server as a subprocess
  (stitch_dev.server.ServerProcess) on the CPU with the Stitch plugin, with the request helpers
  the scenarios use (``complete``, ``outputs``, ``hold_steps``; SGLang's native ``generate``);
* ``fresh_outputs``: greedy tokens and top logprobs of fresh engines loaded from directories;
* ``VLLM`` / ``SGLANG`` (``ADAPTERS``, ``adapter``): what a scenario needs to know of an engine.

Needs httpx (every engine venv has it); imports neither engine (each runs in its own venv).

Size: over 400 lines because both engines' servers and adapters live here on purpose: each
difference between the engines is read in one place, beside the other engine's answer.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import httpx

from .ports import free_port
from .procs import dev_plugin_path, sglang_cmd, sglang_env, vllm_cmd, vllm_env
from .server import ServerProcess

T = TypeVar("T")

PROMPTS = ["Hello world", "The quick brown fox", "def add(a, b):"]
MAX_TOKENS = 12
TOP = 3


# ---------------------------------------------------------------- servers

class EngineServer(ServerProcess):
    """What both engines' servers share: the API key on every helper request, a held step loop,
    a greedy completion."""

    def __init__(self, cmd: list[str], env: dict[str, str], port: int, model_dir: Path,
                 log: Path, api_key: str | None):
        super().__init__(cmd, env, port, str(model_dir), log)
        if api_key:  # every helper request carries it
            self.http.headers["Authorization"] = f"Bearer {api_key}"

    # (pause route, its body or query, resume route, its body)
    HOLD: tuple[str, dict, str, dict]

    def complete(self, prompt: str, headers: dict | None = None, **kw) -> httpx.Response:
        body = {"model": self.model, "prompt": prompt, "max_tokens": MAX_TOKENS,
                "temperature": 0.0, **self.COMPLETE_EXTRA, **kw}
        return self.http.post("/v1/completions", json=body, headers=headers or {})

    COMPLETE_EXTRA: dict = {}

    # /metrics names: a count of requests that produced a first output, a count of finished ones
    FIRST_OUTPUTS: str
    FINISHED: str

    def metric(self, name: str) -> float:
        """Sum of the samples of metric `name` in /metrics (0 if absent)."""
        total = 0.0
        for ln in self.http.get("/metrics").text.splitlines():
            if ln.startswith(name) and ln[len(name):len(name) + 1] in (" ", "{"):
                total += float(ln.split()[-1])
        return total

    def across_an_apply(self, send: Callable[[], httpx.Response], publish: Callable[[], int],
                        attempts: int = 3, timeout: float = 120) -> tuple[httpx.Response, int]:
        """`send()` (one request, on a thread) with the next version (`publish()`) applied while
        the engine generates it (`all_across_an_apply` with one request). Returns the answer
        and the version applied."""
        out, v = self.all_across_an_apply({"r": send}, publish, attempts, timeout)
        return out["r"], v

    def all_across_an_apply(self, sends: Mapping[str, Callable[[], T]],
                            publish: Callable[[], int], attempts: int = 5,
                            timeout: float = 120) -> tuple[dict[str, T], int]:
        """Each of `sends` (one request each, on threads) with the next version (`publish()`)
        applied while the engine generates them all: once the engine counts every request's
        first output, its steps are held, and under the hold the requests are seen unfinished
        before the version is published. When one finished before the hold (the race of one
        /metrics read and one pause call against hundreds of steps on a busy host), or before
        every other one started, all are sent again, at most `attempts` times. Returns the
        answers by key and the version applied."""
        for _ in range(attempts):
            first, done = self.metric(self.FIRST_OUTPUTS), self.metric(self.FINISHED)
            out: dict = {}
            threads = [threading.Thread(target=lambda k=k, f=f, o=out: o.update({k: f()}),
                                        daemon=True) for k, f in sends.items()]
            for t in threads:
                t.start()
            deadline = time.monotonic() + timeout
            v = None
            # all generating (one may finish before another's first output on a busy host)
            while all(t.is_alive() for t in threads) and \
                    self.metric(self.FIRST_OUTPUTS) < first + len(sends):
                assert time.monotonic() < deadline, "the requests never started"
                time.sleep(0.01)
            if all(t.is_alive() for t in threads):
                with self.hold_steps():
                    if self.unfinished_under_hold(done):  # none finished before the hold
                        v = publish()
                        self.wait_version(v, timeout=timeout)
            for t in threads:
                t.join(300)
            assert len(out) == len(sends), f"no answer for {set(sends) - set(out)}"
            if v is not None:
                return out, v
        raise AssertionError(f"a request finished before the hold {attempts} times")

    # under a hold no request can finish, but one the engine finished just before it reaches the
    # server's finished count a few hops later (SGLang: scheduler -> detokenizer -> tokenizer
    # manager): the count is read once that has drained
    SETTLE_S = 0.5

    def unfinished_under_hold(self, done: float) -> bool:
        """Inside `hold_steps`: no request finished since the count `done` was read (FINISHED,
        read again after SETTLE_S, when what the engine finished before the hold has been
        counted)."""
        time.sleep(self.SETTLE_S)
        return self.metric(self.FINISHED) == done

    @contextmanager
    def hold_steps(self) -> Iterator[None]:
        """Hold the engine's steps (its own pause route): running requests stay, with their KV,
        until the block ends, or until an apply's own pause and resume (the plugin's) let them go
        on."""
        pause, pause_kw, resume, resume_body = self.HOLD
        r = self.http.post(pause, **pause_kw)
        assert r.status_code == 200, r.text
        try:
            yield
        finally:
            r = self.http.post(resume, json=resume_body)
            assert r.status_code == 200, r.text


class VllmServer(EngineServer):
    """`python -m vllm.entrypoints.openai.api_server` with the Stitch worker extension and
    middleware (the plugin entry point is installed with the package)."""

    name = "vLLM server"
    # vLLM's RL routes (served with VLLM_SERVER_DEV_MODE=1, `dev_mode`)
    HOLD = ("/pause", {"params": {"mode": "keep"}}, "/resume", {})
    FIRST_OUTPUTS = "vllm:time_to_first_token_seconds_count"
    FINISHED = "vllm:e2e_request_latency_seconds_count"
    COMPLETE_EXTRA = {"logprobs": TOP, "return_tokens_as_token_ids": True}

    def __init__(self, model_dir: Path, log: Path, *, tp: int = 1, max_model_len: int = 256,
                 extra: list[str] | tuple[str, ...] = (), api_key: str | None = None,
                 dev_mode: bool = False, python: str = sys.executable, plain: bool = False,
                 **stitch: str):
        """`dev_mode`: VLLM_SERVER_DEV_MODE=1, vLLM's RL and dev routes (`hold_steps`);
        `plain`: no part of Stitch (`stitch_dev.procs.vllm_cmd` / `vllm_env`)."""
        port = free_port()
        cmd = vllm_cmd(python, str(model_dir), port, tp, max_model_len, plain) + list(extra)
        if api_key:
            cmd += ["--api-key", api_key]
        env = vllm_env(os.environ, tp, plain, **stitch)
        if dev_mode:
            env["VLLM_SERVER_DEV_MODE"] = "1"
        super().__init__(cmd, env, port, model_dir, log, api_key)

    def outputs(self, version: int) -> list[dict]:
        """Greedy tokens and top logprobs for PROMPTS, pinned to exactly `version`."""
        res = []
        for p in PROMPTS:
            r = self.complete(p, {"X-Stitch-Version": str(version)})
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["stitch"]["version_start"] == body["stitch"]["version_end"] == version
            lp = body["choices"][0]["logprobs"]
            res.append({"tokens": [int(t.split(":")[1]) for t in lp["tokens"]],
                        "top": [{int(k.split(":")[1]): v for k, v in d.items()}
                                for d in lp["top_logprobs"]]})
        return res


def sglang_engine_env(tp: int = 1, plain: bool = False, **stitch: str) -> dict[str, str]:
    """SGLang's CPU environment (stitch_dev.procs.sglang_env) with only the given STITCH_*
    variables; `plain`: STITCH_SGLANG=0 (the plugin stays out)."""
    env = sglang_env(tp)
    for k in [k for k in env if k.startswith("STITCH_")]:
        del env[k]
    if plain:
        env["STITCH_SGLANG"] = "0"
    for k, v in stitch.items():
        env[f"STITCH_{k.upper()}"] = str(v)
    if any(k.startswith("dev_") for k in stitch):  # the stand-ins live in stitch_dev (no wheel)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (dev_plugin_path(), env.get("PYTHONPATH")) if p)
    return env


class SglangServer(EngineServer):
    """An SGLang HTTP server (`python -m sglang.launch_server`); a Stitch follower unless
    `plain`. Comparisons use SGLang's native /generate, each request with a unique `cache_salt`
    so that no answer reuses another request's radix-cache prefix."""

    name = "SGLang server"
    signal_group = False  # SGLang's launcher stops its schedulers itself (stitch_dev.procs.stop)
    HOLD = ("/pause_generation", {"json": {"mode": "in_place"}}, "/continue_generation",
            {"torch_empty_cache": False})
    # with --enable-metrics; a non-streamed request's first output comes with its 50th token
    FIRST_OUTPUTS = "sglang:time_to_first_token_seconds_count"
    FINISHED = "sglang:e2e_request_latency_seconds_count"

    def __init__(self, model_dir: Path, log: Path, *, tp: int = 1, plain: bool = False,
                 python: str = sys.executable, extra: list[str] | tuple[str, ...] = (),
                 api_key: str | None = None, sleep_on_idle: bool = True, **stitch: str):
        port = free_port()
        self.tp = tp
        keys = ["--api-key", api_key] if api_key else []
        cmd = sglang_cmd(python, str(model_dir), port, tp, ["--random-seed", "0", *extra, *keys],
                         sleep_on_idle=sleep_on_idle)
        super().__init__(cmd, sglang_engine_env(tp, plain, **stitch), port, model_dir, log,
                         api_key)

    def load_weights(self, model_dir: Path) -> None:
        """A plain engine only: every weight of `model_dir` (same config) loaded in place by
        SGLang's own `/update_weights_from_disk` (its model loader and post-load step, as at a
        start; the radix cache flushed). The reference the follower's outputs are compared
        with, at a fraction of a fresh start's cost."""
        r = self.http.post("/update_weights_from_disk", json={"model_path": str(model_dir)},
                           timeout=600)
        if "cache was not flushed" in r.text:  # (a 400 with success: false)
            # the weights are in, but a request was queued (SGLang's /health sends one): the
            # flush is retried until nothing runs, as the message asks
            deadline = time.monotonic() + 120
            while self.http.post("/flush_cache", timeout=60).status_code != 200:
                assert time.monotonic() < deadline, "SGLang never flushed its cache"
                time.sleep(0.2)
            return
        assert r.status_code == 200 and r.json().get("success") is True, r.text

    def generate(self, prompt: str | list[str], headers: dict | None = None,
                 max_new_tokens: int = MAX_TOKENS, **kw) -> httpx.Response:
        body = {"text": prompt, "sampling_params": {"temperature": 0.0,
                                                    "max_new_tokens": max_new_tokens}, **kw}
        return self.http.post("/generate", json=body, headers=headers or {})

    def outputs(self, version: int | None = None) -> list[dict]:
        """Greedy token ids and top logprobs for PROMPTS (pinned to exactly `version` if given;
        a fresh cache_salt each, so nothing comes from the radix cache)."""
        res = []
        for p in PROMPTS:
            headers = {"X-Stitch-Version": str(version)} if version is not None else {}
            r = self.generate(p, headers, return_logprob=True, top_logprobs_num=TOP,
                              cache_salt=f"cmp-{uuid.uuid4().hex}")
            assert r.status_code == 200, r.text
            body = r.json()
            meta = body["meta_info"]
            if version is not None:
                assert body["stitch"]["version_start"] == body["stitch"]["version_end"] == version
                assert meta["weight_version"] == str(version), meta
            res.append({"tokens": [t[1] for t in meta["output_token_logprobs"]],
                        "logprobs": [t[0] for t in meta["output_token_logprobs"]],
                        "top": [{t[1]: t[0] for t in step} for step in
                                meta["output_top_logprobs"]]})
        return res


# ---------------------------------------------------------------- fresh engines

_VLLM_FRESH = textwrap.dedent("""
    import json, sys
    from vllm import LLM, SamplingParams
    dirs, tp, out = json.loads(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    prompts, n, top = json.loads(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
    res = {}
    kw = dict(tensor_parallel_size=tp, distributed_executor_backend="mp") if tp > 1 else {}
    # vLLM 0.32's in-place reload of a Qwen3-MoE on the CPU does not give a fresh engine's
    # outputs: mixture-of-experts models get a fresh engine per version
    cfg = json.load(open(dirs[0] + "/config.json"))
    reload = not any(k in cfg for k in ("num_experts", "num_local_experts", "n_routed_experts"))
    sp = SamplingParams(temperature=0.0, max_tokens=n, logprobs=top)
    llm = None
    for d in dirs:
        if llm is not None and reload:  # vLLM's own reload: its loaders and post-load steps
            llm.collective_rpc("reload_weights", kwargs={"weights_path": d})
            llm.reset_prefix_cache()
        else:
            if llm is not None:
                llm.llm_engine.engine_core.shutdown()
            llm = LLM(model=d, dtype="bfloat16", max_model_len=256, enforce_eager=True, seed=0,
                      max_num_seqs=4, generation_config="vllm", **kw)
        rows = []
        for p in prompts:  # one at a time, like the server requests
            c = llm.generate([p], sp, use_tqdm=False)[0].outputs[0]
            rows.append({"tokens": list(c.token_ids),
                         "top": [{int(t): lp.logprob for t, lp in step.items()}
                                 for step in c.logprobs]})
        res[d] = rows
    llm.llm_engine.engine_core.shutdown()
    json.dump(res, open(out, "w"))
""")


def vllm_fresh_outputs(dirs: list[Path], tmp: Path, tp: int = 1) -> dict[str, list[dict]]:
    """Outputs of a vLLM engine following no run (one subprocess) at each directory's weights:
    one start on the first, each later one loaded by vLLM's own in-place reload
    (`reload_weights`: the model's loaders, then every layer's post-load step again), so a
    comparison costs one engine start whatever the number of versions. Checked on a dense model
    (fp32, oneDNN-packed): the outputs after a reload equal a fresh engine's. Not so on a bf16
    Qwen3-MoE (checked the same way), so mixture-of-experts models get one engine per version."""
    out = tmp / "fresh.json"
    subprocess.run([sys.executable, "-c", _VLLM_FRESH, json.dumps([str(d) for d in dirs]),
                    str(tp), str(out), json.dumps(PROMPTS), str(MAX_TOKENS), str(TOP)],
                   env=vllm_env(os.environ, tp), check=True, timeout=900, cwd=tmp)
    res = json.loads(out.read_text())
    return {d: [{"tokens": r["tokens"], "top": [{int(k): v for k, v in s.items()}
                                                for s in r["top"]]} for r in rows]
            for d, rows in res.items()}


def sglang_fresh_outputs(dirs: list[Path], tmp: Path, tp: int = 1,
                         extra: list[str] | tuple[str, ...] = (),
                         **stitch: str) -> dict[str, list[dict]]:
    """Outputs of a plain SGLang engine (no plugin; `extra`: more server flags; `stitch`: the
    STITCH_* settings it still reads, e.g. ``dev_fp8_kernel``) at each directory's weights: one
    start on the first, each later one loaded by SGLang's own loader
    (`SglangServer.load_weights`), so a comparison costs one engine start whatever the number of
    versions."""
    res = {}
    server = SglangServer(dirs[0], tmp / "fresh.log", tp=tp, plain=True, extra=extra, **stitch)
    try:
        server.wait_healthy()
        for i, d in enumerate(dirs):
            if i:
                server.load_weights(d)
            res[str(d)] = server.outputs()
    finally:
        server.stop()
    return res


# ---------------------------------------------------------------- adapters

class Engine:
    """What a scenario of tests/engines needs to know of an engine."""

    name: str  # "vllm" | "sglang": STITCH_ENGINE, STITCH_REQUIRE_<NAME>
    label: str  # as logs and messages spell it
    module: str  # the engine's import name
    prefix: str  # of run names ("vl-e2e")
    server_cls: type[EngineServer]
    # versions the follower's outputs are compared with fresh engines at (vLLM: one engine per
    # version in one process; SGLang: one plain server, later versions loaded by its own loader)
    compare: tuple[int, ...]
    # the end-to-end follower's extra server flags and keywords
    follower_extra: tuple[str, ...]
    follower_kw: dict
    # the realistic-shape cases of the TP scenario: (arch, tp, shared), shared: on the session's
    # TP=2 engine of the fault scenarios
    tp_cases: tuple[tuple[str, int, bool], ...]
    # the TP=2 fault engine's model (the session's one TP=2 follower)
    tp2_arch: str

    def __repr__(self) -> str:
        return self.label

    def start(self, model_dir: Path, log: Path, **kw) -> EngineServer:
        return self.server_cls(model_dir, log, **kw)

    def ready(self, server: ServerProcess, timeout: float = 400) -> dict:
        """Serving v0 (SGLang: and its own warm-up request passed)."""
        return server.wait_version(0, timeout=timeout)

    def fresh_outputs(self, dirs: list[Path], tmp: Path, tp: int = 1) -> dict[str, list[dict]]:
        raise NotImplementedError

    def sender(self, model: str) -> Callable[[httpx.Client, dict], httpx.Response]:
        """A small greedy request (the fault probe's)."""
        raise NotImplementedError

    def pinned(self, server: EngineServer, version: int, wait: float) -> httpx.Response:
        """A request pinned to exactly `version` that waits up to `wait` s for it."""
        return server.complete("Hello", {"X-Stitch-Version": str(version),
                                         "X-Stitch-Wait": str(wait)})

    def plain(self, server: EngineServer, version: int) -> httpx.Response:
        """An unpinned request served at `version` (the engine's own record checked too)."""
        r = server.complete("Hello")
        assert r.status_code == 200 and r.json()["stitch"]["version_end"] == version, r.text
        return r

    def long_stream(self, server: EngineServer, n: int) -> tuple[str, dict]:
        """(path, body) of an unpinned stream of exactly `n` tokens."""
        return "/v1/completions", {"model": server.model, "prompt": "Once upon a time",
                                   "max_tokens": n, "temperature": 0, "ignore_eos": True,
                                   "stream": True}

    def stream_spans(self, events: list[str]) -> list[dict] | None:
        """The engine's own record of the versions each token came from, if it keeps one."""
        return None

    def check_completion(self, body: dict, version: int) -> None:
        """A /v1/completions answer served at `version`: the engine's own version field, where it
        has one, says so too."""


class Vllm(Engine):
    name, label, module, prefix = "vllm", "vLLM", "vllm", "vl"
    server_cls = VllmServer
    compare = (3, 7, 10)
    follower_extra = ("--enable-scale-out",)
    follower_kw = {"max_model_len": 2048, "dev_mode": True}
    # the realistic shape at TP=1 is tests/vllm/test_layout.py's (a patch through the learned
    # layout against a fresh engine; packed copies of every linear layer); TP=2 follows on the
    # session's MoE engine after the faults (column/row/vocab-parallel slices, the experts,
    # sharded packed copies). A realistic-shape follower at TP=2 here took 80-170 s and
    # exercised no other path
    tp_cases = (("qwen3_moe", 2, True),)
    tp2_arch = "qwen3_moe"  # MoE: experts over the ranks

    def fresh_outputs(self, dirs, tmp, tp=1):
        return vllm_fresh_outputs(dirs, tmp, tp)

    def sender(self, model):
        def send(client: httpx.Client, headers: dict) -> httpx.Response:
            return client.post("/v1/completions", headers=headers, json={
                "model": model, "prompt": "Hello", "max_tokens": 2, "temperature": 0.0})
        return send


class Sglang(Engine):
    name, label, module, prefix = "sglang", "SGLang", "sglang", "sg"
    server_cls = SglangServer
    compare = (4, 10)
    follower_extra = ("--enable-metrics",)
    follower_kw: dict = {}
    # no realistic-shape follower (its TP=2 case took 90-180 s of the test command's budget; its
    # TP=1 case 169 s): TP=1 is the follower's and TP=2 the fault drills' engine's, small Qwen2s
    # followed against fresh engines; the realistic shape runs on vLLM (test_layout, TP=1)
    tp_cases: tuple[tuple[str, int, bool], ...] = ()
    tp2_arch = "qwen2"

    def ready(self, server, timeout=400):
        st = server.wait_version(0, timeout=timeout)
        # SGLang's own warm-up request (a /generate) was held until v0 was proven, then passed
        # the gate: /health turns 200 only after it succeeded (and a non-200 would kill it)
        server.wait_healthy(timeout)
        return st

    def fresh_outputs(self, dirs, tmp, tp=1):
        return sglang_fresh_outputs(dirs, tmp, tp)

    def sender(self, model):
        def send(client: httpx.Client, headers: dict) -> httpx.Response:  # native /generate
            return client.post("/generate", headers=headers, json={
                "text": "Hello", "sampling_params": {"temperature": 0.0, "max_new_tokens": 2}})
        return send

    def pinned(self, server, version, wait):
        r = server.generate("Hello", {"X-Stitch-Version": str(version),
                                      "X-Stitch-Wait": str(wait)})
        # SGLang's own field agrees
        assert r.status_code != 200 or r.json()["meta_info"]["weight_version"] == str(version)
        return r

    def plain(self, server, version):
        r = server.generate("Hello")
        assert r.status_code == 200 and r.json()["stitch"]["version_end"] == version, r.text
        assert r.json()["meta_info"]["weight_version"] == str(version)  # SGLang's field too
        return r

    def long_stream(self, server, n):
        return "/generate", {"text": "Once upon a time", "stream": True,
                             "sampling_params": {"temperature": 0, "max_new_tokens": n,
                                                 "ignore_eos": True}}

    def stream_spans(self, events):
        return json.loads(events[-3])["meta_info"]["weight_versions"]

    def check_completion(self, body, version):
        assert body["metadata"]["weight_version"] == str(version), body.get("metadata")


VLLM, SGLANG = Vllm(), Sglang()
ADAPTERS: dict[str, Engine] = {e.name: e for e in (VLLM, SGLANG)}


def adapter(name: str) -> Engine:
    try:
        return ADAPTERS[name]
    except KeyError:
        raise ValueError(f"unknown engine {name!r}: one of {sorted(ADAPTERS)}") from None
