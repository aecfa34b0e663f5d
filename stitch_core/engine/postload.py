"""Keep a layer's loader-format parameters across an engine's post-load step.

Engines end a layer's load with a post-load step (``process_weights_after_loading`` of the
layer's quantization method, in vLLM and SGLang alike) that may re-register its parameters:
packed for a CPU kernel (SGLang's AMX ``convert_weight_packed``), transposed, quantized online,
or only re-wrapped as a plain ``Parameter`` (which drops the loader attributes the layout map
learns through). `wrap_post_load` wraps such a method so that each call

* keeps the parameters the loaders wrote (the *masters*, by the name they were registered under);
* leaves the layer alone if the step kept every one of them (the same objects);
* makes them the layer's ``_stitch_masters`` if the step only re-wrapped them (the same storage,
  shape, strides and dtype): they *are* the kernel's tensors, so a patch written into them is what
  the kernel reads and no copy is made;
* otherwise also registers the kernel's state as a derived copy (`stitch_core.engine.derived`),
  rebuilt by running the same post-load step again from the masters whenever a patch writes one
  of them, and proven current by its stamp. Parameters the step created (an online quantizer's
  scales) are that copy's holders, not weights of their own.

`rebuild_dirty` is the rank's ``on_dirty`` hook: it rebuilds the copies an apply made stale.
Engine-agnostic: the engine adapters say which methods to wrap and name the kernel.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch

from . import derived

__all__ = ["wrap_post_load", "keep", "rebuild_dirty", "same_tensor"]

WRAPPED = "_stitch_post_load"


def same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `b` is `a`'s data re-wrapped: same dtype, shape, strides and storage."""
    return (a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape) and a.stride() == b.stride()
            and (not a.numel() or a.data_ptr() == b.data_ptr()))


def keep(layer: torch.nn.Module, kept: dict[str, torch.nn.Parameter], kind: str,
         rerun: Callable[[], object], before: Iterable[str] = ()) -> str:
    """Record what a post-load step did to `layer`'s loader-format parameters `kept` (taken
    before it ran; `before`: the names of all its parameters then); `rerun` runs the step again
    on the layer as it is. Returns ``kept`` (nothing changed), ``rewrapped`` (masters are the
    kernel's tensors) or ``derived``."""
    now = layer._parameters
    if all(now.get(n) is p for n, p in kept.items()):
        return "kept"
    layer._stitch_masters = dict(kept)
    if all(isinstance(t := now.get(n), torch.Tensor) and same_tensor(p.data, t.data)
           for n, p in kept.items()):
        return "rewrapped"
    had = set(before) | set(kept)
    holders = tuple(n for n in now if n not in had)  # created by the step
    derived.register(layer, kind, kept, functools.partial(_rebuild, layer, rerun),
                     holders=holders)
    return "derived"


def _rebuild(layer: torch.nn.Module, rerun: Callable[[], object]) -> None:
    for n, master in layer._stitch_masters.items():  # the (patched) masters back, then the step
        layer._parameters[n] = master
    rerun()


def wrap_post_load(cls: type, kind: Callable[[Any, torch.nn.Module], str],
                   names: Iterable[str] | None = None,
                   attr: str = "process_weights_after_loading") -> bool:
    """Wrap ``cls.<attr>(self, layer)`` as the module doc says (idempotent; a subclass that
    inherits a wrapped method is not wrapped again). `kind(method, layer)` names the derived copy
    (e.g. ``amx:UnquantizedLinearMethod``); `names`: only these parameters are masters (default:
    every parameter the layer holds before the step). False if already wrapped."""
    orig = cls.__dict__.get(attr) or getattr(cls, attr)
    if getattr(orig, WRAPPED, False):
        return False
    only = None if names is None else frozenset(names)

    def process_weights_after_loading(self, layer, *args, **kwargs):
        before = tuple(layer._parameters)
        kept = {n: p for n, p in layer._parameters.items()
                if isinstance(p, torch.nn.Parameter) and (only is None or n in only)}
        result = orig(self, layer, *args, **kwargs)
        if kept and not getattr(layer, "_stitch_rebuilding", False):
            keep(layer, kept, kind(self, layer),
                 functools.partial(_rerun, orig, self, layer, args, kwargs), before)
        return result

    setattr(process_weights_after_loading, WRAPPED, True)
    process_weights_after_loading.__wrapped__ = orig  # type: ignore[attr-defined]
    setattr(cls, attr, process_weights_after_loading)
    return True


def _rerun(orig, method, layer: torch.nn.Module, args, kwargs) -> None:
    layer._stitch_rebuilding = True  # a nested wrapped step must not re-register the layer
    try:
        orig(method, layer, *args, **kwargs)
    finally:
        layer._stitch_rebuilding = False


def rebuild_dirty(model: torch.nn.Module, dirty_params: Iterable[str]) -> list[str]:
    """Rebuild every derived copy built from a changed parameter (by storage: a tied lm_head
    re-packs with the embedding); the modules' names, sorted."""
    # imported here, not at the top: engine plugins import this module in every engine process
    # (its scheduler's too), where the layout's numba kernels are never used
    from .layout import engine_params

    params = engine_params(model)
    return derived.rebuild_from(model, [params[n] for n in set(dirty_params) if n in params])
