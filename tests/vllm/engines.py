"""The vLLM server of the engine harness (stitch_dev.engines), as this directory's modules name
it: the engine scenarios shared with SGLang are in tests/engines."""

from __future__ import annotations

from stitch_dev.engines import MAX_TOKENS, PROMPTS, TOP
from stitch_dev.engines import VllmServer as Server
from stitch_dev.engines import vllm_fresh_outputs as fresh_outputs

__all__ = ["MAX_TOKENS", "PROMPTS", "TOP", "Server", "fresh_outputs"]
