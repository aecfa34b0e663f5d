"""SGLang-only helpers of this directory (the cross-engine and gateway tests): a vLLM server run
by the vLLM venv's python beside SGLang, and SGLang's server of the engine harness
(stitch_dev.engines; the scenarios shared with vLLM are in tests/engines).
"""

from __future__ import annotations

import os
from pathlib import Path

from stitch_dev.engines import PROMPTS, SglangServer, sglang_engine_env, sglang_fresh_outputs
from stitch_dev.ports import free_port
from stitch_dev.procs import vllm_cmd, vllm_env
from stitch_dev.server import ServerProcess

Server = SglangServer
engine_env = sglang_engine_env
fresh_outputs = sglang_fresh_outputs
__all__ = ["PROMPTS", "Engine", "Server", "VllmServer", "engine_env", "fresh_outputs",
           "vllm_python"]


class Engine(ServerProcess):
    """An SGLang server subprocess (stitch_dev.server.ServerProcess; `wait_healthy` for its
    /health)."""

    signal_group = False  # SGLang's launcher stops its schedulers itself (stitch_dev.procs.stop)


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
