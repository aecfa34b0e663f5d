"""Helpers for tests against real SGLang servers (`python -m sglang.launch_server` subprocesses)
with the Stitch plugin (installed entry point) and the stand-in kernel (tests/sglang/stub).

Followers get STITCH_* variables; fresh reference engines run with STITCH_SGLANG=0 (plain SGLang).
Comparisons use SGLang's native /generate (greedy, token ids and top logprobs), each request with
a unique `cache_salt` so that no answer reuses another request's radix-cache prefix.
"""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from stitch_dev.ports import free_port
from stitch_dev.procs import sglang_cmd, sglang_env, vllm_cmd, vllm_env
from stitch_dev.server import ServerProcess

PROMPTS = ["Hello world", "The quick brown fox", "def add(a, b):"]
MAX_TOKENS = 12
TOP = 3


def engine_env(tp: int = 1, plain: bool = False, **stitch: str) -> dict[str, str]:
    env = sglang_env(tp)
    for k in [k for k in env if k.startswith("STITCH_")]:
        del env[k]
    if plain:
        env["STITCH_SGLANG"] = "0"
    for k, v in stitch.items():
        env[f"STITCH_{k.upper()}"] = str(v)
    return env


class Engine(ServerProcess):
    """An SGLang server subprocess (stitch_dev.server.ServerProcess; `wait_healthy` for its
    /health)."""

    signal_group = False  # SGLang's launcher stops its schedulers itself (stitch_dev.procs.stop)


class Server(Engine):
    """An SGLang HTTP server (`python -m sglang.launch_server`); a Stitch follower unless
    `plain`."""

    name = "SGLang server"

    def __init__(self, model_dir: Path, log: Path, *, tp: int = 1, plain: bool = False,
                 python: str = sys.executable, extra: list[str] | tuple[str, ...] = (),
                 api_key: str | None = None, **stitch: str):
        port = free_port()
        self.tp = tp
        keys = ["--api-key", api_key] if api_key else []
        cmd = sglang_cmd(python, str(model_dir), port, tp, ["--random-seed", "0", *extra, *keys])
        super().__init__(cmd, engine_env(tp, plain, **stitch), port, str(model_dir), log)
        if api_key:  # every helper request carries it
            self.http.headers["Authorization"] = f"Bearer {api_key}"

    def complete(self, prompt: str, headers: dict | None = None, **kw) -> httpx.Response:
        body = {"model": self.model, "prompt": prompt, "max_tokens": MAX_TOKENS,
                "temperature": 0.0, **kw}
        return self.http.post("/v1/completions", json=body, headers=headers or {})

    def generate(self, prompt: str | list[str], headers: dict | None = None,
                 max_new_tokens: int = MAX_TOKENS, **kw) -> httpx.Response:
        body = {"text": prompt, "sampling_params": {"temperature": 0.0,
                                                    "max_new_tokens": max_new_tokens}, **kw}
        return self.http.post("/generate", json=body, headers=headers or {})

    @contextmanager
    def hold_steps(self) -> Iterator[None]:
        """Hold the scheduler's steps (SGLang's `POST /pause_generation`, mode in_place):
        running requests stay with their KV until the block ends, or until an apply's own
        pause/continue (the plugin's) lets them go on."""
        r = self.http.post("/pause_generation", json={"mode": "in_place"})
        assert r.status_code == 200, r.text
        try:
            yield
        finally:
            r = self.http.post("/continue_generation", json={"torch_empty_cache": False})
            assert r.status_code == 200, r.text

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

def fresh_outputs(dirs: list[Path], tmp: Path, tp: int = 1) -> dict[str, list[dict]]:
    """Outputs of fresh plain SGLang engines loaded from each directory, started in turn."""
    res = {}
    for i, d in enumerate(dirs):
        server = Server(d, tmp / f"fresh-{i}.log", tp=tp, plain=True)
        try:
            server.wait_healthy()
            res[str(d)] = server.outputs()
        finally:
            server.stop()
    return res


def vllm_python() -> str:
    """The vLLM venv's python (STITCH_VLLM_PYTHON) for modules that start a vLLM server beside
    SGLang (the two pin different torch releases, so they cannot share a venv). Call at module
    level: unset skips the module, or fails it under STITCH_REQUIRE_VLLM=1."""
    import pytest

    python = os.environ.get("STITCH_VLLM_PYTHON")
    if python:
        return python
    if os.environ.get("STITCH_REQUIRE_VLLM") == "1":
        raise RuntimeError("STITCH_REQUIRE_VLLM=1 but STITCH_VLLM_PYTHON (the vLLM venv's python) "
                           "is not set")
    pytest.skip("set STITCH_VLLM_PYTHON to the vLLM venv's python", allow_module_level=True)


class VllmServer(ServerProcess):
    """The vLLM server of tests/vllm/engines.py, run by the vLLM venv's `python`; it advertises
    its own URL in heartbeats."""

    name = "vLLM server"

    def __init__(self, python: str, model_dir: Path, log: Path, **stitch: str):
        port = free_port()
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("STITCH_", "VIRTUAL_ENV", "PYTHONPATH"))}
        stitch.setdefault("engine_url", f"http://127.0.0.1:{port}")
        super().__init__(vllm_cmd(python, str(model_dir), port), vllm_env(env, **stitch), port,
                         str(model_dir), log)
