"""FP4 served views: the E2M1 grid, nibble packing, and the ``mxfp4`` / ``nvfp4`` quantizers.

Element type (OCP Microscaling Formats (MX) v1.0, FP4 E2M1): a 4-bit code ``S EE M`` (sign,
2 exponent bits, 1 mantissa bit, exponent bias 1, no Inf/NaN) has the value
``(-1)^S * 2^(E-1) * (1 + M/2)`` for ``E > 0`` and ``(-1)^S * M/2`` for ``E == 0``: the
magnitudes of codes 0..7 are ``0, 0.5, 1, 1.5, 2, 3, 4, 6``. Encoding is round-to-nearest,
ties-to-even (to the code with ``M == 0``) with saturation to +-6; the sign bit is the input's
sign bit (``-0.1`` encodes as ``-0``, code 8), as an IEEE conversion and compressed-tensors'
``pack_fp4_to_uint8`` do.

Layout (compressed-tensors ``mxfp4-pack-quantized`` / ``nvfp4-pack-quantized``, as vLLM's
``CompressedTensorsW4A16Mxfp4`` / ``CompressedTensorsW4A16Fp4`` load it): a quantized weight
``<m>.weight`` of shape (rows, cols) becomes ``<m>.weight_packed``, uint8 (rows, cols/2), element
``2j`` in the low nibble and ``2j+1`` in the high nibble of byte ``j``; plus

* ``mxfp4``: ``<m>.weight_scale`` uint8 (rows, ceil(cols/32)), an E8M0 biased exponent
  (value ``2^(e-127)``, 255 = NaN, never written). ``w ~ e2m1(code) * 2^(e-127)``.
* ``nvfp4``: ``<m>.weight_scale`` float8_e4m3fn (rows, ceil(cols/16)) and
  ``<m>.weight_global_scale`` float32 (1,), stored as compressed-tensors stores it: the
  *reciprocal* of the dequantisation factor, ``w ~ e2m1(code) * (scale / global_scale)``.

Weights with an odd number of columns cannot be packed two codes per byte and stay bf16.

Scales, with ``h`` the view's headroom and amaxes in float32 (``TINY`` floors a zero amax):

* mxfp4, fresh: ``e = 127 + ceil(log2(amax * (1 + h) / 6))`` (clamped to 0..254): the smallest
  power of two under which the group does not clip. (The MX spec's example conversion uses
  ``floor(log2(amax)) - 2``, which may clip up to amax/scale < 8; any E8M0 value is loadable.)
* nvfp4, fresh: ``global_scale = 448 * 6 / (amax_tensor * (1 + h))``; block scale = the smallest
  E4M3 value >= ``amax_block * (1 + h) * global_scale / 6``, at most 448.

Pinning (``prev`` = the previous view's tensors of the same shapes): a group keeps its previous
scale unless that scale is unusable (E8M0 255; E4M3 zero/NaN) or a value would clip,
``amax / s > 6`` with ``s`` the group's dequantisation factor. The nvfp4 global scale is kept
(when finite and positive) unless some block would clip even at the largest block scale 448,
``amax_block / (448 / global_scale) > 6``; when it changes, every block scale is recomputed.
Weights that vLLM fuses into one layer (q/k/v, gate/up, MLA q_a/kv_a of one module) share one
global scale, as llm-compressor's ``update_fused_layer_weight_global_scales`` makes them (vLLM
applies one per fused layer): fresh, from the largest amax of the group; kept only when every
member holds the same usable previous one and no member's block would clip under it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F

from stitch_core.format.dtypes import true_div

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitudes of codes 0..7
FP4_MAX = 6.0
E4M3_MAX = 448.0
E8M0_BIAS, E8M0_NAN = 127, 255
MX_GROUP, NV_GROUP = 32, 16
TINY = 1e-12
FP4_KINDS = ("mxfp4", "nvfp4")
# projections vLLM loads as one fused layer, whose nvfp4 global scales must be equal
FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"),
         ("q_a_proj", "kv_a_proj_with_mqa"))
# |x| thresholds at which the code magnitude steps up; ``True`` means the tie itself steps up
# (the upper neighbour's code is even): 0.25->0, 0.75->1.0, 1.25->1.0, 1.75->2, 2.5->2, 3.5->4,
# 5->4.
_STEPS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True),
          (5.0, False))


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """uint8 E2M1 codes (0..15) of ``x`` (float32): round to nearest even, saturate at +-6."""
    a = x.abs()
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for t, tie_up in _STEPS:
        code += (a >= t) if tie_up else (a > t)
    return code | (torch.signbit(x).to(torch.uint8) << 3)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """float32 values of uint8 E2M1 codes (low 4 bits)."""
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    c = codes.to(torch.long)
    mag = lut[c & 7]
    return torch.where((c & 8).bool(), -mag, mag)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """(..., 2n) uint8 codes -> (..., n) bytes, element 2j in the low nibble of byte j."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous()


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_nibbles``."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


