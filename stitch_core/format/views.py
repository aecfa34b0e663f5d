"""Served views: project master weights to exactly the tensors an inference engine holds.

Masters are a dict name -> fp32/bf16 tensor in Hugging Face checkpoint layout (2-D weights are
(out_features, in_features)). A view is a pure function of the masters and, for fp8, of the
previous view. Rules:

* ``bf16`` / ``fp16``: every floating tensor becomes ``t.to(dtype)`` (round-to-nearest-even).
* ``fp8-e4m3-{tensor,channel,block}`` (``fp8-e4m3`` is an alias of ``fp8-e4m3-block``):
  2-D floating tensors named ``*.weight``, except embeddings and the LM head (names containing
  ``embed`` or ``lm_head``), become ``float8_e4m3fn`` codes plus a float32 scale tensor, with
  ``dequantized = code * scale``. Scale shapes: tensor ``(1,)``, channel ``(rows, 1)``, block
  ``(ceil(rows/128), ceil(cols/128))`` with partial last blocks. The scale is stored as
  ``<name>_scale_inv`` for block (DeepSeek-V3 / Qwen3-FP8) and ``<name>_scale`` for tensor and
  channel (compressed-tensors). Every other floating tensor (norms, biases, embeddings, LM head)
  becomes bf16.
* ``mxfp4`` / ``nvfp4``: the same weights (those with an even number of columns; odd ones stay
  bf16) become packed E2M1 codes ``<m>.weight_packed`` (uint8, two per byte) plus
  ``<m>.weight_scale`` (E8M0 as uint8 per 32 columns, resp. float8_e4m3fn per 16) and, for
  nvfp4, ``<m>.weight_global_scale`` (float32 (1,)), in the compressed-tensors layout vLLM loads;
  rules, conventions and pinning in ``stitch_core.format.fp4``. Other floats become bf16.
* Non-floating tensors pass through unchanged. Every output is contiguous, on the input's
  device, and never aliases an input.

Pinned scales (fp8): when ``previous`` (a view earlier returned by ``project``) holds a scale
tensor of the same shape for a weight, each group (tensor / row / 128x128 block) keeps its
previous scale ``s`` unless it would clip, i.e. ``max|w| / s > 448``. Only clipping groups (and
groups whose previous scale is not a positive finite number) get a new scale
``max(amax, 1e-12) * (1 + headroom) / 448``; without a usable previous scale every group does.
Codes are ``(w / s).clamp(-448, 448).to(float8_e4m3fn)`` in float32. Pinning keeps a small
master update a small bit-patch: the scales stay bitwise identical and only codes that cross a
rounding boundary change; projecting the same masters against their own view is the identity.
Masters are assumed finite.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from stitch_core.format.dtypes import true_div
from stitch_core.format.fp4 import FP4_KINDS, MX_GROUP, NV_GROUP, dequantize_fp4, project_fp4

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
TINY = 1e-12

Kind = Literal["bf16", "fp16", "fp8-e4m3", "mxfp4", "nvfp4"]
Granularity = Literal["tensor", "channel", "block"]


@dataclass(frozen=True)
class View:
    """A served view: its canonical name, kind and (fp8) granularity, block size and headroom."""

    name: str  # canonical string, e.g. "bf16", "fp16", "fp8-e4m3-block", "nvfp4"
    kind: Kind
    granularity: Granularity | None = None  # fp8 only
    block: int = 128  # fp8 block side; fp4: elements per scale group (32 mxfp4, 16 nvfp4)
    headroom: float = 1 / 32  # relative headroom applied when a scale is (re)computed

    def __post_init__(self) -> None:
        if self.kind == "fp8-e4m3" and self.granularity not in ("tensor", "channel", "block"):
            raise ValueError(f"fp8 view needs a granularity, got {self.granularity!r}")
        if self.block < 1 or self.headroom < 0:
            raise ValueError(f"bad block={self.block} or headroom={self.headroom}")

    @property
    def quantized(self) -> bool:
        """Whether the view holds quantized weights (codes plus scales), not plain casts."""
        return self.kind not in ("bf16", "fp16")


_VIEWS = {
    v.name: v
    for v in (
        View("bf16", "bf16"),
        View("fp16", "fp16"),
        View("fp8-e4m3-tensor", "fp8-e4m3", "tensor"),
        View("fp8-e4m3-channel", "fp8-e4m3", "channel"),
        View("fp8-e4m3-block", "fp8-e4m3", "block"),
        View("mxfp4", "mxfp4", block=MX_GROUP),
        View("nvfp4", "nvfp4", block=NV_GROUP),
    )
}
_ALIASES = {"fp8-e4m3": "fp8-e4m3-block"}
_CAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


def parse_view(spec: str | View) -> View:
    """A View from its name (or the View itself); ValueError lists the valid names."""
    if isinstance(spec, View):
        return spec
    key = _ALIASES.get(spec, spec) if isinstance(spec, str) else None
    if key not in _VIEWS:
        raise ValueError(f"unknown view {spec!r}; valid: {', '.join([*_VIEWS, *_ALIASES])}")
    return _VIEWS[key]


def is_quantized_weight(name: str, t: torch.Tensor) -> bool:
    """fp8 rule: 2-D floating ``*.weight`` tensors, except embeddings and the LM head."""
    return (
        t.dim() == 2
        and t.is_floating_point()
        and name.endswith(".weight")
        and "embed" not in name
        and "lm_head" not in name
    )


def scale_name(weight_name: str, granularity: Granularity | None) -> str:
    """Name of a weight's scale tensor: ``_scale_inv`` for block, ``_scale`` otherwise."""
    if granularity == "block":
        return weight_name + "_scale_inv"
    if granularity in ("tensor", "channel"):
        return weight_name + "_scale"
    raise ValueError(f"no scale for granularity {granularity!r}")


