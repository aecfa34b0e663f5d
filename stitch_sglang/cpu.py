"""SGLang's post-load steps: keep what the loaders wrote, follow what the kernels read.

SGLang ends each layer's load with its quantization method's ``process_weights_after_loading``.
Two families matter to a follower:

* **the CPU AMX backend** (``SGLANG_USE_CPU_ENGINE=1`` on a host with AMX tiles and the CPU
  build of ``sgl-kernel``): ``sglang.srt.layers.amx_utils._amx_process_weight_after_loading``
  replaces ``weight`` by a VNNI-packed copy (``torch.ops.sgl_kernel.convert_weight_packed``,
  read by ``weight_packed_linear`` / ``fp8_scaled_mm_cpu``) and ``bias`` by a float32 copy, in
  unquantized linear layers (``UnquantizedLinearMethod``), the lm_head
  (``amx_utils.PackWeightMethod``), unquantized MoE experts (``UnquantizedFusedMoEMethod``:
  ``w13_weight``, ``w2_weight``) and FP8 linear layers (``Fp8LinearMethod``);
* **FP8 linear layers** on any device: the post-load step re-registers ``weight`` /
  ``weight_scale_inv`` as plain Parameters (same storage on the block path outside DeepGEMM,
  dropping the loader attributes), or transforms them (a per-tensor max-scale requant, a
  transpose, online quantization of a bf16 checkpoint).

``install_post_load_keeper()`` (run by the plugin in every scheduler, before the model loads)
wraps those methods with ``stitch_core.engine.postload.wrap_post_load``, when SGLang imports
their modules: the loader-format tensors become the layer's ``_stitch_masters`` (what the
layout map learns through, what patches write and the proofs read) and whatever the kernel
reads instead is a derived copy (kind ``sglang-amx:<method>`` or ``sglang:<method>``), rebuilt
by running the same post-load step on the patched masters (``rebuild_dirty``, the rank's
``on_dirty``) and proven current by its stamp. Costs one extra copy of every packed or
transformed weight; nothing where the kernels read the loaded tensors themselves.

A checkpoint without KV-cache scales leaves each attention layer's ``k_scale`` / ``v_scale``
parameters (created by an FP8 quant config's ``BaseKVCacheMethod``) at SGLang's default 1.0: no
version can change them, so they are marked as engine constants (``_stitch_constants``) rather
than refused as weights no loader writes. Scales a checkpoint does carry stay weights; their
float copies (``k_scale_float``) are not kept in step: a patch of a KV-cache scale is refused
at start-up (the layout learning names them as derived state).

Not kept: MoE FP8 layers (``Fp8MoEMethod``), int8 / AWQ / GPTQ / MXFP4 CPU paths (their layers
are not wrapped: the layout learning names what it cannot map and the engine refuses to follow).
"""

from __future__ import annotations

import torch

from stitch_core.engine.import_hooks import after_import
from stitch_core.engine.postload import rebuild_dirty, wrap_post_load

__all__ = ["install_post_load_keeper", "rebuild_dirty", "kernel_names", "METHODS"]

# module -> (class, the parameters that are masters: None for every parameter the layer holds)
METHODS: dict[str, tuple[tuple[str, tuple[str, ...] | None], ...]] = {
    "sglang.srt.layers.quantization.unquant": (("UnquantizedLinearMethod", None),
                                               ("UnquantizedFusedMoEMethod", None)),
    "sglang.srt.layers.amx_utils": (("PackWeightMethod", None),),
    # FP8 layers too: the AMX post-load step also replaces a bias by a float32 copy
    "sglang.srt.layers.quantization.fp8": (("Fp8LinearMethod", None),),
}


def _kind(method, layer: torch.nn.Module) -> str:
    backend = "sglang-amx" if getattr(layer, "use_intel_amx_backend", False) else "sglang"
    return f"{backend}:{type(method).__name__}"


def _wrapper(classes):
    def hook(mod) -> None:
        for cls_name, names in classes:
            cls = getattr(mod, cls_name, None)
            if cls is not None:
                wrap_post_load(cls, _kind, names)
    return hook


KV_CACHE_MODULE = "sglang.srt.layers.quantization.kv_cache"
KV_SCALES = ("k_scale", "v_scale")


def _wrap_kv_cache(mod) -> None:
    cls = getattr(mod, "BaseKVCacheMethod", None)
    if cls is None or getattr(cls.process_weights_after_loading, "_stitch_kv", False):
        return
    orig = cls.process_weights_after_loading

    def process_weights_after_loading(self, layer):
        scales = [getattr(layer, n, None) for n in KV_SCALES]
        unloaded = all(isinstance(t, torch.Tensor) and t.numel() == 1 and float(t) <= 0.0
                       for t in scales)  # SGLang's "not in the checkpoint" sentinel
        result = orig(self, layer)
        if unloaded:
            layer._stitch_constants = KV_SCALES
        return result

    process_weights_after_loading._stitch_kv = True  # type: ignore[attr-defined]
    process_weights_after_loading.__wrapped__ = orig  # type: ignore[attr-defined]
    cls.process_weights_after_loading = process_weights_after_loading


_HOOKS = {**{module: _wrapper(classes) for module, classes in METHODS.items()},
          KV_CACHE_MODULE: _wrap_kv_cache}


def install_post_load_keeper() -> int:
    """Wrap SGLang's post-load steps (see the module doc), now for the modules already imported
    and at their import for the others; idempotent. The number wrapped now."""
    return after_import(_HOOKS)


def kernel_names(model: torch.nn.Module) -> dict[str, int]:
    """{kernel: FP8 linear layers it serves}: ``sgl_kernel:fp8_scaled_mm_cpu`` (or the dev
    stand-in's name when ``stitch_dev.sgl_cpu_kernel`` serves that op) for CPU AMX layers,
    ``sglang:<method>`` for the others."""
    standin = _standin_name()
    out: dict[str, int] = {}
    for mod in model.modules():
        method = getattr(mod, "quant_method", None)
        if type(method).__name__ != "Fp8LinearMethod":
            continue
        if getattr(mod, "use_intel_amx_backend", False):
            name = standin or "sgl_kernel:fp8_scaled_mm_cpu"
        else:
            name = f"sglang:{type(method).__name__}"
        out[name] = out.get(name, 0) + 1
    return dict(sorted(out.items()))


def _standin_name() -> str | None:
    import sys

    dev = sys.modules.get("stitch_dev.sgl_cpu_kernel")  # only if the plugin installed it
    return getattr(dev, "installed", lambda: None)()
