"""A dev-only stand-in FP8 block-scaled linear kernel for vLLM's CPU backend (tests only).

vLLM 0.32's CPU kernels for FP8 block-quantized checkpoints (``quant_method: fp8``,
``weight_block_size``, ``weight_scale_inv``) need AMX: ``CPUFp8BlockScaledMMKernel`` ("requires
AMX tile support") and ``CPUFp8W8A8BlockScaledMMKernel`` (native AMX-FP8). A host without AMX
(this repository's AMD EPYC CI host) cannot start such an engine at all. This module adds one more
entry to vLLM's own kernel choice list for FP8 block-scaled linears on the CPU
(``vllm.model_executor.kernels.linear._POSSIBLE_FP8_BLOCK_KERNELS[PlatformEnum.CPU]``, the list
``init_fp8_linear_kernel`` walks through ``choose_scaled_mm_linear_kernel``), so that the rest
of vLLM's FP8 path is vLLM's own: ``Fp8LinearMethod.create_weights`` (fp8 ``weight`` + float32
``weight_scale_inv`` parameters with their block-aware loaders), the checkpoint loaders, and
``Fp8LinearMethod.process_weights_after_loading``, which ends in the kernel's
``process_weights_after_loading`` (here the base class's: ``process_fp8_weight_block_strategy``,
fnuz normalisation on ROCm only, weight kept ``[N, K]``).

The stand-in's matmul: dequantise the block-scaled weight (``code * scale`` of its 128x128 block,
float32, then the activations' dtype) and ``F.linear`` in that dtype. It reads ``layer.weight`` and
``layer.weight_scale_inv`` at every call (no packed copy), deterministic on a given host. It is
not vLLM's numerics: bit-exact comparisons are against a fresh engine on the same kernel.

``standin-packed`` is the same matmul from a packed copy: its post-load step replaces ``weight``
by the dequantised bf16 matrix, as vLLM's AMX kernels replace it by a VNNI-packed one, so the
Stitch plugin must keep the fp8 tensors and re-run the post-load step after a patch (the path a
host with AMX takes with vLLM's own kernel; tests run it on any host).

The same stand-in serves per-tensor and per-output-channel scaled FP8 weights
(``StitchDevStandinFp8ScaledMMKernel`` in ``_POSSIBLE_FP8_KERNELS[PlatformEnum.CPU]``: vLLM's
online ``fp8_per_tensor`` and ``fp8_per_channel``; weight ``[K, N]`` after those methods' transpose,
scale a scalar or one per output channel): dequantise (``code * scale`` in float32, then the
activations' dtype) and ``F.linear``, weight-only. vLLM's own CPU kernels for these need AMX
(per tensor, W8A16) or native AMX-FP8 (per channel, W8A8, Diamond Rapids).

vLLM's CPU build also declares ``_C::static_scaled_fp8_quant`` without arguments or a kernel (the
op ``fp8_per_tensor`` quantizes its weights with): an engine with that method cannot start on
any CPU. ``install`` then also wraps ``vllm._custom_ops.scaled_fp8_quant`` so that a static
per-tensor call on CPU tensors runs the same arithmetic as vLLM's CUDA kernel
(``csrc/quantization/fp8/common.cuh``, ``scaled_fp8_conversion`` with an inverted scale:
``x * (1 / scale)``, clamped to +-448, rounded to nearest even by ``c10::Float8_e4m3fn``) in
torch; every other call goes to vLLM's op unchanged. The log says when it does.

Switched on in the engine's environment (every process vLLM starts inherits it):
``STITCH_DEV_FP8_KERNEL=standin`` puts the stand-in first (always used), ``=auto`` last (used only
where none of vLLM's own CPU kernels is supported on this host). The Stitch vLLM plugin
(``stitch_vllm.plugin.register``, run in every vLLM process) imports this module when the
variable is set; ``stitch_dev`` is not in the wheel, so the variable needs this source tree on the
path (the plugin says so otherwise).
"""

from __future__ import annotations

import logging
import os

import torch

__all__ = ["ENV", "NAME", "PACKED_NAME", "install", "uninstall", "dequantize_blocks",
           "dequantize_scaled", "static_fp8_quant"]

ENV = "STITCH_DEV_FP8_KERNEL"
NAME = "stitch_dev:standin"  # how /stitch/status names it (the class's `name`)
PACKED_NAME = "stitch_dev:standin-packed"
MODES = ("standin", "auto", "standin-packed")
log = logging.getLogger("stitch.dev.fp8")
_KERNEL: dict[str, type] | None = None
_QUANT_ORIG: object | None = None  # vLLM's scaled_fp8_quant while the stand-in wraps it


