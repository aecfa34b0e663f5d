"""The `vllm.general_plugins` entry point (`stitch = stitch_vllm.plugin:register`).

vLLM runs it in every process it starts (API server, engine core, TP workers), possibly several
times, before any model is loaded, so it stays cheap. On every platform it wraps the FP8 linear
method's post-load step (``stitch_vllm.fp8``: the loaders stay usable, the kernel's state is
followed); on the CPU backend it also installs what in-place applies need there (the weight
keeper, AMX set-up) and, for tests only, the dev FP8 stand-in kernel when
``STITCH_DEV_FP8_KERNEL`` is set (``stitch_dev.fp8_kernel``, not in the wheel). The follower
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
    """Stitch's log lines into vLLM's log; the FP8 keeper (``stitch_vllm.fp8``); on vLLM's CPU
    backend, the weight keeper, AMX set-up and (tests) the dev FP8 stand-in kernel."""
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
    from .fp8 import install_fp8_keeper

    install_fp8_keeper()  # every platform: FP8 post-load steps drop the loaders everywhere
    if current_platform.is_cpu():
        from .cpu import init_amx, install_cpu_weight_keeper

        init_amx()
        install_cpu_weight_keeper()
        install_dev_fp8_kernel()


def install_dev_fp8_kernel() -> str | None:
    """Tests only: the dev stand-in FP8 kernels (``stitch_dev.fp8_kernel``: block, per-tensor and
    per-channel scales, and the static quantization op vLLM's CPU build lacks), which add
    themselves to vLLM's CPU kernel lists when its variable STITCH_DEV_FP8_KERNEL is set
    (``standin``, ``auto`` or ``standin-packed``); see ``stitch_core.engine.dev_hooks``.
    The mode installed, or None."""
    from stitch_core.engine.dev_hooks import install_dev

    return install_dev("dev_fp8_kernel", "fp8_kernel", "vLLM chooses its own FP8 kernels", log)
