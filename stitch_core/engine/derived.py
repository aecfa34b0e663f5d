"""Derived copies: engine state built from a weight after loading, kept in step and proven current.

Some engine kernels never read the parameter a patch writes. vLLM's CPU backend packs linear
weights into private copies (an AMX-packed tensor or a oneDNN handle held in a closure) and reads
only those; a tied ``lm_head`` packs its *own* copy of ``embed_tokens.weight``. A fingerprint of
the parameter proves the parameter, not the copy: an in-place write that does not rebuild every
copy built from it serves old numbers under a verified label.

An engine adapter registers each copy it builds with `register` (module, the source tensors the
copy is built from, how to rebuild it). This module then

* rebuilds every copy whose sources share storage with what an apply wrote (`rebuild_from`):
  selection by *storage*, not by parameter name, so a tied weight rebuilds both the embedding's and
  the lm_head's copies;
* proves a copy current (`stale`): each copy carries a stamp, a 128-bit digest of its sources'
  bytes at the moment it was built (`digest`: XXH3-128, ~17 GB/s on one core here where BLAKE2b
  runs 0.9 GB/s; a stamp never leaves the process and guards against a forgotten rebuild, not an
  adversary, so a non-cryptographic hash suffices; BLAKE2b-128 where `xxhash` is not installed).
  A copy whose sources no longer hash to its stamp was not
  rebuilt after they changed. Every copy is checked so on a full check (``/stitch/verify``; at
  start-up on the engine's threads: `xxhash` releases the GIL). Inside
  an apply's write (the engine pause) the rank asks `not_rebuilt` instead: every copy built from
  what the write changed must have been stamped after the write began (each stamp takes a new
  generation number). That stamp hashed the bytes as they were then and nothing writes between
  the rebuild and the commit, so it proves the same without hashing every touched weight a
  second time in the pause (at 0.63B on vLLM's packed CPU layouts, ~1 s);
* names what it cannot keep in step (`unmanaged`): a module attribute that is a closure over a
  tensor or an opaque object (the shape vLLM's packed kernels take) that no adapter registered.

The stamp proves "rebuilt from exactly these bytes by the engine's own packing function", which is
deterministic; it does not re-check the packing function itself. Engine-agnostic: no vLLM import.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import types
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from stitch_core.engine.threads import thread_map

try:
    import xxhash
except ImportError:  # pragma: no cover - a declared dependency
    xxhash = None

__all__ = ["DerivedCopy", "register", "copies", "rebuild_from", "stale", "unmanaged", "kinds",
           "digest", "generation", "not_rebuilt"]

log = logging.getLogger("stitch.engine")
ATTR = "_stitch_derived"
_GENERATIONS = itertools.count(1)  # stamps and apply marks, in the order they happen
# closures over these are not derived state (configuration, other code)
_PLAIN = (int, float, bool, str, bytes, type(None), torch.dtype, torch.device, types.FunctionType,
          types.BuiltinFunctionType, types.MethodType, types.ModuleType, type, torch.nn.Module)


@dataclass
class DerivedCopy:
    """One module's derived state: `kind` (e.g. ``amx``, ``onednn``), the `sources` it is built
    from ({attribute: tensor}), `rebuild` (rebuilds it from the sources as they are now), the
    attributes that hold it (`holders`, e.g. ``cpu_linear``) and the `stamp` of its last build."""

    kind: str
    sources: dict[str, torch.Tensor]
    rebuild: Callable[[], object]
    holders: tuple[str, ...] = ()
    stamp: bytes = field(default=b"", repr=False)
    built: int = 0  # the generation of the last stamp
    # builds the copy from other source tensors ({attribute: tensor}, as `sources`) without
    # touching the module, and returns what installs it (which returns what it replaced): the
    # copy built ahead of a pause (`stitch_core.engine.prebuild`); None: only rebuilt in place
    build: Callable[[Mapping[str, torch.Tensor]], Callable[[], object]] | None = None
    # set by the rank for one write only: a build ahead whose sources are, by construction, what
    # the write leaves in `sources` (a future of (install, stamp of those sources))
    ahead: Future | None = field(default=None, repr=False)
    # what the last install replaced (the old copy), kept so that it is freed after the pause
    retired: object = field(default=None, repr=False)

    def restamp(self) -> None:
        self.stamp = digest(self.sources.values())
        self.built = next(_GENERATIONS)

    def install_ahead(self) -> bool:
        """Install the copy built ahead, if there is one and its build finished and succeeded
        (it carries the stamp of the sources it was built from); False: rebuild it in place."""
        fut, self.ahead = self.ahead, None
        if fut is None or not fut.done():  # not built (yet): no waiting inside the pause
            return False
        try:
            install, stamp = fut.result()
        except Exception as e:  # noqa: BLE001 - the in-place rebuild is the fallback
            log.warning("stitch: a %s copy built ahead failed (%s: %s); rebuilt in the pause",
                        self.kind, type(e).__name__, e)
            return False
        self.retired = install()
        self.stamp, self.built = stamp, next(_GENERATIONS)
        return True

    def current(self) -> bool:
        return digest(self.sources.values()) == self.stamp


def _hasher():
    if xxhash is None:  # a hand-made environment without the declared dependency
        return hashlib.blake2b(digest_size=16)
    return xxhash.xxh3_128()


def digest(tensors: Iterable[torch.Tensor]) -> bytes:
    """A 128-bit digest (XXH3-128) of the raw bytes of `tensors`, in order (shape and dtype
    included)."""
    h = _hasher()
    for t in tensors:
        t = t.detach()
        h.update(f"{tuple(t.shape)}:{t.dtype};".encode())
        if t.numel():
            flat = t.reshape(-1)
            if flat.device.type != "cpu":
                flat = flat.cpu()
            h.update(flat.contiguous().view(torch.uint8).numpy().data)
    return h.digest()


def register(module: torch.nn.Module, kind: str, sources: Mapping[str, torch.Tensor],
             rebuild: Callable[[], object], holders: Iterable[str] = (),
             build: Callable[[Mapping[str, torch.Tensor]], Callable[[], object]] | None = None,
             ) -> DerivedCopy:
    """Record that `module` holds state of `kind` built just now from `sources` (`build`: see
    `DerivedCopy`)."""
    dc = DerivedCopy(kind, dict(sources), rebuild, tuple(holders), build=build)
    dc.restamp()
    setattr(module, ATTR, dc)
    return dc


def copies(model: torch.nn.Module) -> list[tuple[str, DerivedCopy]]:
    """(module name, copy) for every registered copy, one per module."""
    return [(name or "<root>", dc) for name, mod in model.named_modules()
            if isinstance(dc := getattr(mod, ATTR, None), DerivedCopy)]


def _storages(tensors: Iterable[torch.Tensor]) -> set[tuple[str, int]]:
    out = set()
    for t in tensors:
        if t.numel():
            out.add((t.device.type, t.untyped_storage().data_ptr()))
    return out


def _touches(dc: DerivedCopy, storages: set[tuple[str, int]]) -> bool:
    return bool(_storages(dc.sources.values()) & storages)


def _each(fn: Callable[[DerivedCopy], object], dcs: list[DerivedCopy], threads: int) -> list:
    """fn over every copy, on up to `threads` threads: hashing is most of what a stamp or a
    check costs, and xxhash releases the GIL (1.7x on two cores for 1 GB of bf16)."""
    return thread_map(fn, dcs, threads, "stitch-stamp")


def rebuild_from(model: torch.nn.Module, written: Iterable[torch.Tensor],
                 threads: int = 1) -> list[str]:
    """Rebuild every copy built from storage that `written` shares, one by one, then restamp
    them (on up to `threads` threads); their names. A copy the rank armed with a build ahead
    (`DerivedCopy.ahead`) is installed from it instead (already stamped)."""
    storages = _storages(written)
    picked = [(name, dc) for name, dc in copies(model) if _touches(dc, storages)]
    rebuilt = []
    for _, dc in picked:
        if not dc.install_ahead():
            dc.rebuild()
            rebuilt.append(dc)
    _each(DerivedCopy.restamp, rebuilt, threads)
    return sorted(name for name, _ in picked)


def stale(model: torch.nn.Module, written: Iterable[torch.Tensor] | None = None,
          threads: int = 1) -> list[str]:
    """Copies whose sources no longer hash to their stamp (only those built from `written`, when
    given): state the kernels read that was not rebuilt after its weight changed. `threads` > 1
    hashes copies in parallel: start-up, when nothing else runs; a check while the engine serves
    keeps to one thread (as `RankReplica.sums`)."""
    storages = None if written is None else _storages(written)
    picked = [(name, dc) for name, dc in copies(model)
              if storages is None or _touches(dc, storages)]
    ok = _each(DerivedCopy.current, [dc for _, dc in picked], threads)
    return sorted(f"{name} ({dc.kind})" for (name, dc), good in zip(picked, ok, strict=True)
                  if not good)


def generation() -> int:
    """A mark: every stamp taken after this call has a larger generation."""
    return next(_GENERATIONS)


def not_rebuilt(model: torch.nn.Module, written: Iterable[torch.Tensor], since: int) -> list[str]:
    """Copies built from storage that `written` shares whose last stamp is older than the mark
    `since`: what a write since then changed and nobody rebuilt. No hashing (see the module doc)."""
    storages = _storages(written)
    return sorted(f"{name} ({dc.kind})" for name, dc in copies(model)
                  if _touches(dc, storages) and dc.built < since)


def kinds(model: torch.nn.Module) -> dict[str, int]:
    """{kind: number of registered copies}."""
    out: dict[str, int] = {}
    for _, dc in copies(model):
        out[dc.kind] = out.get(dc.kind, 0) + 1
    return dict(sorted(out.items()))


def _opaque(value: object) -> bool:
    return isinstance(value, torch.Tensor) or not isinstance(value, _PLAIN + (tuple, list, dict))


def unmanaged(model: torch.nn.Module) -> list[str]:
    """Module attributes that are closures over tensors or opaque objects (a kernel's private copy
    of something) and that no registered copy accounts for: ``module.attr`` names."""
    out = []
    for name, mod in model.named_modules():
        dc = getattr(mod, ATTR, None)
        held = set(dc.holders) if isinstance(dc, DerivedCopy) else set()
        for attr, value in vars(mod).items():
            if attr.startswith("_stitch") or attr in held:
                continue
            cells = getattr(value, "__closure__", None) if callable(value) else None
            if not cells:
                continue
            if any(_opaque(c.cell_contents) for c in cells if _filled(c)):
                out.append(f"{name}.{attr}" if name else attr)
    return sorted(out)


def _filled(cell) -> bool:
    try:
        cell.cell_contents  # noqa: B018
    except ValueError:  # an empty cell
        return False
    return True
