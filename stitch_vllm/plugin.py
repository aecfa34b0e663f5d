"""The `vllm.general_plugins` entry point (`stitch = stitch_vllm.plugin:register`).

vLLM runs it in every process it starts (API server, engine core, TP workers), possibly several
times, before any model is loaded, so it stays cheap. On the CPU backend it installs what in-place
applies need there (the weight keeper, AMX set-up); on GPUs it installs nothing. The follower
itself runs in the API server process and is started by `stitch_vllm.server.StitchMiddleware` at
application start-up, where the engine client exists (a plugin runs before it does).
"""

from __future__ import annotations

import logging
import sys

log = logging.getLogger("stitch.vllm")


def log_to_engine_log() -> None:
    """Stitch's log lines in the engine's log: vLLM configures only its own ``vllm`` logger (no
    root handler, and its handler's level is VLLM_LOGGING_LEVEL), so without this Stitch's INFO
    lines never reach the server log and its warnings come out unformatted. Adds one handler on
    the ``stitch`` logger writing to vLLM's stream in vLLM's format, at STITCH_LOG_LEVEL
    (default INFO). Idempotent (vLLM calls plugins several times per process)."""
    stitch = logging.getLogger("stitch")
    if any(getattr(h, "_stitch_engine_log", False) for h in stitch.handlers):
        return
    source = next((h for h in logging.getLogger("vllm").handlers
                   if isinstance(h, logging.StreamHandler)), None)
    handler = logging.StreamHandler(source.stream if source is not None else sys.stderr)
    if source is not None and source.formatter is not None:
        handler.setFormatter(source.formatter)
    handler._stitch_engine_log = True  # type: ignore[attr-defined]
    from stitch_core.settings import Settings, SettingsError

    try:
        level = Settings.read("log_level")
    except SettingsError as e:  # an unknown level name: say so, keep INFO
        level = "INFO"
        log.warning("stitch: %s; using INFO", e)
    handler.setLevel(level)
    stitch.setLevel(level)
    stitch.addHandler(handler)


def register() -> None:
    """Stitch's log lines into vLLM's log; on vLLM's CPU backend, install the weight keeper and
    AMX set-up (on GPUs nothing more)."""
    try:
        import vllm.logger  # noqa: F401 - configures the "vllm" logger whose stream we share

        log_to_engine_log()
    except Exception as e:  # pragma: no cover - vLLM's logging changed: keep the defaults
        log.warning("stitch: could not join vLLM's log (%s)", e)
    try:
        from vllm.platforms import current_platform
    except Exception as e:  # pragma: no cover - vLLM missing or broken
        log.warning("stitch: vLLM platform unavailable (%s); plugin inactive", e)
        return
    if current_platform.is_cpu():
        from .cpu import init_amx, install_cpu_weight_keeper

        init_amx()
        install_cpu_weight_keeper()
