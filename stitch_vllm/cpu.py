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
``_stitch_masters`` ({attribute: tensor}, what ``stitch_core.engine.layout`` maps and patches) and a
``_stitch_repack`` function; ``repack_dirty`` re-packs the modules an apply changed. Costs one extra
copy of every packed weight, on the CPU only: on GPUs nothing is installed and the kernels read
``param.data`` directly. Packed linear layers and MoE experts can also be built ahead of an
apply's pause by vLLM's own packing on a stand-in module (`_build_linear`, `_build_moe`;
`stitch_core.engine.prebuild`), so the pause only swaps each layer's ``cpu_linear`` or the
experts' two packed parameters.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Iterable

import torch

from stitch_core.engine import derived
from stitch_core.engine.import_hooks import after_import
from stitch_core.engine.postload import rebuild_dirty

__all__ = ["install_cpu_weight_keeper", "repack_dirty", "init_amx", "pack_kind"]

_ORIG_DISPATCH = None
_ORIG_MOE = None
MOE_WEIGHTS = ("w13_weight", "w2_weight")
_MISSING = object()
# packed linear copies built ahead of an apply's pause (`stitch_core.engine.prebuild`): the
# layer's whole state is its ``cpu_linear`` closure
AHEAD_KINDS = ("onednn", "amx")


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
        source = layer.weight  # the tensor the packed copy is built from (a tied lm_head: the
        orig(layer, remove_weight)  # embedding's own parameter)
        kind = pack_kind(layer)
        if layer.weight is not source:  # weight emptied: keep the master for patching
            layer._stitch_masters = {"weight": source}
        if kind != "torch" or layer.weight is not source:
            build = (functools.partial(_build_linear, layer, remove_weight, kind)
                     if kind in AHEAD_KINDS else None)
            derived.register(layer, kind, {"weight": source},
                             functools.partial(_repack_linear, layer, remove_weight),
                             holders=("cpu_linear",), build=build)

    dispatch.__wrapped__ = orig  # type: ignore[attr-defined]
    lu.dispatch_cpu_unquantized_gemm = dispatch
    return True


def pack_kind(layer: torch.nn.Module) -> str:
    """Which CPU GEMM path vLLM chose for a layer, read from its ``cpu_linear`` closure:
    ``amx`` (sgl-kernel ``convert_weight_packed``), ``onednn`` (a oneDNN handle), ``zentorch``,
    ``torch`` (``F.linear`` on the parameter: nothing packed) or ``other``."""
    fn = getattr(layer, "cpu_linear", None)
    code = getattr(fn, "__code__", None)
    if code is None or not getattr(fn, "__closure__", None):
        return "torch"
    free = set(code.co_freevars)
    if "packed_weight" in free:
        return "amx"
    if "handler" in free:
        return "onednn"
    if "zen_weight" in free:
        return "zentorch"
    return "other"


def _repack_linear(layer: torch.nn.Module, remove_weight: bool) -> None:
    # put the (patched) master back, re-pack from it; the dispatch empties it again
    master = (getattr(layer, "_stitch_masters", None) or {}).get("weight")
    if master is not None:
        layer._parameters["weight"] = master
    _ORIG_DISPATCH(layer, remove_weight)


def _build_linear(layer: torch.nn.Module, remove_weight: bool, kind: str,
                  sources) -> functools.partial:
    """vLLM's own packing of `sources["weight"]` for `layer`, done on a stand-in module while
    `layer` keeps serving; returns what installs it (the new ``cpu_linear``; it returns the
    old one, which the rank frees after the pause). The stand-in shares the layer's bias (the
    AMX path converts it to fp32 in place, which it already is)."""
    shim = torch.nn.Module()
    shim.weight = torch.nn.Parameter(sources["weight"], requires_grad=False)
    if getattr(layer, "bias", None) is not None:
        shim.bias = layer.bias
    _ORIG_DISPATCH(shim, remove_weight)
    if pack_kind(shim) != kind:
        raise RuntimeError(f"vLLM packed the stand-in as {pack_kind(shim)}, the layer as {kind}")
    new = shim.cpu_linear

    def install():
        old, layer.cpu_linear = layer.cpu_linear, new
        return old
    return install


