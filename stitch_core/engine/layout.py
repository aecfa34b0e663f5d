"""Layout maps: where each element of a served-view (HF) tensor lives in an engine's parameters.

Size: about 430 lines, one job: learning where each served-view element lives in an engine's
parameters. Learning the map (the integer shadows) and its run encoding are one algorithm; the
shadows' memory pool and the numba scan that reads them live in `layout_scan`, the loads that fill
them in `layout_load`.

A Stitch patch addresses the *served view*: HF tensor names, flat positions in HF shape, new bits.
Engines store weights differently: q/k/v fused into one ``qkv_proj``, gate/up into
``gate_up_proj``, vocab rows padded, every linear sharded over tensor-parallel ranks. Rather than
re-deriving those rules per architecture and engine, we let the model's *own* ``load_weights``
tell us: each engine parameter's ``.data`` is temporarily swapped for an integer shadow filled with
-1 (int32 when the group's indices fit, else int64), and the model loads index tensors in HF
shape (offset by a per-tensor base, so one load can carry several tensors); on a rank that holds
a shard, each HF element's row id in one load and its column id in a second, as zero-memory
expanded views, so the rank allocates nothing of a tensor's full size (`layout_load`). Whatever
the loaders narrow / concatenate / pad, each shadow element ends up holding
``base[t] + hf_flat_pos`` of the HF element it came from (0 where a loader wrote a constant, e.g.
zeroed vocab padding; -1 where nothing was written). That gives, per rank, an exact map HF
position -> (engine param, flat position), stored compactly as runs.

Engine-agnostic: vLLM and SGLang models both expose ``load_weights(iterable of (name, tensor))``.
An engine adapter whose kernels read a private repacked copy of a weight (vLLM's CPU backend:
packed linear layers, pre-packed MoE experts) keeps the canonical tensors on the module as
``_stitch_masters`` ({attribute name: tensor}); ``engine_params`` and ``MastersInstalled`` use them
instead of the packed parameters.

A loader that transforms values instead of placing them yields a map that does not reproduce the
engine's weights; the coordinator detects that at start-up with fingerprints
(``stitch_core.engine.coordinator``) and refuses to follow, naming the tensor, unless the loader
fallback is opted into (``STITCH_LOADER_FALLBACK=1``: that tensor is then updated, unverified,
through the engine's own loader)."""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from stitch_core._jit import numba
from stitch_core.engine import layout_load, layout_template
from stitch_core.engine.layout_scan import IndexPool, scan_shadows
from stitch_core.engine.model_state import NOT_RESTORED, TensorState

__all__ = [
    "Segment",
    "TensorMap",
    "Layout",
    "read_safetensors_shapes",
    "engine_params",
    "learn_layout",
    "MastersInstalled",
]

_ST_DTYPES = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32,
    "F64": torch.float64, "I64": torch.int64, "I32": torch.int32,
    "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# largest index value learned with int32 index tensors and shadows (a group past it uses int64)
INT32_INDEX_MAX = int(np.iinfo(np.int32).max)
_LAYER_RE = re.compile(r"\.layers\.(\d+)\.")


# --------------------------------------------------------------------------- #
# Checkpoint header reading (no tensor data is loaded)
# --------------------------------------------------------------------------- #
def read_safetensors_shapes(model_dir) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """{hf_name: (shape, dtype)} from every ``*.safetensors`` header in ``model_dir``."""
    out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    for f in files:
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            out[name] = (tuple(meta["shape"]), _ST_DTYPES[meta["dtype"]])
    return out