def group_amax(a: torch.Tensor, view: View) -> torch.Tensor:
    """Max of ``a`` (a 2-D tensor of |w|) per scale group, in the scale tensor's shape."""
    if view.granularity == "tensor":
        return a.amax().reshape(1)
    if view.granularity == "channel":
        return a.amax(dim=1, keepdim=True)
    b, (rows, cols) = view.block, a.shape
    nr, nc = -(-rows // b), -(-cols // b)
    a = F.pad(a, (0, nc * b - cols, 0, nr * b - rows))  # zero padding never raises the max
    return a.reshape(nr, b, nc, b).amax(dim=(1, 3))


def expand_scale(scale: torch.Tensor, shape: torch.Size, view: View) -> torch.Tensor:
    """Scale broadcastable to the weight's shape."""
    if view.granularity != "block":
        return scale
    b, (rows, cols) = view.block, shape
    return scale.repeat_interleave(b, 0)[:rows].repeat_interleave(b, 1)[:, :cols]


def _quantize(
    w: torch.Tensor, view: View, prev: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    w32 = w.to(torch.float32).contiguous()
    amax = group_amax(w32.abs(), view)
    scale = true_div(amax.clamp_min(TINY) * (1 + view.headroom), FP8_MAX)
    if prev is not None and prev.shape == scale.shape:
        prev = prev.to(device=scale.device, dtype=torch.float32)
        keep = (prev > 0) & prev.isfinite() & (amax / prev <= FP8_MAX)
        scale = torch.where(keep, prev, scale)
    codes = (w32 / expand_scale(scale, w.shape, view)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return codes.contiguous(), scale.contiguous()


def _copy(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    return t.to(dtype=dtype or t.dtype, copy=True, memory_format=torch.contiguous_format)


def _same(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`t` itself when it already is what `_copy` would make, else that copy."""
    if (dtype is None or t.dtype == dtype) and t.is_contiguous():
        return t
    return _copy(t, dtype)


def project(
    masters: Mapping[str, torch.Tensor],
    view: str | View,
    previous: Mapping[str, torch.Tensor] | None = None,
    *,
    copy: bool = True,
) -> dict[str, torch.Tensor]:
    """The served view of ``masters``; for fp8 and fp4, scales are pinned to ``previous``'s.

    With ``copy=False`` a master already in its served dtype (and contiguous) is the view's
    tensor itself, not a copy: for masters nobody changes afterwards (a checkpoint read from
    disk), never for a model that keeps training."""
    v = parse_view(view)
    keep = _copy if copy else _same
    out: dict[str, torch.Tensor] = {}
    fp4: dict[str, torch.Tensor] = {}  # projected together: nvfp4 fused layers share a scale
    for name, t in masters.items():
        if not t.is_floating_point():
            out[name] = keep(t)
        elif v.kind == "fp8-e4m3" and is_quantized_weight(name, t):
            sname = scale_name(name, v.granularity)
            prev = previous.get(sname) if previous is not None else None
            out[name], out[sname] = _quantize(t, v, prev)
        elif v.kind in FP4_KINDS and is_quantized_weight(name, t) and t.shape[1] % 2 == 0:
            fp4[name] = t
        else:
            out[name] = keep(t, _CAST.get(v.kind, torch.bfloat16))
    if fp4:
        out.update(project_fp4(fp4, v.kind, v.block, v.headroom, previous))
    return out


def dequantize(
    view_tensors: Mapping[str, torch.Tensor], view: str | View
) -> dict[str, torch.Tensor]:
    """float32 approximation of a view: code * scale for fp8 weights, float() for other floats.

    Scale tensors are dropped; non-floating tensors pass through (copied). For fp4 views each
    ``<m>.weight_packed`` (with its scales) becomes ``<m>.weight``.
    """
    v = parse_view(view)
    out: dict[str, torch.Tensor] = {}
    scales: set[str] = set()
    if v.kind in FP4_KINDS:
        out, scales = dequantize_fp4(view_tensors, v.kind, v.block)
    for name, t in view_tensors.items():
        if name in scales:
            continue
        if v.kind == "fp8-e4m3" and t.dtype == FP8_DTYPE:
            sname = scale_name(name, v.granularity)
            scale = view_tensors[sname].to(device=t.device, dtype=torch.float32)
            out[name] = t.to(torch.float32) * expand_scale(scale, t.shape, v)
            scales.add(sname)
        else:
            out[name] = _copy(t, torch.float32) if t.is_floating_point() else _copy(t)
    for sname in scales:
        out.pop(sname, None)
    return out


def _scale_names(view_tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """Names of the scale tensors of quantized weights in a view: float32 scales of fp8 weights;
    ``_scale`` (and ``_global_scale``) of fp4 ``_packed`` codes."""
    names = []
    for name, t in view_tensors.items():
        for suffix in ("_scale_inv", "_global_scale", "_scale"):
            if name.endswith(suffix):
                base = name.removesuffix(suffix)
                break
        else:
            continue
        w, packed = view_tensors.get(base), view_tensors.get(base + "_packed")
        if (t.dtype == torch.float32 and w is not None and w.dtype == FP8_DTYPE) or (
            packed is not None and packed.dtype == torch.uint8
        ):
            names.append(name)
    return names


def view_changed_scales(
    prev_view: Mapping[str, torch.Tensor], new_view: Mapping[str, torch.Tensor]
) -> dict[str, int]:
    """Per scale tensor of ``new_view``: how many entries differ bitwise from ``prev_view``.

    A scale that is new or changed shape or dtype counts every entry as changed.
    """
    changed: dict[str, int] = {}
    for name in _scale_names(new_view):
        new, old = new_view[name], prev_view.get(name)
        if old is None or old.shape != new.shape or old.dtype != new.dtype:
            changed[name] = new.numel()
            continue
        width = new.element_size()
        old_b = old.to(new.device).contiguous().view(torch.uint8).reshape(-1, width)
        new_b = new.contiguous().view(torch.uint8).reshape(-1, width)
        changed[name] = int((old_b != new_b).any(dim=1).sum())
    return changed
