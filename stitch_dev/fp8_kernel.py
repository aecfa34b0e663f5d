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

__all__ = ["ENV", "NAME", "PACKED_NAME", "install", "uninstall", "dequantize_blocks"]

ENV = "STITCH_DEV_FP8_KERNEL"
NAME = "stitch_dev:standin"  # how /stitch/status names it (the class's `name`)
PACKED_NAME = "stitch_dev:standin-packed"
MODES = ("standin", "auto", "standin-packed")
log = logging.getLogger("stitch.dev.fp8")
_KERNEL: dict[str, type] | None = None


def dequantize_blocks(codes: torch.Tensor, scales: torch.Tensor, block: tuple[int, int],
                      dtype: torch.dtype) -> torch.Tensor:
    """``codes`` [N, K] (float8) times the scale of each element's (block_n x block_k) block
    (``scales`` [ceil(N / block_n), ceil(K / block_k)]), in float32, cast to `dtype`."""
    n, k = codes.shape
    bn, bk = block
    s = scales.to(torch.float32).repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return (codes.to(torch.float32) * s).to(dtype)


def _kernel_classes() -> dict[str, type]:
    global _KERNEL
    if _KERNEL is not None:
        return _KERNEL
    from vllm.model_executor.kernels.linear.scaled_mm.BlockScaledMMLinearKernel import (
        Fp8BlockScaledMMLinearKernel,
    )
    from vllm.model_executor.utils import replace_parameter
    from vllm.platforms import current_platform

    class StitchDevStandinFp8BlockKernel(Fp8BlockScaledMMLinearKernel):
        """Dequantise the block-scaled weight, then a matmul in the activations' dtype."""

        name = NAME

        apply_input_quant = False  # activations stay bf16: a weight-only (W8A16) stand-in

        @classmethod
        def is_supported(cls, compute_capability: int | None = None):
            if not current_platform.is_cpu():
                return False, "stitch_dev stand-in: CPU only"
            return True, None

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

    _KERNEL = {"standin": StitchDevStandinFp8BlockKernel,
               "standin-packed": StitchDevPackedFp8BlockKernel}
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
    uninstall()
    if mode == "auto":
        kernels.append(classes["standin"])
    else:
        kernels.insert(0, classes[mode])
    return mode


def uninstall() -> None:
    """Take the stand-ins out of vLLM's kernel list again (tests that install in-process)."""
    if _KERNEL is None:
        return
    import vllm.model_executor.kernels.linear as kl
    from vllm.platforms import PlatformEnum

    kernels = kl._POSSIBLE_FP8_BLOCK_KERNELS.get(PlatformEnum.CPU, [])
    kernels[:] = [k for k in kernels if k not in _KERNEL.values()]

