"""Layer templates: a decoder layer's map taken from a learned twin layer, not loaded again.

One job, about 95 lines. Layout learning (`stitch_core.engine.layout.learn_layout`) loads index
tensors through the model's loaders one group at a time: one group per decoder layer, plus the
rest. The layers of a model are usually instances of one module class with the same parameters,
the same loaders and the same checkpoint tensors, and then their maps are the same run arrays
under other names. Learning one such layer and renaming its map for its twins costs nothing,
where loading every layer costs about as much as the engine's own weight loading (at Qwen2.5-0.5B
shapes, 57% of the elements are in the layers; at Qwen2.5-7B, 86%): `benchmarks/startup.py`.

A layer is a twin of a learned one when everything a loader's placement can depend on, bar the
layer number, is equal (the `signature`): the checkpoint tensors' names, shapes and dtypes; the
engine parameters' names, shapes, dtypes and devices; the class of the module that owns each
parameter; and the parameter's `weight_loader` (vLLM's and SGLang's per-parameter loaders, by
qualified name). Names are compared with the layer number replaced by ``*``. A layer that
differs in any of these (a dense layer among MoE layers, a sliding-window layer with other
shapes, a layer another quantization method serves) is learned through the loaders.

Never trusted for correctness, like the layout cache: the start-up proof checks every tensor
through the map against the manifest's fingerprints, and a rank whose map was templated and does
not prove is learned again through every loader (`stitch_core.engine.proof`). What the proof
cannot see is a wrong map that only permutes equal values (a constant tensor); a loader that
places a layer's elements by its layer number while every part of the signature is equal would
be such a case. `STITCH_LAYOUT_TEMPLATES=0` learns every layer through the loaders.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["pattern", "param_owners", "signature", "derive"]

_LAYER_RE = re.compile(r"\.layers\.\d+\.")


def pattern(name: str) -> str:
    """The name with its (first) layer number replaced by ``*``."""
    return _LAYER_RE.sub(".layers.*.", name, count=1)


def param_owners(model: torch.nn.Module) -> dict[str, str]:
    """{full parameter name: qualified class name of the module that owns it}."""
    out: dict[str, str] = {}
    for mod_name, mod in model.named_modules():
        cls = f"{type(mod).__module__}.{type(mod).__qualname__}"
        for pname, _ in mod.named_parameters(recurse=False):
            out.setdefault(f"{mod_name}.{pname}" if mod_name else pname, cls)
    return out


def _loader_id(p: Any) -> str:
    f = getattr(p, "weight_loader", None)
    while isinstance(f, functools.partial):
        f = f.func
    if f is None:
        return ""
    fn = getattr(f, "__func__", f)  # a bound method: the function it binds
    return f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', type(fn).__qualname__)}"


def signature(hf: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
              params: Mapping[str, torch.Tensor], owners: Mapping[str, str]) -> tuple | None:
    """What a layer group's map can depend on, its layer number left out; None when the group
    cannot be templated (a name without a layer number, or two names with one pattern)."""
    h = sorted((pattern(n), tuple(s), str(d)) for n, (s, d) in hf.items())
    p = sorted((pattern(n), tuple(t.shape), str(t.dtype), str(t.device), owners.get(n, ""),
                _loader_id(t)) for n, t in params.items())
    for names in ([x[0] for x in h], [x[0] for x in p]):
        if len(set(names)) != len(names) or any("*" not in n for n in names):
            return None
    return tuple(h), tuple(p)


def derive(tensors: Mapping[str, Any], const: dict[str, int], unwritten: dict[str, int],
           twin_hf: list[str], twin_params: list[str], g_hf: list[str],
           g_params: list[str]) -> None:
    """Give the group (`g_hf`, `g_params`) the learned twin's map under its own names: each of its
    checkpoint tensors the twin tensor's segments (the run arrays shared, read-only), each
    parameter the twin parameter's constant and unwritten counts. The groups' signatures are
    equal (so are their name patterns)."""
    hf_of = {pattern(n): n for n in twin_hf}
    param_of = {pattern(n): n for n in g_params}
    for n in g_hf:
        for s in tensors[hf_of[pattern(n)]].segments:
            tensors[n].segments.append(dataclasses.replace(s, param=param_of[pattern(s.param)]))
    for n in twin_params:
        const[param_of[pattern(n)]] = const[n]
        unwritten[param_of[pattern(n)]] = unwritten[n]