MOE_MODULE = "vllm.model_executor.layers.fused_moe.experts.cpu_moe"


def _install_moe_keeper() -> None:
    """Keep the unpadded, unpacked expert weights of vLLM's CPU MoE kernel: its class is wrapped
    when its module is imported (at once if it is; importing it costs ~0.3 s of every engine
    start, and a dense model never does; `stitch_core.engine.import_hooks`)."""
    after_import({MOE_MODULE: _wrap_moe})


def _wrap_moe(cpu_moe) -> None:
    global _ORIG_MOE
    cls = cpu_moe.CPUUnquantizedExperts
    if getattr(cls.process_weights_after_loading, "_stitch_keeper", False):
        return
    orig = cls.process_weights_after_loading
    _ORIG_MOE = orig

    def process_weights_after_loading(self, layer):
        masters = {n: layer._parameters.get(n) for n in MOE_WEIGHTS}
        orig(self, layer)
        kept = {n: m for n, m in masters.items()
                if m is not None and layer._parameters.get(n) is not m}
        if kept:  # replaced by padded / packed copies (not with zentorch, which keeps them)
            layer._stitch_masters = kept
            derived.register(layer, "moe-packed", kept, functools.partial(_repack_moe, self, layer),
                             build=functools.partial(_build_moe, self, layer))

    process_weights_after_loading.__wrapped__ = orig  # type: ignore[attr-defined]
    process_weights_after_loading._stitch_keeper = True  # type: ignore[attr-defined]
    cls.process_weights_after_loading = process_weights_after_loading


def _repack_moe(experts, layer: torch.nn.Module) -> None:
    for n, master in layer._stitch_masters.items():
        layer._parameters[n] = master
    _ORIG_MOE(experts, layer)  # pads and packs into new tensors; the masters stay as they are


def _build_moe(experts, layer: torch.nn.Module, sources) -> functools.partial:
    """vLLM's own MoE post-load step (pad, pre-pack) of `sources` on a stand-in of `layer` (a
    shallow copy with its own parameter dict) while `layer` keeps serving; returns what installs
    the packed parameters (it returns the ones they replace). Refused (the pause re-packs as
    before) where the step would write into something the stand-in shares with the layer: the
    expert bias of a padded layer (vLLM pads it through ``.data``)."""
    padded = experts._padded_intermediate_size(experts.moe_config)
    if getattr(layer, "w13_bias", None) is not None and \
            padded != experts.moe_config.intermediate_size_per_partition:
        raise RuntimeError("a padded MoE layer's bias is padded in place: not built ahead")
    shim = copy.copy(layer)
    shim._parameters = dict(layer._parameters)
    for name, src in sources.items():
        p = torch.nn.Parameter(src, requires_grad=False)
        loader = getattr(layer._stitch_masters.get(name), "weight_loader", None)
        if loader is not None:  # as the in-place re-pack's new parameter gets it
            p.weight_loader = loader
        shim._parameters[name] = p
    # the step records a choice on the experts object, which the engine reads as it serves;
    # the stand-in (a copy of the layer) makes the same choice, and the layer's is put back
    use_zentorch = experts.__dict__.get("_use_zentorch", _MISSING)
    try:
        _ORIG_MOE(experts, shim)
    finally:
        if use_zentorch is not _MISSING:
            experts._use_zentorch = use_zentorch
    new = {name: shim._parameters[name] for name in sources}
    ptrs = {t.untyped_storage().data_ptr() for t in sources.values()}
    if any(p.untyped_storage().data_ptr() in ptrs for p in new.values()):
        raise RuntimeError("vLLM's MoE step kept the source tensors: not built ahead")
    return functools.partial(_install_moe, layer, new)


def _install_moe(layer: torch.nn.Module, new: dict[str, torch.nn.Parameter]) -> dict:
    old = {name: layer._parameters[name] for name in new}
    layer._parameters.update(new)
    return old


def repack_dirty(model: torch.nn.Module, dirty_params: Iterable[str]) -> list[str]:
    """Re-pack every module whose packed copy is built from a changed parameter (by storage: a
    tied lm_head re-packs with the embedding); the modules' names, sorted."""
    return rebuild_dirty(model, dirty_params)