# --------------------------------------------------------------------------- #
# Layout data structures
# --------------------------------------------------------------------------- #
@dataclass
class Segment:
    """Non-overlapping runs from one HF tensor into one engine parameter.

    Run i maps HF flat positions ``[hf_start[i], hf_start[i]+length[i])`` to
    engine flat positions ``[eng_start[i], ...)``.  ``hf_start`` is sorted.  If
    a loader writes one HF element to several places of the same parameter,
    there is one Segment per copy.
    """

    param: str
    hf_start: np.ndarray
    eng_start: np.ndarray
    length: np.ndarray

    @property
    def n_elems(self) -> int:
        return int(self.length.sum())

    def locate(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(mask into ``pos`` of positions this segment holds, their engine positions)."""
        p = pos.detach().cpu().to(torch.int64).numpy()
        ok = np.empty(len(p), dtype=np.bool_)
        eng = np.empty(len(p), dtype=np.int64)
        n = _locate(self.hf_start, self.eng_start, self.length, p, ok, eng)
        return torch.from_numpy(ok), torch.from_numpy(eng[:n])


def in_range(pos: np.ndarray, n: int) -> bool:
    """Whether every position is in ``[0, n)``: one pass (a `min` and a `max` are two)."""
    return bool(_in_range(np.ascontiguousarray(pos, dtype=np.int64), n))


@numba.njit(cache=True, nogil=True)
def _in_range(pos, n) -> bool:
    for i in range(pos.shape[0]):  # noqa: SIM110 - numba compiles no generator for all()
        if pos[i] < 0 or pos[i] >= n:
            return False
    return True


@numba.njit(cache=True, nogil=True)
def _locate(hf_start, eng_start, length, pos, ok, eng) -> int:
    """For each HF position: is it in a run, and where in the engine. One pass; sorted positions
    (what patches carry) walk the runs, others binary-search them. Returns the count held."""
    r = hf_start.shape[0]
    n = 0
    j = -1
    for i in range(pos.shape[0]):
        p = pos[i]
        if not (j >= 0 and hf_start[j] <= p and (j + 1 == r or p < hf_start[j + 1])):
            if j + 1 < r and hf_start[j + 1] <= p and (j + 2 >= r or p < hf_start[j + 2]):
                j += 1
            else:
                j = np.searchsorted(hf_start, p, side="right") - 1
        if j >= 0 and p < hf_start[j] + length[j]:
            ok[i] = True
            eng[n] = eng_start[j] + (p - hf_start[j])
            n += 1
        else:
            ok[i] = False
    return n


@dataclass
class TensorMap:
    """Where one HF tensor (name, shape, dtype) lives on this rank: its `segments`."""

    hf_name: str
    hf_shape: tuple[int, ...]
    hf_dtype: torch.dtype
    segments: list[Segment] = field(default_factory=list)

    @property
    def hf_numel(self) -> int:
        return int(np.prod(self.hf_shape, dtype=np.int64))


@dataclass
class Layout:
    """Per-rank map from HF tensors to engine parameters."""

    tensors: dict[str, TensorMap]
    param_shapes: dict[str, tuple[int, ...]]
    param_dtypes: dict[str, torch.dtype]
    # engine elements written with a constant (e.g. vocab padding) / never written
    param_const: dict[str, int]
    param_unwritten: dict[str, int]
    rank_info: dict[str, Any] = field(default_factory=dict)
    # layer groups whose map was taken from a learned twin layer (`layout_template`), not loaded
    templated: int = 0
    # how this layout was learned (not kept in the layout cache): the groups loaded with the
    # full HF-shaped index (`layout_load`; the others: row and column ids), and the most bytes
    # of shadows and index tensors learning held at once
    full_index_groups: list[str] = field(default_factory=list)
    learn_bytes: int = 0

    def derived(self) -> list[str]:
        """Engine params no loader writes a single element of: computed from other weights after
        loading (vLLM's MLA ``W_UK_T``/``W_UV`` from ``kv_b_proj``) or never loaded. A patch
        cannot keep them in step with the weights they come from."""
        return sorted(p for p, n in self.param_unwritten.items()
                      if n and n == int(np.prod(self.param_shapes[p], dtype=np.int64)))

    def summary(self) -> dict[str, Any]:
        """Small picklable description (for collective_rpc replies / logs)."""
        per_param: dict[str, dict[str, Any]] = {}
        for p, shape in self.param_shapes.items():
            per_param[p] = {"shape": list(shape), "dtype": str(self.param_dtypes[p]),
                            "mapped": 0, "runs": 0, "sources": [],
                            "const": self.param_const.get(p, 0),
                            "unwritten": self.param_unwritten.get(p, 0)}
        for t in self.tensors.values():
            for s in t.segments:
                d = per_param[s.param]
                d["mapped"] += s.n_elems
                d["runs"] += len(s.length)
                d["sources"].append(t.hf_name)
        return {"rank": self.rank_info, "params": per_param,
                "hf_mapped": {n: sum(s.n_elems for s in t.segments)
                              for n, t in self.tensors.items()}}


# --------------------------------------------------------------------------- #
# Engine parameters (with kept CPU masters substituted)
# --------------------------------------------------------------------------- #
def engine_params(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """Canonical engine params; a packed layer's kept masters replace its packed params, and
    parameters that only hold a derived copy (``stitch_core.engine.derived`` holders, e.g. the
    scales an online quantizer computes from a bf16 master) are not weights of their own, nor
    are those an adapter names in a module's ``_stitch_constants`` (engine defaults that no
    checkpoint tensor supplies, e.g. SGLang's KV-cache scales of a checkpoint without any)."""
    out: dict[str, torch.nn.Parameter] = {}
    for mod_name, mod in model.named_modules():
        masters = getattr(mod, "_stitch_masters", None) or {}
        held = getattr(getattr(mod, "_stitch_derived", None), "holders", ())
        consts = getattr(mod, "_stitch_constants", ())  # engine defaults no checkpoint supplies
        for pname, p in mod.named_parameters(recurse=False):
            if (pname in held and pname not in masters) or pname in consts:
                continue
            full = f"{mod_name}.{pname}" if mod_name else pname
            out.setdefault(full, masters.get(pname, p))
    # drop aliases (tied weights) keeping the first name, like named_parameters()
    seen: dict[int, str] = {}
    canon: dict[str, torch.nn.Parameter] = {}
    for n, p in out.items():
        if id(p) in seen:
            continue
        seen[id(p)] = n
        canon[n] = p
    return canon


class MastersInstalled:
    """Temporarily put kept master tensors back on their layers (for the model's loaders)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.swapped: list[tuple[torch.nn.Module, str, Any]] = []

    def __enter__(self):
        for mod in self.model.modules():
            for attr, master in (getattr(mod, "_stitch_masters", None) or {}).items():
                if mod._parameters.get(attr) is not master:
                    self.swapped.append((mod, attr, mod._parameters.get(attr)))
                    mod._parameters[attr] = master
        return self

    def __exit__(self, *exc):
        for mod, attr, packed in reversed(self.swapped):
            mod._parameters[attr] = packed
        return False


def _group_key(name: str) -> str:
    m = _LAYER_RE.search(name)
    return f"layer{int(m.group(1)):06d}" if m else "rest"


# --------------------------------------------------------------------------- #
# Learning the layout
# --------------------------------------------------------------------------- #
def learn_layout(
    model: torch.nn.Module,
    hf_shapes: Mapping[str, tuple[tuple[int, ...], torch.dtype] | tuple[int, ...]],
    *,
    group_by_layer: bool = True,
    shadow_device: str | torch.device = "cpu",
    rank_info: dict[str, Any] | None = None,
    not_state: Collection[str] = (),
    templates: bool = True,
    split_index: bool | None = None,
) -> Layout:
    """Learn the HF -> engine map by loading index tensors with the model's own loaders.

    Must run while the engine is idle (between steps): engine ``.data`` is
    swapped out during the call and restored afterwards.  Groups (one per
    decoder layer plus "rest") bound the integer shadow memory to one layer at a
    time; a loader that writes outside its group raises (the engine should then
    be reloaded, its weights are no longer trusted). `not_state`: attribute names the engine
    adapter knows no loader writes (its KV cache), left out of the check on the model's other
    tensors (`TensorState`). `split_index`: load each group as row and column ids (two
    shadows of the rank's own elements) rather than the full HF-shaped index (the group's whole
    HF size); default: where that holds less memory, i.e. where the rank holds a shard of the
    group (`layout_load`). A group whose split load fails is loaded with the full index.
    """
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for n, v in hf_shapes.items():
        if len(v) == 2 and isinstance(v[1], torch.dtype):
            shapes[n] = (tuple(v[0]), v[1])
        else:
            shapes[n] = (tuple(v), torch.bfloat16)

    state = TensorState(model, not_state)
    try:
        with MastersInstalled(model):
            params = engine_params(model)
            key = _group_key if group_by_layer else (lambda n: "all")
            # the largest group first: the pool's buffers are allocated (and their pages
            # touched) once, at that size
            size: dict[str, int] = {}
            for n, (shp, _) in shapes.items():
                size[key(n)] = size.get(key(n), 0) + int(np.prod(shp, dtype=np.int64))
            groups = sorted(size, key=lambda g: (-size[g], g))
            pool = IndexPool()
            tensors = {n: TensorMap(n, s, d) for n, (s, d) in shapes.items()}
            const: dict[str, int] = {}
            unwritten: dict[str, int] = {n: int(p.numel()) for n, p in params.items()}
            owners = layout_template.param_owners(model) if templates else {}
            learned: dict[tuple, tuple[list[str], list[str]]] = {}  # signature -> its group
            n_templated = 0
            full_groups: list[str] = []

            for g in groups:
                g_hf = [n for n in shapes if key(n) == g]
                g_params = {n: p for n, p in params.items() if key(n) == g}
                sig = (layout_template.signature({n: shapes[n] for n in g_hf}, g_params, owners)
                       if templates and g.startswith("layer") else None)
                if sig is not None and sig in learned:
                    layout_template.derive(tensors, const, unwritten, *learned[sig], g_hf,
                                           list(g_params))
                    n_templated += 1
                    continue
                bases = layout_load.starts(
                    [int(np.prod(shapes[n][0], dtype=np.int64)) for n in g_hf])
                # int32 indices where the group's values fit: half the transient memory of the
                # shadows (and of the full index, when a group is loaded with it)
                idx_dtype = torch.int32 if bases[-1] <= INT32_INDEX_MAX else torch.int64
                shadows, loaded_sets, how = layout_load.load_group(
                    model, g, g_hf, shapes, g_params, pool, shadow_device, idx_dtype, bases,
                    split=split_index)
                if how == "full":
                    full_groups.append(g)
                for loaded in loaded_sets:
                    if not isinstance(loaded, set):
                        continue
                    # names the loaders reported as loaded must all have been shadowed
                    outside = {ln for ln in loaded if ln in params and ln not in g_params}
                    if outside:
                        raise RuntimeError(
                            f"layout learning for group {g!r} loaded params outside the group "
                            f"{sorted(outside)[:5]}: their engine data now holds index values; "
                            "reload the engine weights")

                for pn, scanned in scan_shadows(shadows, bases).items():
                    n_const, n_unwritten, n_foreign, tid, hf_start, eng_start, length = scanned
                    if n_foreign:
                        raise RuntimeError(
                            f"layout learning: {n_foreign} elements of {pn} hold values no index "
                            "tensor of its group carries (a loader that computes with the values?)")
                    const[pn], unwritten[pn] = int(n_const), int(n_unwritten)
                    for t in np.unique(tid):
                        sel = tid == t
                        tensors[g_hf[t]].segments.extend(
                            _segments(pn, hf_start[sel], eng_start[sel], length[sel]))
                shadows.clear()
                if sig is not None:
                    learned[sig] = (g_hf, list(g_params))

    finally:  # also when a loader raised: the engine keeps its own state
        touched = state.restore()
    if touched:
        # a loader derived state from the values it loaded (e.g. a post-load step run inside
        # load_weights): a patch could not keep that state in step with the weights
        lost = [t for t in touched if t.endswith(NOT_RESTORED)]
        raise RuntimeError(
            f"layout learning: the model's loaders changed {len(touched)} buffers or tensor "
            f"attributes that are not parameters ({', '.join(touched[:5])}"
            f"{' ...' if len(touched) > 5 else ''}; "
            f"{'put back' if not lost else f'{len(lost)} not put back: reload the engine'}): "
            "state derived from the weights cannot be followed by patches")

    return Layout(
        tensors=tensors,
        param_shapes={n: tuple(p.shape) for n, p in params.items()},
        param_dtypes={n: p.dtype for n, p in params.items()},
        param_const=const,
        param_unwritten=unwritten,
        rank_info=dict(rank_info or {}),
        templated=n_templated,
        full_index_groups=full_groups,
        learn_bytes=pool.nbytes_peak,
    )


def _segments(param: str, hf_start: np.ndarray, eng_start: np.ndarray,
              length: np.ndarray) -> list[Segment]:
    """Runs of one HF tensor in one param -> Segments with non-overlapping HF ranges, sorted by
    HF start (a loader that writes an element to several places of the param yields one
    Segment per copy: runs go to the first Segment they do not overlap)."""
    order = np.lexsort((eng_start, hf_start))
    hf_start, eng_start, length = hf_start[order], eng_start[order], length[order]
    hf_end = hf_start + length
    if len(hf_start) < 2 or not np.any(hf_start[1:] < np.maximum.accumulate(hf_end)[:-1]):
        return [Segment(param, hf_start, eng_start, length)]
    groups: list[list[int]] = []
    ends: list[int] = []
    for i in range(len(hf_start)):  # rare (duplicated elements): a short loop over runs
        for g, e in enumerate(ends):
            if hf_start[i] >= e:
                groups[g].append(i)
                ends[g] = int(hf_end[i])
                break
        else:
            groups.append([i])
            ends.append(int(hf_end[i]))
    return [Segment(param, hf_start[g], eng_start[g], length[g]) for g in map(np.array, groups)]
