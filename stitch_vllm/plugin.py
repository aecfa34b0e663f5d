"""The `vllm.general_plugins` entry point (`stitch = stitch_vllm.plugin:register`).

vLLM runs it in every process it starts (API server, engine core, TP workers), possibly several
times, before any model is loaded, so it stays cheap. On the CPU backend it installs what in-place
applies need there (the weight keeper, AMX set-up); on GPUs it installs nothing. The follower
itself runs in the API server process and is started by `stitch_vllm.server.StitchMiddleware` at
application start-up, where the engine client exists (a plugin runs before it does).
"""

from __future__ import annotations

import logging

log = logging.getLogger("stitch.vllm")


def register() -> None:
    """On vLLM's CPU backend, install the weight keeper and AMX set-up; elsewhere nothing."""
    try:
        from vllm.platforms import current_platform
    except Exception as e:  # pragma: no cover - vLLM missing or broken
        log.warning("stitch: vLLM platform unavailable (%s); plugin inactive", e)
        return
    if current_platform.is_cpu():
        from .cpu import init_amx, install_cpu_weight_keeper

        init_amx()
        install_cpu_weight_keeper()
