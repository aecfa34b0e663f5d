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
    served = prev_view[name]
    delta = (new.float() - old.float()).abs()
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
