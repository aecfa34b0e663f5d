"""vLLM's CPU backend: keep the canonical weights of packed layers, re-pack what changed.

On the CPU, vLLM's kernels read private packed copies of some weights, so in-place writes to the
parameters would never be seen:

* linear layers, where vLLM can pack (oneDNN ``create_onednn_mm`` or the AMX
  ``convert_weight_packed`` path; ``vllm/model_executor/layers/utils.py::
  dispatch_cpu_unquantized_gemm``): ``layer.weight`` is replaced by an empty tensor;
* unquantized MoE experts (``CPUUnquantizedExperts.process_weights_after_loading``): ``w13_weight``
  and ``w2_weight`` are padded and pre-packed into the grouped-gemm layout.

``install_cpu_weight_keeper()`` (run in every process before the model loads: the
``vllm.general_plugins`` entry point does it) keeps the unpacked tensors on the module as
``_stitch_masters`` ({attribute: tensor}, what ``stitch_core.layout`` maps and patches) and a
``_stitch_repack`` function; ``repack_dirty`` re-packs the modules an apply changed. Costs one extra
copy of every packed weight, on the CPU only: on GPUs nothing is installed and the kernels read
``param.data`` directly.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch

__all__ = ["install_cpu_weight_keeper", "repack_dirty", "init_amx"]

_ORIG_DISPATCH = None
_ORIG_MOE = None
MOE_WEIGHTS = ("w13_weight", "w2_weight")


def init_amx() -> bool:
    """Initialise AMX tiles in this process (bf16 CPU attention can fault without it)."""
    fn = getattr(getattr(torch._C, "_cpu", None), "_init_amx", None)
    if fn is None:
        return False
    try:
        return bool(fn())
    except Exception:
        return False


def install_cpu_weight_keeper() -> bool:
    """Wrap vLLM's CPU weight packing so packed modules keep their unpacked tensors.

    Must run in each worker process before the model is loaded (a
    ``vllm.general_plugins`` entry point runs there; with
    VLLM_ENABLE_V1_MULTIPROCESSING=0 and TP=1 calling it in-process suffices).
    Idempotent. True if the linear-layer dispatch was wrapped.
    """
    global _ORIG_DISPATCH
    try:
        import vllm.model_executor.layers.utils as lu
    except ImportError:
        return False
    _install_moe_keeper()
    if _ORIG_DISPATCH is not None:
        return True
    orig = lu.dispatch_cpu_unquantized_gemm
    _ORIG_DISPATCH = orig

    def dispatch(layer, remove_weight):
        master = layer.weight
        orig(layer, remove_weight)
        layer._stitch_cpu_packed = (
            getattr(getattr(layer, "cpu_linear", None), "__closure__", None) is not None)
        if layer.weight is not master:  # weight emptied: keep the master for patching
            layer._stitch_masters = {"weight": master}
        if layer._stitch_cpu_packed or layer.weight is not master:
            layer._stitch_repack_on = ("weight",)  # biases are read at call time
            layer._stitch_repack = functools.partial(_repack_linear, layer, remove_weight)

    dispatch.__wrapped__ = orig  # type: ignore[attr-defined]
    lu.dispatch_cpu_unquantized_gemm = dispatch
    return True


def _repack_linear(layer: torch.nn.Module, remove_weight: bool) -> None:
    # put the (patched) master back, re-pack from it; the dispatch empties it again
    master = (getattr(layer, "_stitch_masters", None) or {}).get("weight")
    if master is not None:
        layer._parameters["weight"] = master
    _ORIG_DISPATCH(layer, remove_weight)


def _install_moe_keeper() -> bool:
    """Keep the unpadded, unpacked expert weights of vLLM's CPU MoE kernel."""
    global _ORIG_MOE
    if _ORIG_MOE is not None:
        return True
    try:
        from vllm.model_executor.layers.fused_moe.experts import cpu_moe
    except ImportError:
        return False
    cls = cpu_moe.CPUUnquantizedExperts
    orig = cls.process_weights_after_loading
    _ORIG_MOE = orig

    def process_weights_after_loading(self, layer):
        masters = {n: layer._parameters.get(n) for n in MOE_WEIGHTS}
        orig(self, layer)
        kept = {n: m for n, m in masters.items()
                if m is not None and layer._parameters.get(n) is not m}
        if kept:  # replaced by padded / packed copies (not with zentorch, which keeps them)
            layer._stitch_masters = kept
            layer._stitch_repack_on = MOE_WEIGHTS
            layer._stitch_repack = functools.partial(_repack_moe, self, layer)

    process_weights_after_loading.__wrapped__ = orig  # type: ignore[attr-defined]
    cls.process_weights_after_loading = process_weights_after_loading
    return True


def _repack_moe(experts, layer: torch.nn.Module) -> None:
    for n, master in layer._stitch_masters.items():
        layer._parameters[n] = master
    _ORIG_MOE(experts, layer)  # pads and packs into new tensors; the masters stay as they are


def repack_dirty(model: torch.nn.Module, dirty_params: Iterable[str]) -> list[str]:
    """Re-pack the modules whose kept master tensors changed; their names, sorted."""
    mods = dict(model.named_modules())
    done = set()
    for pname in sorted(set(dirty_params)):
        mod_name, _, attr = pname.rpartition(".")
        mod = mods.get(mod_name)
        repack = getattr(mod, "_stitch_repack", None)
        if repack is None or mod_name in done:
            continue
        if attr not in getattr(mod, "_stitch_repack_on", ()):
            continue  # e.g. a bias: read at call time (fp32 on the AMX path)
        repack()
        done.add(mod_name)
    return sorted(done)
