"""vLLM's CPU backend: keep the canonical weight of packed linear layers, re-pack what changed.

On CPUs where vLLM can pack linear weights (oneDNN ``create_onednn_mm`` or the AMX
``convert_weight_packed`` path; ``vllm/model_executor/layers/utils.py::
dispatch_cpu_unquantized_gemm``) the kernel reads a private packed copy and ``layer.weight`` is
replaced by an empty tensor, so in-place writes to the weight would never be seen.
``install_cpu_weight_keeper()`` (run in every process before the model loads: the
``vllm.general_plugins`` entry point does it) keeps the unpacked weight on the layer as
``_stitch_master_weight`` (what ``stitch_core.layout`` patches), and ``repack_dirty`` re-packs
the layers an apply changed. Costs one extra copy of every packed linear weight, on the CPU only:
on GPUs nothing is installed and the kernels read ``param.data`` directly.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["install_cpu_weight_keeper", "repack_dirty", "init_amx"]

_ORIG_DISPATCH = None


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
    """Wrap vLLM's CPU gemm dispatch so packed layers keep their unpacked weight.

    Must run in each worker process before the model is loaded (a
    ``vllm.general_plugins`` entry point runs there; with
    VLLM_ENABLE_V1_MULTIPROCESSING=0 and TP=1 calling it in-process suffices).
    Costs one extra copy of every packed linear weight.  Idempotent.
    """
    global _ORIG_DISPATCH
    try:
        import vllm.model_executor.layers.utils as lu
    except ImportError:
        return False
    if _ORIG_DISPATCH is not None:
        return True
    orig = lu.dispatch_cpu_unquantized_gemm
    _ORIG_DISPATCH = orig

    def dispatch(layer, remove_weight):
        master = layer.weight
        orig(layer, remove_weight)
        layer._stitch_remove_weight = remove_weight
        packed = getattr(getattr(layer, "cpu_linear", None), "__closure__", None) is not None
        layer._stitch_cpu_packed = packed
        if layer.weight is not master:  # weight emptied: keep the master for patching
            layer._stitch_master_weight = master

    dispatch.__wrapped__ = orig  # type: ignore[attr-defined]
    lu.dispatch_cpu_unquantized_gemm = dispatch
    return True


def repack_dirty(model: torch.nn.Module, dirty_params: Iterable[str]) -> list[str]:
    """Re-run the CPU gemm dispatch for layers whose weight changed and is packed."""
    if _ORIG_DISPATCH is None:
        return []
    mods = dict(model.named_modules())
    done = []
    for pname in sorted(set(dirty_params)):
        mod_name, _, attr = pname.rpartition(".")
        mod = mods.get(mod_name)
        if mod is None or not getattr(mod, "_stitch_cpu_packed", False):
            continue
        if attr != "weight":  # biases are read at call time (fp32 on the AMX path)
            continue
        master = getattr(mod, "_stitch_master_weight", None)
        if master is not None:
            # put the (patched) master back, re-pack from it; dispatch empties it again
            mod._parameters["weight"] = master
        _ORIG_DISPATCH(mod, mod._stitch_remove_weight)
        done.append(mod_name)
    return sorted(set(done))