def fp4_names(weight_name: str) -> tuple[str, str, str]:
    """(packed codes, block scale, global scale) tensor names of ``<m>.weight``."""
    return weight_name + "_packed", weight_name + "_scale", weight_name + "_global_scale"


def _group_amax(a: torch.Tensor, group: int) -> torch.Tensor:
    rows, cols = a.shape
    ng = -(-cols // group)
    return F.pad(a, (0, ng * group - cols)).reshape(rows, ng, group).amax(dim=2)


def _expand(scale: torch.Tensor, cols: int, group: int) -> torch.Tensor:
    return scale.repeat_interleave(group, dim=1)[:, :cols]


def e8m0_value(e: torch.Tensor) -> torch.Tensor:
    """float32 ``2^(e - 127)`` of uint8 E8M0 exponents (255 gives NaN), built from bits: the
    float32 with exponent field ``e`` (``e = 0``: the subnormal 2^-127, bits 0x00400000)."""
    e32 = e.to(torch.int32)
    bits = torch.where(e32 == 0, torch.full_like(e32, 0x00400000), e32 << 23)
    bits = torch.where(e32 == E8M0_NAN, torch.full_like(e32, 0x7FC00000), bits)
    return bits.view(torch.float32)


def _ceil_log2(y: torch.Tensor) -> torch.Tensor:
    """Exact ceil(log2(y)) of positive finite float32 ``y`` (int32)."""
    m, k = torch.frexp(y)  # y = m * 2^k, m in [0.5, 1)
    return (k - (m == 0.5).to(k.dtype)).to(torch.int32)


def _e4m3_ceil(x: torch.Tensor) -> torch.Tensor:
    """The smallest float8_e4m3fn value >= ``x`` (x in (0, 448]), as float8_e4m3fn."""
    y = x.to(torch.float8_e4m3fn)
    low = y.to(torch.float32) < x
    bits = y.view(torch.uint8) + low.to(torch.uint8)  # positive: next code is the next value up
    return bits.view(torch.float8_e4m3fn)


def quantize_mxfp4(
    w: torch.Tensor, prev_scale: torch.Tensor | None = None, headroom: float = 1 / 32,
    group: int = MX_GROUP,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed codes, E8M0 scale) of a 2-D weight with an even number of columns."""
    w32 = w.to(torch.float32).contiguous()
    amax = _group_amax(w32.abs(), group)
    e = _ceil_log2(true_div(amax.clamp_min(TINY) * (1 + headroom), FP4_MAX)) + E8M0_BIAS
    scale = e.clamp(0, 254).to(torch.uint8)
    if prev_scale is not None and prev_scale.shape == scale.shape:
        prev = prev_scale.to(device=scale.device, dtype=torch.uint8)
        keep = (prev != E8M0_NAN) & (amax / e8m0_value(prev) <= FP4_MAX)
        scale = torch.where(keep, prev, scale)
    s = _expand(e8m0_value(scale), w32.shape[1], group)
    return pack_nibbles(e2m1_encode(w32 / s)), scale.contiguous()


def nvfp4_global(
    amaxes: Sequence[torch.Tensor], prevs: Sequence[torch.Tensor | None], headroom: float
) -> tuple[torch.Tensor, bool]:
    """(global scale, fresh?) shared by weights whose block amaxes are ``amaxes``: their common
    previous global scale when every one has the same usable one and no block would clip at block
    scale 448 under it, else ``448 * 6 / (max amax * (1 + h))``."""
    p0 = prevs[0]
    if p0 is not None and p0.shape == (1,) and all(
        p is not None and p.shape == (1,) and torch.equal(p.view(torch.int32), p0.view(torch.int32))
        for p in prevs
    ):
        g = p0.to(device=amaxes[0].device, dtype=torch.float32)
        if bool(torch.isfinite(g).all() and (g > 0).all()) and all(
            bool((a / torch.div(g.new_tensor(E4M3_MAX), g) <= FP4_MAX).all()) for a in amaxes
        ):
            return g, False
    amax = torch.stack([a.amax() for a in amaxes]).amax().clamp_min(TINY)
    # a true division (``float / tensor`` would multiply by a rounded reciprocal)
    return torch.div(amax.new_tensor(E4M3_MAX * FP4_MAX), amax * (1 + headroom)).reshape(1), True


def _nvfp4_codes(
    w32: torch.Tensor, amax: torch.Tensor, g: torch.Tensor, fresh_global: bool,
    prev_scale: torch.Tensor | None, headroom: float, group: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    need = true_div(amax.clamp_min(TINY) * (1 + headroom) * g, FP4_MAX).clamp(max=E4M3_MAX)
    scale = _e4m3_ceil(need)
    if not fresh_global and prev_scale is not None and prev_scale.shape == scale.shape:
        p32 = prev_scale.to(device=scale.device, dtype=torch.float8_e4m3fn).to(torch.float32)
        keep = (p32 > 0) & torch.isfinite(p32) & (amax / (p32 / g) <= FP4_MAX)
        scale = torch.where(keep, p32, scale.to(torch.float32)).to(torch.float8_e4m3fn)
    s = _expand(scale.to(torch.float32) / g, w32.shape[1], group)
    return pack_nibbles(e2m1_encode(w32 / s)), scale.contiguous()


def quantize_nvfp4(
    w: torch.Tensor, prev_scale: torch.Tensor | None = None,
    prev_global: torch.Tensor | None = None, headroom: float = 1 / 32, group: int = NV_GROUP,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed codes, E4M3 block scale, float32 global scale) of one 2-D weight (even columns)
    with a global scale of its own."""
    w32 = w.to(torch.float32).contiguous()
    amax = _group_amax(w32.abs(), group)
    g, fresh = nvfp4_global([amax], [prev_global], headroom)
    packed, scale = _nvfp4_codes(w32, amax, g, fresh, prev_scale, headroom, group)
    return packed, scale, g.contiguous()


def fused_key(name: str) -> str:
    """Weights vLLM fuses into one layer (q/k/v, gate/up, MLA q_a/kv_a) share a key; others
    have their own name as key."""
    for members in FUSED:
        for m in members:
            if name.endswith(f".{m}.weight"):
                return name.removesuffix(f"{m}.weight") + "+".join(members)
    return name


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor, group: int = MX_GROUP):
    """float32 ``e2m1(code) * 2^(e - 127)``."""
    vals = e2m1_decode(unpack_nibbles(packed))
    return vals * _expand(e8m0_value(scale.to(packed.device)), vals.shape[1], group)


