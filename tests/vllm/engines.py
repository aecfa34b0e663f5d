"""Helpers for tests against real vLLM OpenAI servers (subprocesses) running the Stitch plugin.

The engine runs in its own process, as a user runs it; the test process trains, publishes and pulls.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from stitch_dev.ports import free_port
from stitch_dev.procs import vllm_cmd, vllm_env
from stitch_dev.server import ServerProcess

PROMPTS = ["Hello world", "The quick brown fox", "def add(a, b):"]
MAX_TOKENS = 12
TOP = 3


def engine_env(tp: int = 1, **stitch: str) -> dict[str, str]:
    return vllm_env(os.environ, tp, **stitch)


class Server(ServerProcess):
    """`python -m vllm.entrypoints.openai.api_server` with the Stitch worker extension and
    middleware (the plugin entry point is installed with the package)."""

    name = "vLLM server"

    def __init__(self, model_dir: Path, log: Path, *, tp: int = 1, max_model_len: int = 256,
                 extra: list[str] | tuple[str, ...] = (), api_key: str | None = None,
                 dev_mode: bool = False, **stitch: str):
        """`dev_mode`: VLLM_SERVER_DEV_MODE=1, vLLM's RL and dev routes (`hold_steps`)."""
        port = free_port()
        cmd = vllm_cmd(sys.executable, str(model_dir), port, tp, max_model_len) + list(extra)
        if api_key:
            cmd += ["--api-key", api_key]
        env = engine_env(tp, **stitch)
        if dev_mode:
            env["VLLM_SERVER_DEV_MODE"] = "1"
        super().__init__(cmd, env, port, str(model_dir), log)
        if api_key:  # every helper request carries it
            self.http.headers["Authorization"] = f"Bearer {api_key}"

    def complete(self, prompt: str, headers: dict | None = None, **kw) -> httpx.Response:
        body = {"model": self.model, "prompt": prompt, "max_tokens": MAX_TOKENS,
                "temperature": 0.0, "logprobs": TOP, "return_tokens_as_token_ids": True, **kw}
        return self.http.post("/v1/completions", json=body, headers=headers or {})

    @contextmanager
    def hold_steps(self) -> Iterator[None]:
        """Hold the engine's steps (vLLM's RL route `POST /pause?mode=keep`, served with
        VLLM_SERVER_DEV_MODE=1): running requests freeze with their KV until the block ends, or
        until an apply's own pause/resume (the plugin's) lets them go on."""
        r = self.http.post("/pause", params={"mode": "keep"})
        assert r.status_code == 200, r.text
        try:
            yield
        finally:
            r = self.http.post("/resume")
            assert r.status_code == 200, r.text

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


FRESH = textwrap.dedent("""
    import json, sys
    from vllm import LLM, SamplingParams
    dirs, tp, out = json.loads(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    prompts, n, top = json.loads(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
    res = {}
    for d in dirs:
        kw = dict(tensor_parallel_size=tp, distributed_executor_backend="mp") if tp > 1 else {}
        llm = LLM(model=d, dtype="bfloat16", max_model_len=256, enforce_eager=True, seed=0,
                  max_num_seqs=4, generation_config="vllm", **kw)
        sp = SamplingParams(temperature=0.0, max_tokens=n, logprobs=top)
        rows = []
        for p in prompts:  # one at a time, like the server requests
            c = llm.generate([p], sp, use_tqdm=False)[0].outputs[0]
            rows.append({"tokens": list(c.token_ids),
                         "top": [{int(t): lp.logprob for t, lp in step.items()}
                                 for step in c.logprobs]})
        res[d] = rows
        llm.llm_engine.engine_core.shutdown()
        del llm
    json.dump(res, open(out, "w"))
""")


def fresh_outputs(dirs: list[Path], tmp: Path, tp: int = 1) -> dict[str, list[dict]]:
    """Outputs of fresh engines loaded from each directory (one subprocess, engines in turn)."""
    out = tmp / "fresh.json"
    subprocess.run([sys.executable, "-c", FRESH, json.dumps([str(d) for d in dirs]), str(tp),
                    str(out), json.dumps(PROMPTS), str(MAX_TOKENS), str(TOP)],
                   env=engine_env(tp), check=True, timeout=900, cwd=tmp)
    res = json.loads(out.read_text())
    return {d: [{"tokens": r["tokens"], "top": [{int(k): v for k, v in s.items()}
                                                for s in r["top"]]} for r in rows]
            for d, rows in res.items()}