def dequantize_blocks(codes: torch.Tensor, scales: torch.Tensor, block: tuple[int, int],
                      dtype: torch.dtype) -> torch.Tensor:
    """``codes`` [N, K] (float8) times the scale of each element's (block_n x block_k) block
    (``scales`` [ceil(N / block_n), ceil(K / block_k)]), in float32, cast to `dtype`."""
    n, k = codes.shape
    bn, bk = block
    s = scales.to(torch.float32).repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return (codes.to(torch.float32) * s).to(dtype)


def dequantize_scaled(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``codes`` [K, N] (float8) times one scale (per tensor) or one per output column (per
    channel: ``scale`` of N elements, any shape), in float32, cast to `dtype`."""
    s = scale.to(torch.float32).reshape(-1)
    if s.numel() != 1:
        if s.numel() != codes.shape[1]:
            raise ValueError(f"stand-in: {s.numel()} scales for a weight of {codes.shape[1]} "
                             "output channels")
        s = s.view(1, -1)
    return (codes.to(torch.float32) * s).to(dtype)


def static_fp8_quant(x: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None = None
                     ) -> torch.Tensor:
    """vLLM's static per-tensor FP8 quantization (its CUDA kernel's arithmetic) in torch:
    ``x * (1 / scale)`` in float32, clamped to the e4m3 range, rounded to nearest even."""
    fp8 = torch.float8_e4m3fn
    top = torch.finfo(fp8).max
    inv = 1.0 / scale.to(torch.float32).reshape(())
    q = (x.to(torch.float32) * inv).clamp_(-top, top).to(fp8)
    if out is None:
        return q
    out.copy_(q)
    return out


def _placeholder_quant_op() -> bool:
    """Whether vLLM's ``_C::static_scaled_fp8_quant`` is the argument-less placeholder of a
    build without the kernel (vLLM's CPU build)."""
    try:
        op = torch.ops._C.static_scaled_fp8_quant
        return len(op.default._schema.arguments) == 0
    except (AttributeError, RuntimeError):
        return False


def _wrap_quant() -> bool:
    """Wrap ``vllm._custom_ops.scaled_fp8_quant`` with the torch stand-in for static per-tensor
    calls on CPU tensors, where the op is a placeholder. Whether it is wrapped now."""
    global _QUANT_ORIG
    import vllm._custom_ops as ops

    if _QUANT_ORIG is not None:
        return True
    if not _placeholder_quant_op():
        return False
    orig = ops.scaled_fp8_quant

    def scaled_fp8_quant(input, scale=None, num_token_padding=None, scale_ub=None,
                         use_per_token_if_dynamic=False, output=None, group_shape=None):
        if (input.device.type == "cpu" and scale is not None and scale.numel() == 1
                and not num_token_padding):
            return static_fp8_quant(input, scale, output), scale
        return orig(input, scale, num_token_padding, scale_ub, use_per_token_if_dynamic,
                    output, group_shape)

    scaled_fp8_quant.__wrapped__ = orig  # type: ignore[attr-defined]
    ops.scaled_fp8_quant = scaled_fp8_quant
    _QUANT_ORIG = orig
    log.warning("stitch_dev: vLLM has no CPU static_scaled_fp8_quant; static per-tensor FP8 "
                "quantization runs the stand-in (torch, the CUDA kernel's arithmetic)")
    return True


def _unwrap_quant() -> None:
    global _QUANT_ORIG
    if _QUANT_ORIG is None:
        return
    import vllm._custom_ops as ops

    ops.scaled_fp8_quant = _QUANT_ORIG
    _QUANT_ORIG = None


def _kernel_classes() -> dict[str, type]:
    global _KERNEL
    if _KERNEL is not None:
        return _KERNEL
    from vllm.model_executor.kernels.linear.scaled_mm.BlockScaledMMLinearKernel import (
        Fp8BlockScaledMMLinearKernel,
    )
    from vllm.model_executor.kernels.linear.scaled_mm.ScaledMMLinearKernel import (
        FP8ScaledMMLinearKernel,
    )
    from vllm.model_executor.utils import replace_parameter
    from vllm.platforms import current_platform

    class _CpuOnly:
        """What every stand-in kernel shares: vLLM chooses it on the CPU only."""

        @classmethod
        def is_supported(cls, compute_capability: int | None = None):
            if not current_platform.is_cpu():
                return False, "stitch_dev stand-in: CPU only"
            return True, None

    class StitchDevStandinFp8BlockKernel(_CpuOnly, Fp8BlockScaledMMLinearKernel):
        """Dequantise the block-scaled weight, then a matmul in the activations' dtype."""

        name = NAME

        apply_input_quant = False  # activations stay bf16: a weight-only (W8A16) stand-in

        @classmethod
        def can_implement(cls, config):
            gs = config.weight_quant_key.scale.group_shape
            if gs.row <= 0 or gs.col <= 0:
                return False, "stitch_dev stand-in: block-scaled weights only"
            if config.out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
                return False, "stitch_dev stand-in: bf16/fp16/fp32 output only"
            return True, None

        def apply_block_scaled_mm(self, A, B, As, Bs):
            gs = self.weight_group_shape
            w = dequantize_blocks(B, Bs, (gs.row, gs.col), A.dtype)
            return torch.nn.functional.linear(A, w)

    class StitchDevPackedFp8BlockKernel(StitchDevStandinFp8BlockKernel):
        """The stand-in with a packed copy: its post-load step replaces ``weight`` by the
        dequantised bf16 matrix, which it reads from then on (as vLLM's AMX kernels replace it by
        a VNNI-packed one): a patch of the fp8 codes or scales reaches it only if the post-load
        step is re-run."""

        name = PACKED_NAME

        def process_weights_after_loading(self, layer):
            super().process_weights_after_loading(layer)
            gs = self.weight_group_shape
            packed = dequantize_blocks(layer.weight.data, layer.weight_scale_inv.data,
                                       (gs.row, gs.col), torch.bfloat16)
            replace_parameter(layer, "weight", packed)

        def apply_block_scaled_mm(self, A, B, As, Bs):
            return torch.nn.functional.linear(A, B.to(A.dtype))

    class StitchDevStandinFp8ScaledMMKernel(_CpuOnly, FP8ScaledMMLinearKernel):
        """Per-tensor or per-channel scaled FP8 weights: dequantise, then a matmul in the
        activations' dtype (weight-only: activations are not quantized)."""

        name = NAME

        @classmethod
        def can_implement(cls, config):
            gs = config.weight_quant_key.scale.group_shape
            if gs.row > 0 and gs.col > 0:
                return False, "stitch_dev stand-in: per-tensor or per-channel scales only"
            if config.out_dtype not in (None, torch.bfloat16, torch.float16, torch.float32):
                return False, "stitch_dev stand-in: bf16/fp16/fp32 output only"
            return True, None

        def apply_weights(self, layer, x, bias=None):
            w, w_s, _, _ = self._get_layer_params(layer)
            return torch.nn.functional.linear(x, dequantize_scaled(w, w_s, x.dtype).t(), bias)

        def apply_scaled_mm(self, **kwargs):  # apply_weights never quantizes activations
            raise NotImplementedError("stitch_dev stand-in: weight-only")

    _KERNEL = {"standin": StitchDevStandinFp8BlockKernel,
               "standin-packed": StitchDevPackedFp8BlockKernel,
               "standin-scaled": StitchDevStandinFp8ScaledMMKernel}
    return _KERNEL


def install(mode: str | None = None) -> str | None:
    """Add the stand-in to vLLM's CPU FP8 block-kernel list as `mode` (default: the
    ``STITCH_DEV_FP8_KERNEL`` variable) says: ``standin`` first, ``auto`` last,
    ``standin-packed`` (the stand-in with a packed copy, see below) first. Idempotent; the mode
    installed (None: variable unset). A mode it does not know raises ValueError."""
    mode = mode if mode is not None else os.environ.get(ENV, "").strip()
    if not mode:
        return None
    if mode not in MODES:
        raise ValueError(f"{ENV}={mode!r}: expected one of {', '.join(MODES)}")
    import vllm.model_executor.kernels.linear as kl
    from vllm.platforms import PlatformEnum

    classes = _kernel_classes()
    kernels = kl._POSSIBLE_FP8_BLOCK_KERNELS.setdefault(PlatformEnum.CPU, [])
    scaled = kl._POSSIBLE_FP8_KERNELS.setdefault(PlatformEnum.CPU, [])
    uninstall()
    if mode == "auto":
        kernels.append(classes["standin"])
        scaled.append(classes["standin-scaled"])
    else:
        kernels.insert(0, classes[mode])
        scaled.insert(0, classes["standin-scaled"])
    _wrap_quant()
    return mode


def uninstall() -> None:
    """Take the stand-ins out of vLLM's kernel list again (tests that install in-process)."""
    if _KERNEL is None:
        return
    import vllm.model_executor.kernels.linear as kl
    from vllm.platforms import PlatformEnum

    for table in (kl._POSSIBLE_FP8_BLOCK_KERNELS, kl._POSSIBLE_FP8_KERNELS):
        kernels = table.get(PlatformEnum.CPU, [])
        kernels[:] = [k for k in kernels if k not in _KERNEL.values()]
    _unwrap_quant()

