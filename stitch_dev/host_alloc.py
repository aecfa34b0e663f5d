"""A dev-only host allocator for SGLang on a host without a GPU driver (tests only).

SGLang 0.5.23 allocates its pinned host buffers through ``ALLOC_MEMORY_FUNCS[device]``
(``sglang.srt.mem_cache.pool_host.common``), a ``defaultdict`` whose default, used for
``"cpu"``, is ``alloc_with_host_register``: ``torch.empty`` then ``cudaHostRegister``. The
routed-experts capture (``--enable-return-routed-experts``: ``BaseHostCache`` in
``sglang.srt.state_capturer.base``) allocates its host buffer that way even on SGLang's CPU
engine, and with no CUDA driver the registration fails, so the engine does not start.

``install("plain")`` sets ``ALLOC_MEMORY_FUNCS["cpu"]`` to ``plain_alloc``: ``torch.empty`` of
the same shape and dtype, not pinned and not registered (on a CPU engine nothing copies it to a
device). SGLang's ``BaseHostCache.destroy`` unregisters only on CUDA/ROCm builds, so nothing
else changes. The dict is mutated in place, so every module that imported it sees the entry.

Switched on by ``STITCH_DEV_HOST_ALLOC=plain`` in the engine's environment: the Stitch SGLang
plugin (``stitch_sglang.plugin.register``, run in every SGLang process) imports this module when
the variable is set, whatever ``STITCH_SGLANG`` says (plain engines need it too), and logs the
allocator. ``stitch_dev`` is not in the wheel: the variable needs this source tree on the
engine's path (``stitch_dev.procs.dev_plugin_path``); the plugin says so otherwise.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

__all__ = ["ENV", "MODES", "install", "plain_alloc"]

ENV = "STITCH_DEV_HOST_ALLOC"
MODES = ("plain",)
log = logging.getLogger("stitch.dev.host_alloc")


def plain_alloc(dims: tuple, dtype: torch.dtype, device: str, pin_memory: bool,
                allocator: Any = None, registration_granularity_bytes: int | None = None,
                ) -> torch.Tensor:
    """``ALLOC_MEMORY_FUNCS``'s signature: a plain, unpinned CPU tensor (``pin_memory`` and the
    allocator are ignored)."""
    del pin_memory, allocator, registration_granularity_bytes
    return torch.empty(dims, dtype=dtype, device=device)


def install(mode: str) -> str:
    """Put the `mode` allocator under ``ALLOC_MEMORY_FUNCS["cpu"]``; return its name."""
    if mode not in MODES:
        raise ValueError(f"{ENV}={mode!r}: one of {MODES}")
    from sglang.srt.mem_cache.pool_host import common

    common.ALLOC_MEMORY_FUNCS["cpu"] = plain_alloc
    name = f"{__name__}.plain_alloc"
    log.warning("stitch: dev host allocator %s for SGLang's CPU host buffers (%s=%s; tests "
                "only: not pinned, not cudaHostRegister'ed)", name, ENV, mode)
    return name
