"""vLLM's FP8 linear layers (``quant_method: fp8``): keep what the loaders write, follow the
post-load step.

``Fp8LinearMethod.create_weights`` gives each FP8 linear layer loader-format parameters: fp8
``weight`` codes ``[N, K]`` and float32 ``weight_scale_inv`` ``[ceil(N/bn), ceil(K/bk)]`` (one per
128x128 block), both vLLM parameter classes whose methods (``load_merged_column_weight``,
``load_row_parallel_weight``, ...) place checkpoint shards: fused q/k/v and gate/up, TP slices, the
scales of each shard at its block offset. ``process_weights_after_loading`` then ends in the
chosen kernel's own post-load step, which re-registers both as plain ``Parameter`` objects
(``replace_parameter``), transformed or not. After it the model's loaders no longer work (a plain
Parameter has no ``load_row_parallel_weight``): neither the layout map nor a snapshot load could
run through them.

``install_fp8_keeper()`` (run in every vLLM process by the plugin, before the model loads) wraps
``Fp8LinearMethod.process_weights_after_loading``, when vLLM imports its FP8 module (an import
hook: that import takes seconds, and an engine without an FP8 model never makes it). Around the
original it keeps the layer's loader-format parameters and compares what the kernel left:

* **the same storage, shape, strides and dtype** for every kept parameter (the kernel only
  re-wrapped them: the Stitch dev stand-in, ``BlockWiseTorchFP8ScaledMMLinearKernel``, Triton,
  the CUTLASS block path without padding): the kept parameters become the layer's
  ``_stitch_masters``. They *are* the kernel's tensors (no copy); the layout map learns through
  their loaders, patches write them, the sums read them, so what is proven is what the kernel
  reads;
* **anything else** (packed, transposed, re-laid out, padded: vLLM's CPU AMX kernels, Marlin's
  repack, DeepGEMM's scale layout with ``VLLM_USE_DEEP_GEMM_E8M0=0``): the kept parameters stay
  on the layer as masters (one extra copy of the layer's FP8 weights) and the kernel's state is
  registered as a derived copy (``stitch_core.engine.derived``, kind ``fp8:<kernel class>``),
  rebuilt by re-running the same post-load step from the masters whenever a patch writes either
  of them (a scale and every code it scales are one layer: a scale patch rebuilds the whole
  layer), and proven current by its stamp.

The online FP8 methods (``--quantization fp8_per_block`` on a bf16 checkpoint) are kept by
``stitch_vllm.fp8_online`` through the same import hook.

Refused at start-up: a post-load step that writes into the loader-format tensors themselves
(DeepGEMM's UE8M0 requant, vLLM's default wherever DeepGEMM runs; ROCm's fnuz branch for UE8M0
scales: the masters no longer hold the published view, the start-up proof fails naming the
tensors) and FP8 MoE layers
(``Fp8MoEMethod``, not kept here: their loaders fail on the re-registered parameters, and the
layout learning names the group and the parameter).
"""

from __future__ import annotations

import torch

from stitch_core.engine.import_hooks import after_import
from stitch_core.engine.postload import wrap_post_load

from .fp8_online import ONLINE_MODULE, wrap_online_methods

__all__ = ["install_fp8_keeper", "kernel_names", "FP8_PARAMS"]

FP8_MODULE = "vllm.model_executor.layers.quantization.fp8"
FP8_PARAMS = ("weight", "weight_scale_inv", "weight_scale", "input_scale")


def _kind(method, layer: torch.nn.Module) -> str:
    return f"fp8:{type(getattr(method, 'fp8_linear', None)).__name__}"


def _wrap_fp8(mod) -> None:
    wrap_post_load(mod.Fp8LinearMethod, _kind, FP8_PARAMS)


# what to wrap in each module, once it is imported
_HOOKS = {FP8_MODULE: _wrap_fp8, ONLINE_MODULE: wrap_online_methods}


def install_fp8_keeper() -> bool:
    """Wrap ``Fp8LinearMethod.process_weights_after_loading`` (``stitch_core.engine.postload``)
    and the online FP8 methods' (``stitch_vllm.fp8_online``), idempotent: now for vLLM's FP8
    modules already imported, else as soon as they are (``stitch_core.engine.import_hooks``:
    importing them costs seconds, and most engines never load an FP8 model).
    True once both are wrapped."""
    return after_import(_HOOKS) == len(_HOOKS)


def kernel_names(model: torch.nn.Module) -> dict[str, int]:
    """{kernel name: FP8 linear layers it serves}: the dev stand-ins' own names
    (``stitch_dev:standin``, ``stitch_dev:standin-packed``), ``vllm:<class>`` for vLLM's (e.g.
    ``vllm:CPUFp8BlockScaledMMKernel``)."""
    out: dict[str, int] = {}
    for mod in model.modules():
        kernel = getattr(getattr(mod, "quant_method", None), "fp8_linear", None)
        if kernel is None:
            continue
        cls = type(kernel)
        name = getattr(cls, "name", None) if cls.__module__.startswith("stitch_dev") else None
        if not isinstance(name, str):
            name = f"{cls.__module__.split('.')[0]}:{cls.__name__}"
        out[name] = out.get(name, 0) + 1
    return dict(sorted(out.items()))