def dequantize_nvfp4(packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
                     group: int = NV_GROUP) -> torch.Tensor:
    """float32 ``e2m1(code) * (scale / global_scale)``."""
    vals = e2m1_decode(unpack_nibbles(packed))
    s = scale.to(packed.device).to(torch.float32) / global_scale.to(packed.device, torch.float32)
    return vals * _expand(s, vals.shape[1], group)


def project_fp4(weights: Mapping[str, torch.Tensor], kind: str, group: int, headroom: float,
                previous: Mapping[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
    """The view tensors of the quantized weights ``weights`` (kind ``mxfp4`` or ``nvfp4``);
    nvfp4 weights with the same ``fused_key`` share one global scale."""
    prev = previous or {}
    out: dict[str, torch.Tensor] = {}
    if kind == "mxfp4":
        for name, t in weights.items():
            pname, sname, _ = fp4_names(name)
            out[pname], out[sname] = quantize_mxfp4(t, prev.get(sname), headroom, group)
        return out
    fused: dict[str, list[str]] = {}
    for name in weights:
        fused.setdefault(fused_key(name), []).append(name)
    for names in fused.values():
        w32 = {n: weights[n].to(torch.float32).contiguous() for n in names}
        amax = {n: _group_amax(w32[n].abs(), group) for n in names}
        g, fresh = nvfp4_global([amax[n] for n in names],
                                [prev.get(fp4_names(n)[2]) for n in names], headroom)
        for n in names:
            pname, sname, gname = fp4_names(n)
            out[pname], out[sname] = _nvfp4_codes(w32[n], amax[n], g, fresh, prev.get(sname),
                                                  headroom, group)
            out[gname] = g.clone()
    return out


def dequantize_fp4(view_tensors: Mapping[str, torch.Tensor], kind: str,
                   group: int) -> tuple[dict[str, torch.Tensor], set[str]]:
    """(``<m>.weight`` as float32 for every uint8 ``<m>.weight_packed`` of an FP4 view, the
    names of the view tensors those were made from)."""
    out: dict[str, torch.Tensor] = {}
    used: set[str] = set()
    for name, t in view_tensors.items():
        if not name.endswith(".weight_packed") or t.dtype != torch.uint8:
            continue
        wname = name.removesuffix("_packed")
        _, sname, gname = fp4_names(wname)
        if kind == "mxfp4":
            out[wname] = dequantize_mxfp4(t, view_tensors[sname], group)
            used |= {name, sname}
        else:
            out[wname] = dequantize_nvfp4(t, view_tensors[sname], view_tensors[gname], group)
            used |= {name, sname, gname}
    return out, used
