"""The push-vs-floor estimate: which served elements a master update should change.

An element is predicted to change when its master update is larger than half a ULP of its served
value (in code units times the block scale for fp8). It ignores where the master sits inside its
rounding interval, so it misses the small updates that happen to cross a nearby boundary;
``expected`` = mean(min(1, |update| / ULP)) is the fraction for masters placed uniformly in their
interval.

Masters are often far from uniform in their interval: a fine-tune that starts from a bf16
checkpoint starts with every master exactly on the served grid (offset 0), and at small learning
rates the offsets spread only slowly, so ``expected`` overcounts (about 2x on such starts, see
docs/analyze.md). ``expected_offsets`` uses the masters' actual offsets inside their rounding
interval, o = (master - served) / ULP in [-1/2, 1/2], pooled per tensor into a histogram (plus
the mass exactly on the grid), assumes them independent of the update x = update / ULP and sums
P(|o + x| > 1/2) over the elements.
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

OFFSET_BINS = 64
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


# ---------------------------------------------------------------- offset-aware estimate


def offsets(master: torch.Tensor, served: torch.Tensor) -> torch.Tensor:
    """Position of each master in its rounding interval, (master - served) / ULP(served): in
    [-1/2, 1/2] for a master that rounds to `served` (both in the same units: code units for fp8).
    0 = on the served grid; uniform placement gives a uniform distribution."""
    s = served.float()
    return (master.float() - s) / ulp(s, served.dtype)


def offset_histogram(
    o: torch.Tensor, x: torch.Tensor | None = None, bins: int = OFFSET_BINS
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pooled distribution of offsets `o`: (p0, cdf), p0 the fraction exactly 0 (on the grid) and
    cdf the CDF of the others at the `bins` + 1 edges of [-1/2, 1/2] (linear in between).

    With the updates `x` (in ULPs), the offsets are signed along the update (o * sign(x)) and
    pooled per octave of |x| (`_octave`): p0 and cdf gain a leading octave dimension. Without x:
    one pool, p0 of shape (1,), cdf (1, bins + 1)."""
    o = o.reshape(-1).float().clamp(-0.5, 0.5)
    if x is None:
        k, n_k = torch.zeros(o.shape, dtype=torch.long), 1
    else:
        x = x.reshape(-1).float()
        o = torch.where(x < 0, -o, o)
        k, n_k = _octave(x), OCTAVES
    on_grid = o == 0
    p0 = torch.bincount(k[on_grid], minlength=n_k).float()
    ob = ((o + 0.5) * bins).long().clamp(0, bins - 1)
    h = torch.bincount((k * bins + ob)[~on_grid], minlength=n_k * bins).float()
    h = h.reshape(n_k, bins)
    rest = h.sum(1, keepdim=True)
    total = (rest.squeeze(1) + p0).clamp_min(1)
    cdf = torch.where(rest > 0, torch.cat([torch.zeros(n_k, 1), h.cumsum(1)], 1)
                      / rest.clamp_min(1), torch.linspace(0, 1, bins + 1))
    return p0 / total, cdf


OCTAVES = 20  # |x| in [2^-k-1, 2^-k) for k = 0..18 (|x| >= 1 in octave 0), else (and 0) last


def _octave(x: torch.Tensor) -> torch.Tensor:
    _, e = torch.frexp(x.abs())  # |x| in [2^(e-1), 2^e)
    k = (-e).clamp(0, OCTAVES - 1)
    return torch.where(x == 0, OCTAVES - 1, k).long()


def crossing_probability(
    x: torch.Tensor, hist: tuple[torch.Tensor, torch.Tensor], pool_x: torch.Tensor | None = None
) -> torch.Tensor:
    """P(|o + x| > 1/2) per element, for an update `x` in ULPs (signed) and an offset o drawn
    from `hist` (`offset_histogram`). A histogram made with updates is looked up at the octave
    of `pool_x` (default `x`) with o signed along x."""
    p0, cdf = hist
    x = x.float().reshape(-1)
    if cdf.shape[0] == 1:
        k, sx = torch.zeros(x.shape, dtype=torch.long), x
    else:
        k = _octave(x if pool_x is None else pool_x.reshape(-1))
        sx = x.abs()  # o is signed along x
    bins = cdf.shape[1] - 1

    def f(t: torch.Tensor) -> torch.Tensor:
        pos = (t.clamp(-0.5, 0.5) + 0.5) * bins
        i = pos.floor().clamp(0, bins - 1).long()
        lo = cdf[k, i]
        return lo + (pos - i) * (cdf[k, i + 1] - lo)

    rest = (1 - f(0.5 - sx) + f(-0.5 - sx)).clamp(0, 1)
    q = p0[k]
    return q * (x.abs() > 0.5).float() + (1 - q) * rest


def expected_offsets(
    old: torch.Tensor, new: torch.Tensor, served: torch.Tensor, scale: float = 1.0,
    signed: bool = True, bins: int = OFFSET_BINS,
) -> float:
    """Expected number of changed served elements of one tensor, offset-aware: the offsets of the
    masters `old` in their intervals around `served`, pooled per tensor (`signed`: signed along
    the update and per octave of |update|, see `offset_histogram`; else one pool, independent of
    the update), the updates `new - old` in ULPs. `scale` multiplies the updates: an estimate
    for another learning rate (lr_new / lr) from one step at this one, keeping this step's
    offset distribution (which itself depends on the lr history: extrapolate only nearby)."""
    u = ulp(served.float(), served.dtype)
    x = (new.float() - old.float()) / u
    hist = offset_histogram(offsets(old, served), x if signed else None, bins)
    return float(crossing_probability(x * scale, hist, pool_x=x).sum())


def predict_offsets(
    name: str, old: torch.Tensor, new: torch.Tensor, prev_view: dict[str, torch.Tensor], v: View
) -> dict[str, float]:
    """`expected_offsets` per served tensor of one master, in the units of `predict`. fp8 views:
    in code units (divided by the block scale); scale entries as in `predict`. FP4 views have no
    offset-aware estimate: the uniform one (`predict`'s expected) is returned."""
    if name not in prev_view and fp4_names(name)[0] in prev_view:
        return {n: e for n, (_, e) in _predict_fp4(
            name, (new.float() - old.float()).abs(), new, prev_view, v).items()}
    served = prev_view[name]
    out: dict[str, float] = {}
    if served.dtype == FP8_DTYPE:
        sname = scale_name(name, v.granularity)
        scale = prev_view[sname]
        s = expand_scale(scale, served.shape, v)
        amax = group_amax(new.float().abs(), v)
        moved = ~((scale > 0) & scale.isfinite() & (amax / scale <= FP8_MAX))
        out[sname] = float(moved.sum())
        old, new = old.float() / s, new.float() / s
    out[name] = expected_offsets(old, new, served)
    return out
