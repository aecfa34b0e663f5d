"""The push-vs-floor estimate: which served elements a master update should change.

An element is predicted to change when its master update is larger than half a ULP of its served
value (in code units times the block scale for fp8). It ignores where the master sits inside its
rounding interval, so it misses the small updates that happen to cross a nearby boundary;
``expected`` = mean(min(1, |update| / ULP)) is the fraction for masters placed uniformly in their
interval.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from stitch_core.format.fp4 import (
    MX_GROUP,
    NV_GROUP,
    e2m1_decode,
    e8m0_value,
    fp4_names,
    unpack_nibbles,
)
from stitch_core.format.views import (
    FP8_DTYPE,
    FP8_MAX,
    View,
    expand_scale,
    group_amax,
    scale_name,
)

RULE = "predicted: |update| > half a ULP of the served value (heuristic)"


def ulp(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Spacing of `dtype` at each value (float32): eps * 2^(e-1) for |x| in [2^(e-1), 2^e)."""
    fi = torch.finfo(dtype)
    emin = round(math.log2(fi.tiny)) + 1
    _, e = torch.frexp(values.abs())
    e = torch.where(values == 0, emin, e).clamp_min(emin)
    return torch.ldexp(torch.full(values.shape, fi.eps, device=values.device), e - 1)


def predict(
    name: str, old: torch.Tensor, new: torch.Tensor, prev_view: dict[str, torch.Tensor], v: View
) -> dict[str, tuple[int, float]]:
    """Push-vs-floor per served tensor of one master: (predicted count, expected count)."""
    delta = (new.float() - old.float()).abs()
    if name not in prev_view and fp4_names(name)[0] in prev_view:
        return _predict_fp4(name, delta, new, prev_view, v)
    served = prev_view[name]
    out: dict[str, tuple[int, float]] = {}
    if served.dtype == FP8_DTYPE:
        sname = scale_name(name, v.granularity)
        scale = prev_view[sname]
        delta = delta / expand_scale(scale, served.shape, v)
        amax = group_amax(new.float().abs(), v)  # a scale moves only when its group would clip
        moved = ~((scale > 0) & scale.isfinite() & (amax / scale <= FP8_MAX))
        out[sname] = (int(moved.sum()), float(moved.sum()))
    u = ulp(served.float(), served.dtype)
    out[name] = (int((delta > u / 2).sum()), float((delta / u).clamp(max=1).sum()))
    return out


def _predict_fp4(name: str, delta: torch.Tensor, new: torch.Tensor,
                 prev_view: dict[str, torch.Tensor], v: View) -> dict[str, tuple[int, float]]:
    """FP4 views: the same rule in E2M1 code units (grid spacing 0.5 below 2, 1 below 4, 2
    above), counted per packed byte (a byte changes when either of its two codes does)."""
    packed_n, scale_n, global_n = fp4_names(name)
    codes = e2m1_decode(unpack_nibbles(prev_view[packed_n])).abs()
    if v.kind == "mxfp4":
        group, s = MX_GROUP, e8m0_value(prev_view[scale_n])
    else:
        group = NV_GROUP
        s = prev_view[scale_n].float() / prev_view[global_n].float()
    cols = codes.shape[1]
    amax = F.pad(new.float().abs(), (0, -(-cols // group) * group - cols))
    amax = amax.reshape(codes.shape[0], -1, group).amax(dim=2)
    moved = ~(s.isfinite() & (s > 0) & (amax / s <= 6))
    d = delta / s.repeat_interleave(group, dim=1)[:, :cols]
    u = torch.where(codes < 2, 0.5, torch.where(codes < 4, 1.0, 2.0))
    hit, p = (d > u / 2), (d / u).clamp(max=1)
    byte_hit = hit[:, 0::2] | hit[:, 1::2]
    byte_p = 1 - (1 - p[:, 0::2]) * (1 - p[:, 1::2])
    return {packed_n: (int(byte_hit.sum()), float(byte_p.sum())),
            scale_n: (int(moved.sum()), float(moved.sum()))}
