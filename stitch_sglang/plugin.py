"""The `sglang.srt.plugins` entry point (`stitch = stitch_sglang.plugin:register`).

SGLang calls it once in every process it starts (the HTTP/main process, every TP scheduler, the
detokenizer), before any model exists, and then applies the hooks registered here. SGLang logs a
failing plugin and carries on without it, so this function logs what it did at WARNING itself.

* every process: the two request types of the Stitch RPC (`stitch_sglang.worker`) join SGLang's
  IPC decoder, and an AFTER hook on `Scheduler.init_request_dispatcher` routes them to a
  `RankReplica` on every TP rank;
* the child processes (the schedulers): the routed-experts hooks of `stitch_sglang.routed`
  (each routing row returned is the one of its position's first forward, across retracts);
* every process, first and whatever STITCH_SGLANG says, tests only: the dev host allocator when
  STITCH_DEV_HOST_ALLOC is set (`install_dev_host_alloc`) and the dev stand-in for SGLang's CPU
  AMX weight kernels when STITCH_DEV_FP8_KERNEL is set (`install_dev_fp8_kernel`);
* the schedulers: the post-load keeper of `stitch_sglang.cpu` (packed and FP8 layers keep their
  loader-format tensors; what the kernels read is rebuilt after a patch and proven), and an
  AROUND hook on `SchedulerWeightUpdaterManager.begin_weight_update` that refuses SGLang's own
  weight-update session on a follower (`stitch_sglang.worker.refuse_weight_session`);
* the main process only (`multiprocessing.parent_process() is None`; registering there imports
  the HTTP server module): a BEFORE hook on `http_server._setup_and_run_http_server` adds
  `stitch_sglang.server.StitchMiddleware` to SGLang's app, and an AROUND hook on
  `http_server._wait_and_warmup` holds SGLang's warm-up request (and so `/health`) until the
  engine holds a proven version (the warm-up kills the server on any non-200 answer).

`STITCH_SGLANG=0` switches the plugin off in every process; `SGLANG_PLUGINS` (a list of plugin
names) also filters it. The middleware is added only for a follower: `STITCH_BOARD` or
`STITCH_RUN` set, or a `stitch-manifest.json` in `--model-path` (`stitch pull` output).
"""

from __future__ import annotations

import logging
import multiprocessing

log = logging.getLogger("stitch.sglang")

SCHEDULER_HOOK = "sglang.srt.managers.scheduler.Scheduler.init_request_dispatcher"
HTTP_HOOK = "sglang.srt.entrypoints.http_server._setup_and_run_http_server"
WARMUP_HOOK = "sglang.srt.entrypoints.http_server._wait_and_warmup"
SESSION_HOOK = ("sglang.srt.managers.scheduler_components.weight_updater."
                "SchedulerWeightUpdaterManager.begin_weight_update")


def enabled(env: dict[str, str] | None = None) -> bool:
    """Whether the plugin is on: STITCH_SGLANG (`env`, default os.environ) is not 0/false/no/off
    (`stitch_core.settings`; a value that is no boolean raises SettingsError: SGLang logs it and
    runs without the plugin)."""
    from stitch_core.settings import Settings

    return bool(Settings.read("sglang", env))


def register() -> None:
    """Register the Stitch RPC types and hooks with SGLang (see the module doc); nothing when the
    plugin is off or SGLang lacks the plugin API (the dev host allocator is installed first,
    whatever STITCH_SGLANG says: plain engines need it too)."""
    install_dev_host_alloc()
    install_dev_fp8_kernel()
    if not enabled():
        if multiprocessing.parent_process() is None:  # once per server, not per rank
            log.warning("stitch: STITCH_SGLANG is off: the Stitch plugin is off")
        return
    try:
        from sglang.srt.managers import io_struct
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        from .routed import routed_hooks
        from .worker import (
            StitchCallReqInput,
            StitchCallReqOutput,
            install_handler,
            refuse_weight_session,
        )
    except Exception:
        log.exception("stitch: SGLang's plugin API is not available; the Stitch plugin is off")
        return
    io_struct.hook_custom_types(StitchCallReqInput, StitchCallReqOutput)
    HookRegistry.register(SCHEDULER_HOOK, install_handler, HookType.AFTER)
    if multiprocessing.parent_process() is not None:  # a scheduler (or the detokenizer)
        from .cpu import install_post_load_keeper

        install_post_load_keeper()  # before the model loads: packed / FP8 layers keep masters
        # a follower's weights change only through Stitch (worker.REFUSED)
        HookRegistry.register(SESSION_HOOK, refuse_weight_session, HookType.AROUND)
        for target, hook, kind in routed_hooks():  # routed experts: first-forward rows kept
            HookRegistry.register(target, hook, getattr(HookType, kind))
    else:  # SGLang spawns its schedulers as children
        HookRegistry.register(HTTP_HOOK, _before_http_server, HookType.BEFORE)
        HookRegistry.register(WARMUP_HOOK, _around_warmup, HookType.AROUND)


def install_dev_host_alloc(env: dict[str, str] | None = None) -> str | None:
    """Tests only: SGLang's CPU host buffers (the routed-experts capture's) allocated without
    `cudaHostRegister` (`stitch_dev.host_alloc`) when STITCH_DEV_HOST_ALLOC is set (`plain`);
    see `stitch_core.engine.dev_hooks`. The allocator installed, or None."""
    from stitch_core.engine.dev_hooks import install_dev

    return install_dev("dev_host_alloc", "host_alloc",
                       "SGLang keeps its host allocator (cudaHostRegister)", log, env)


def install_dev_fp8_kernel(env: dict[str, str] | None = None) -> str | None:
    """Tests only: the dev stand-in for SGLang's CPU AMX weight kernels
    (`stitch_dev.sgl_cpu_kernel`: VNNI packing, packed bf16 and FP8 block / per-tensor matmuls)
    when STITCH_DEV_FP8_KERNEL is set (`standin`, `standin-packed` or `auto`); see
    `stitch_core.engine.dev_hooks`. The stand-in's name, or None."""
    from stitch_core.engine.dev_hooks import install_dev

    return install_dev("dev_fp8_kernel", "sgl_cpu_kernel", "SGLang keeps its own kernels", log,
                       env)


# stitch_sglang.server (stitch_core's gate, hence prometheus_client) is imported only when the
# hooks run: importing prometheus_client before SGLang sets PROMETHEUS_MULTIPROC_DIR (at launch,
# after plugins load) would keep this process's metrics, SGLang's own included, out of /metrics.


def _before_http_server(*args, **kwargs):
    from .server import before_http_server

    return before_http_server(*args, **kwargs)


def _around_warmup(original, *args, **kwargs):
    from .server import around_warmup

    return around_warmup(original, *args, **kwargs)
