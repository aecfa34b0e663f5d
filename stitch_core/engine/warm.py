"""Compile Stitch's kernels into numba's on-disk cache ahead of a first start (`stitch warm`).

Size: about 200 lines, one job: run every kernel family once, on small inputs of every dtype the
views serve, through the entry points the trainer and the follower call.

Stitch's CPU kernels (diff, encode, decode, apply, fingerprints, layout scan, rank writes) are
numba functions, compiled at their first call in a process and cached on disk (next to the
installed package when that directory is writable, else under ``NUMBA_CACHE_DIR``). A fresh
container has no cache, so an engine's first start compiles them (7.8 s against 0.5 s at 23M
parameters, benchmarks/results/startup_jit.md). `warm` fills the cache the way a real run
would: a diff and an apply of each served dtype at three densities (gaps, bitmap, every
element), then a follower's whole path on a toy engine in this process: layout learning
through its loader, the start-up proof, and a patch decoded by a `Coordinator`, gathered,
written and proven by a `RankReplica`. numba specialises on argument types, not sizes, so small
inputs compile what large ones use. numba keys the cache by CPU model and features: warm on the
CPU kind that will run (an image warmed elsewhere compiles once more, beside it).

Written by hand because numba offers no ahead-of-time fill of a `cache=True` function's cache
other than calling it.
"""

from __future__ import annotations

import asyncio
import importlib
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from stitch_core.engine import rpc
from stitch_core.engine.coordinator import Coordinator
from stitch_core.engine.layout import learn_layout
from stitch_core.engine.replica import RankReplica
from stitch_core.format import dtypes
from stitch_core.format import fingerprint as fpr
from stitch_core.format.patch import apply, diff
from stitch_core.versions.manifest import PULLED_MANIFEST, Manifest
from stitch_core.versions.store import object_ref

__all__ = ["KERNEL_MODULES", "WarmReport", "cache_counts", "kernels", "warm"]

# every module that defines cached numba kernels (tests/test_warm.py checks the list is whole)
KERNEL_MODULES = (
    "stitch_core.format.codec", "stitch_core.format.entropy", "stitch_core.format.rans",
    "stitch_core.format.fingerprint", "stitch_core.engine.layout",
    "stitch_core.engine.layout_scan", "stitch_core.engine.layout_load",
    "stitch_core.engine.scatter",
)
# the served dtypes: bf16/fp16/fp32 views, FP8 codes, packed FP4 codes and E8M0 scales (uint8)
DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.uint8)
RUN = "stitch-warm"


@dataclass
class WarmReport:
    kernels: int  # cached numba kernels in Stitch's modules
    compiled: int  # signatures compiled by this call (cache misses)
    loaded: int  # signatures read from the cache by this call
    seconds: float
    cache_dir: str  # where numba keeps the first kernel's cache

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def kernels() -> dict[str, Any]:
    """{module.function: dispatcher} of every cached numba kernel in `KERNEL_MODULES`."""
    out = {}
    for mod_name in KERNEL_MODULES:
        mod = importlib.import_module(mod_name)
        for name, obj in vars(mod).items():
            if getattr(obj, "__module__", None) == mod_name and hasattr(obj, "stats") and \
                    hasattr(obj, "py_func") and getattr(obj, "_cache", None) is not None:
                out[f"{mod_name}.{name}"] = obj
    return out


def cache_counts() -> tuple[int, int]:
    """(signatures loaded from numba's cache, signatures compiled) so far in this process."""
    hits = misses = 0
    for d in kernels().values():
        st = d.stats
        hits += sum(st.cache_hits.values())
        misses += sum(st.cache_misses.values())
    return hits, misses


def _changed(base: torch.Tensor, frac: float, g: torch.Generator, step: float = 0.0
             ) -> torch.Tensor:
    """`base` with a fraction `frac` of its elements moved: by `step` in value where given (as an
    optimizer moves a float weight: small values by more ULPs, so values are coded under their
    exponent's context), else by flipping the lowest bit of their integer bits."""
    bits = base.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[base.element_size()])
    n = base.numel()
    pos = torch.randperm(n, generator=g)[:max(1, int(n * frac))]
    if step and base.is_floating_point():
        new = base.clone().reshape(-1)
        sign = torch.randint(0, 2, (pos.numel(),), generator=g).float() * 2 - 1
        new[pos] = (new[pos].float() + step * sign).to(base.dtype)
        return new.view(base.shape)
    new_bits = bits.clone().reshape(-1)
    new_bits[pos] = new_bits[pos] ^ 1  # the lowest bit: a one-ULP move for floats
    return new_bits.view(base.shape).view(base.dtype)


