"""vLLM's online FP8 (``--quantization fp8_per_block`` / ``fp8_per_tensor`` /
``fp8_per_channel`` on a BF16 checkpoint): follow patches of the bf16 view, re-quantize with
vLLM's own quantizer.

vLLM 0.32's online methods (``vllm.model_executor.layers.quantization.online.fp8``:
``Fp8PerBlockOnlineLinearMethod``, ``Fp8PerTensorOnlineLinearMethod``,
``Fp8PtpcOnlineLinearMethod``) create each linear layer's ``weight`` in the checkpoint's dtype on
the meta device; the layer-wise loader materialises it, loads the checkpoint shards through the
model's own loaders (fused q/k/v and gate/up, TP slices), then calls the method's
``process_weights_after_loading``. That step quantizes the bf16 weight (per 128x128 block:
``per_block_cast_to_fp8``; per tensor: ``scaled_fp8_quant``; per output channel) and
re-registers ``weight`` as the fp8 codes plus ``weight_scale_inv`` / ``weight_scale``, then runs
the chosen kernel's own post-load step. The bf16 weight is dropped: the served view of such an
engine is the **bf16** checkpoint, and the fp8 bits are whatever vLLM's quantizer makes of it.

``install_online_fp8_keeper`` (run by the plugin in every vLLM process, through the same import
hook as ``stitch_vllm.fp8``) wraps each online method's ``process_weights_after_loading``: it
keeps the loaded bf16 ``weight`` Parameter (with its original loader, the layer-wise wrapper
already removed by vLLM) as the layer's ``_stitch_masters`` (what the layout map learns through,
what patches write, what the fingerprints read) and registers the quantized state as a derived
copy (``stitch_core.engine.derived``, kind ``fp8-online:<method>``). After a patch writes a
master, the copy is rebuilt by re-running the **same** method on the patched bf16 weight, so the
served fp8 codes and scales are those a fresh engine on the new bf16 version computes; the kernel's
tensors are then refilled **in place** (same storage: captured CUDA graphs keep reading them)
wherever shapes and dtypes agree. Unit of re-quantization: one linear layer, all of its blocks:
vLLM's quantizer is called per layer, and calling it on the whole layer makes the result the
engine's own by construction (every bf16 patch measured in benchmarks/results/quant_views.md
touched every block of every layer anyway, so a per-block path would save nothing there).
Cost: one bf16 copy of every quantized linear layer.

Not kept (the layout learning then names the parameter; the engine refuses to follow):

* per-tensor and per-channel scales of a layer sharded along the dimension its ``amax`` reduces
  (TP > 1): vLLM all-reduces that ``amax`` across the TP group, so re-quantizing one rank's shard
  alone is not what a fresh engine computes, and a rank whose shard no patch touched would not
  join the collective;
* a layer whose method re-quantizes another checkpoint format (``requantization_source``): its
  masters would be that format's, not bf16;
* online FP8 MoE layers (``Fp8PerBlockOnlineMoEMethod`` and siblings): not wrapped here.
"""

from __future__ import annotations

import functools
import logging

import torch

from stitch_core.engine import derived

__all__ = ["ONLINE_MODULE", "wrap_online_methods", "requantized_blocks"]

ONLINE_MODULE = "vllm.model_executor.layers.quantization.online.fp8"
METHODS = ("Fp8PerBlockOnlineLinearMethod", "Fp8PerTensorOnlineLinearMethod",
           "Fp8PtpcOnlineLinearMethod")
_ORIG: dict[type, object] = {}
log = logging.getLogger("stitch.vllm")


def wrap_online_methods(module) -> list[str]:
    """Wrap ``process_weights_after_loading`` of every online FP8 linear method `module` (vLLM's
    online FP8 module) defines (idempotent); the names wrapped."""
    done = []
    for name in METHODS:
        cls = getattr(module, name, None)
        if cls is None or cls in _ORIG:
            continue
        _wrap(cls, module)
        done.append(name)
    return done


def _refusal(method, layer, module) -> str | None:
    if getattr(method, "requantization_source", None) is not None:
        return "re-quantizes another checkpoint format"
    if type(method).__name__ == "Fp8PerBlockOnlineLinearMethod":
        return None  # blocks never straddle a TP shard's edge in what vLLM quantizes
    per_tensor = type(method).__name__ == "Fp8PerTensorOnlineLinearMethod"
    if module._is_tp_sharded(layer, reduces_output_dim=per_tensor):
        return "its amax is all-reduced across the TP group"
    return None


def _wrap(cls, module) -> None:
    orig = cls.process_weights_after_loading
    _ORIG[cls] = orig

    def process_weights_after_loading(self, layer):
        if getattr(layer, "_already_called_process_weights_after_loading", False):
            return orig(self, layer)  # vLLM's own guard: nothing to do
        master = layer._parameters.get("weight")
        before = {n for n, p in layer._parameters.items() if p is not None}
        why = _refusal(self, layer, module)
        orig(self, layer)
        if why is not None or not isinstance(master, torch.nn.Parameter):
            log.warning("stitch: %s of %s not kept (%s): this engine cannot follow patches of it",
                        type(self).__name__, getattr(layer, "prefix", type(layer).__name__),
                        why or "no bf16 weight")
            return
        layer._stitch_masters = {"weight": master}
        # the scales (and any other tensor the method made) are the copy's, not weights
        holders = tuple(n for n, p in layer._parameters.items()
                        if n != "weight" and n not in before and isinstance(p, torch.Tensor))
        derived.register(layer, f"fp8-online:{type(self).__name__}", {"weight": master},
                         functools.partial(_requantize, self, layer), holders=holders)

    process_weights_after_loading.__wrapped__ = orig  # type: ignore[attr-defined]
    cls.process_weights_after_loading = process_weights_after_loading


def _requantize(method, layer: torch.nn.Module) -> None:
    """Re-run the layer's online quantization from its (patched) bf16 master; refill the
    kernel's tensors in place where shape and dtype agree."""
    kernel = {n: p for n, p in layer._parameters.items() if isinstance(p, torch.nn.Parameter)}
    layer._parameters["weight"] = layer._stitch_masters["weight"]
    if hasattr(layer, "_already_called_process_weights_after_loading"):
        delattr(layer, "_already_called_process_weights_after_loading")
    _ORIG[type(method)](method, layer)
    for n, old in kernel.items():
        new = layer._parameters.get(n)
        if (isinstance(new, torch.Tensor) and new is not old and new.dtype == old.dtype
                and new.shape == old.shape and new.device == old.device):
            old.data.copy_(new.data)
            layer._parameters[n] = old


def requantized_blocks(model: torch.nn.Module, modules: list[str]) -> tuple[int, int]:
    """(layers, blocks): how many of `modules` (names from ``derived.rebuild_from``) are online-FP8
    layers, and how many 128x128 blocks (per-block layers) or whole tensors (other online methods)
    their re-quantization covered. Other rebuilt copies (a CPU backend's packed bf16 layers) are
    not counted."""
    byname = dict(model.named_modules())
    layers = blocks = 0
    for name in modules:
        layer = byname.get(name)
        dc = getattr(layer, derived.ATTR, None)
        if layer is None or dc is None or not dc.kind.startswith("fp8-online:"):
            continue
        scale = layer._parameters.get("weight_scale_inv")
        layers += 1
        blocks += scale.numel() if scale is not None else 1
    return layers, blocks