def _random(shape: tuple[int, ...], dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    if dtype == torch.uint8:
        return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    return (torch.randn(shape, generator=g) * 0.02).to(dtype)


def _format_paths(work: Path, g: torch.Generator) -> None:
    """diff (with and without the base's fingerprints), apply from bytes and in place from a
    file, for every served dtype at three densities."""
    for i, dtype in enumerate(DTYPES):
        base = {f"t{i}": _random((64, 96), dtype, g), f"n{i}": _random((96,), dtype, g)}
        fps = fpr.state_fingerprints(base)
        for frac, step in ((0.01, 0.0), (0.4, 0.0), (1.0, 0.0), (0.05, 0.004), (1.0, 0.004)):
            new = {k: _changed(t, frac, g, step) for k, t in base.items()}
            p = diff(base, new)
            apply(base, p)
            path = work / f"p{i}.stp"
            diff(base, new, base_fingerprints=fps).write(path)
            got = apply({k: t.clone() for k, t in base.items()}, path, base_fingerprints=fps,
                        inplace=True)
            assert all(torch.equal(got[k].view(torch.uint8), new[k].view(torch.uint8))
                       for k in new), "warm: a round trip did not reproduce its target"


class _Toy(torch.nn.Module):
    """A toy engine: one fused parameter (two HF tensors, as q/k/v fuse) and one of each other
    served dtype, with a `load_weights` as engines have."""

    def __init__(self, hf: dict[str, torch.Tensor]):
        super().__init__()
        self.fused = torch.nn.Parameter(torch.cat([hf["a.weight"], hf["b.weight"]]),
                                        requires_grad=False)
        self.rest = torch.nn.ParameterDict({
            k.replace(".", "_"): torch.nn.Parameter(t.clone(), requires_grad=False)
            for k, t in hf.items() if k not in ("a.weight", "b.weight")})

    def load_weights(self, weights):
        for name, w in weights:
            if name in ("a.weight", "b.weight"):
                n = self.fused.shape[0] // 2
                self.fused.data.narrow(0, 0 if name == "a.weight" else n, n).copy_(w)
            else:
                self.rest[name.replace(".", "_")].data.copy_(w)
        return None


def _manifest(version: int, state: dict[str, torch.Tensor], objects: list) -> Manifest:
    fps = fpr.state_fingerprints(state)
    return Manifest.from_rows(
        run=RUN, version=version, parent=version - 1 if version else None,
        kind="patch" if version else "snapshot", view="bf16",
        created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), producer="stitch warm",
        rows=[(k, dtypes.info(t.dtype).name, tuple(t.shape), fps[k]) for k, t in state.items()],
        objects=objects)


async def _follower_path(work: Path, g: torch.Generator) -> None:
    """A toy engine started on v0 (layout learned through its loader, proven against v0's
    manifest, as `stitch pull` leaves it) that applies v1 and proves it."""
    from safetensors.torch import save_file

    v0 = {"a.weight": _random((64, 96), torch.bfloat16, g),
          "b.weight": _random((64, 96), torch.bfloat16, g)}
    v0.update({f"x{i}.weight": _random((32, 96), d, g) for i, d in enumerate(DTYPES)})
    (work / "v0").mkdir()
    save_file(v0, str(work / "v0" / "model.safetensors"))
    weights = object_ref(work / "v0" / "model.safetensors", "weights")
    (work / "v0" / PULLED_MANIFEST).write_text(_manifest(0, v0, [weights]).model_dump_json())
    coord = Coordinator(rpc.in_process([RankReplica(_Toy(v0))]), run=RUN)
    if await coord.start(work / "v0") != 0:
        raise RuntimeError("warm: the toy engine did not prove v0")
    # a rank holding a shard learns from row and column ids (`layout_load`): its kernel too
    learn_layout(_Toy(v0), {k: (tuple(t.shape), t.dtype) for k, t in v0.items()},
                 split_index=True)
    v1 = {k: _changed(t, 0.05, g, 0.004) for k, t in v0.items()}
    path = work / "v1.stp"
    diff(v0, v1, run=RUN, base_version=0, target_version=1, view="bf16",
         base_fingerprints=fpr.state_fingerprints(v0)).write(path)
    await coord.apply_patch(_manifest(1, v1, [object_ref(path, "patch")]), [path])
    if coord.version != 1 or not (await coord.verify())["ok"]:
        raise RuntimeError("warm: the toy engine did not prove v1")


def warm(seed: int = 0) -> WarmReport:
    """Compile (or load) every Stitch kernel a trainer's diff and a follower's start and apply
    call, into numba's cache; what it did."""
    t0 = time.perf_counter()
    h0, m0 = cache_counts()
    g = torch.Generator().manual_seed(seed)
    with tempfile.TemporaryDirectory(prefix="stitch-warm-") as d:
        work = Path(d)
        _format_paths(work, g)
        asyncio.run(_follower_path(work, g))
    h1, m1 = cache_counts()
    ks = kernels()
    first = next(iter(ks.values()))
    return WarmReport(kernels=len(ks), compiled=m1 - m0, loaded=h1 - h0,
                      seconds=time.perf_counter() - t0,
                      cache_dir=str(first.stats.cache_path))
