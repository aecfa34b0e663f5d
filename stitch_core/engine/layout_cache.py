"""The learned layout kept on disk, so that an engine restart does not learn it again.

Learning a rank's layout loads index tensors through every loader of the model
(`stitch_core.engine.layout.learn_layout`): at start-up it costs about as much as the engine's own
weight loading, and it is paid again on every restart of the same engine on the same model. The
map depends only on code and shapes, never on weight values, so it is cached, keyed by
everything it depends on:

* the served view's tensors (names, shapes, dtypes) and the engine's parameters as
  `engine_params` gives them (names, shapes, dtypes: kept masters included, so the plugin's
  keepers are part of the key);
* the adapter's identity of the code that places weights (`identity`, given at construction:
  engine name and version, the model class and a hash of its source file, TP/PP size and rank,
  dtype, quantization);
* this format's version and Stitch's version.

One file per key, ``<dir>/<key>.safetensors``: the segments' run arrays as int64 tensors and the
rest as JSON metadata, written to a temporary file and renamed. safetensors rather than pickle:
the file is read back as data, never as code.

The cache is never trusted for correctness. A file that does not parse, whose key does not
match, or whose runs fall outside the tensors' bounds is ignored (and removed). A map that parses
but is wrong (code changed without changing the key) is caught by the start-up proof, which
checks every tensor through the map against the manifest's fingerprints; the coordinator then
learns the layout again through the loaders, without the cache, and proves again
(`stitch_core.engine.proof`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from stitch_core.engine.layout import Layout, Segment, TensorMap, engine_params
from stitch_core.format import dtypes

__all__ = ["LayoutCache", "FORMAT", "code_identity", "from_settings"]

FORMAT = 1
log = logging.getLogger("stitch.engine")


def _dt(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


def _torch_dtype(name: str) -> torch.dtype:
    d = getattr(torch, name, None)
    if not isinstance(d, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return d


class LayoutCache:
    """Layouts on disk under `root`, for the code `identity` describes (a JSON-able mapping)."""

    def __init__(self, root: str | os.PathLike, identity: Mapping[str, Any]):
        self.root = Path(root)
        self.identity = dict(identity)

    def key(self, model: torch.nn.Module,
            hf: Mapping[str, tuple[tuple[int, ...], torch.dtype]]) -> str:
        from stitch_core.distribution import PRODUCER

        params = {n: [list(p.shape), _dt(p.dtype)] for n, p in engine_params(model).items()}
        doc = {"format": FORMAT, "stitch": PRODUCER, "identity": self.identity,
               "hf": {n: [list(s), _dt(d)] for n, (s, d) in sorted(hf.items())},
               "params": dict(sorted(params.items()))}
        blob = json.dumps(doc, sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()

    def _path(self, key: str) -> Path:
        return self.root / f"{key}.safetensors"

    def load(self, key: str) -> Layout | None:
        """The layout stored under `key`, or None (missing, unreadable, or out of bounds: then
        removed)."""
        path = self._path(key)
        if not path.is_file():
            return None
        try:
            return _read(path, key)
        except Exception as e:  # any damage: learn again
            log.warning("stitch: ignoring the cached layout %s (%s: %s)", path,
                        type(e).__name__, e)
            with contextlib.suppress(OSError):
                path.unlink()
            return None

    def save(self, key: str, layout: Layout) -> None:
        """Store `layout` under `key` (best effort: a failure is logged, not raised)."""
        from safetensors.numpy import save_file

        try:
            self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
            arrays: dict[str, np.ndarray] = {}
            tensors = []
            for i, (name, tm) in enumerate(layout.tensors.items()):
                segs = []
                for j, s in enumerate(tm.segments):
                    for part in ("hf_start", "eng_start", "length"):
                        arrays[f"{i}.{j}.{part}"] = np.ascontiguousarray(
                            getattr(s, part), dtype=np.int64)
                    segs.append(s.param)
                tensors.append([name, list(tm.hf_shape), _dt(tm.hf_dtype), segs])
            meta = {"key": key, "format": FORMAT, "tensors": tensors,
                    "param_shapes": {p: list(s) for p, s in layout.param_shapes.items()},
                    "param_dtypes": {p: _dt(d) for p, d in layout.param_dtypes.items()},
                    "param_const": layout.param_const, "param_unwritten": layout.param_unwritten}
            tmp = self._path(key).with_suffix(f".tmp{os.getpid()}")
            save_file(arrays, str(tmp), metadata={"stitch_layout": json.dumps(meta)})
            os.replace(tmp, self._path(key))
        except Exception as e:
            log.warning("stitch: could not cache the layout under %s (%s: %s)", self.root,
                        type(e).__name__, e)


def code_identity(model: torch.nn.Module) -> dict[str, Any]:
    """The model class and a digest of its source file (where its loaders live), for an
    adapter's `identity`."""
    import inspect

    cls = type(model)
    ident: dict[str, Any] = {"model_class": f"{cls.__module__}.{cls.__qualname__}"}
    with contextlib.suppress(TypeError, OSError):
        src = inspect.getsourcefile(cls)
        if src:
            ident["model_source"] = hashlib.sha256(Path(src).read_bytes()).hexdigest()
    return ident


def from_settings(identity: Mapping[str, Any]) -> LayoutCache | None:
    """The cache the settings ask for (`STITCH_LAYOUT_CACHE`, default on), under
    ``STITCH_CACHE_DIR/layouts`` (default: the user's private cache directory); None when off
    or when no cache directory can be had (logged: the engine then learns at every start)."""
    from stitch_core.settings import Settings

    try:
        if not Settings.read("layout_cache"):
            return None
        root = Settings.read("cache_dir")
        if root is None:
            from stitch_core.versions.materialize import default_cache_dir

            root = default_cache_dir()
        return LayoutCache(Path(root) / "layouts", identity)
    except Exception as e:
        log.warning("stitch: no layout cache (%s: %s)", type(e).__name__, e)
        return None


def _numel(shape) -> int:
    return int(np.prod(shape, dtype=np.int64))


def _read(path: Path, key: str) -> Layout:
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as f:
        meta = json.loads((f.metadata() or {})["stitch_layout"])
        if meta.get("key") != key or meta.get("format") != FORMAT:
            raise ValueError("key or format does not match")
        shapes = {p: tuple(int(x) for x in s) for p, s in meta["param_shapes"].items()}
        tensors: dict[str, TensorMap] = {}
        for i, (name, shape, dt, segs) in enumerate(meta["tensors"]):
            tm = TensorMap(str(name), tuple(int(x) for x in shape), _torch_dtype(dt))
            dtypes.info(tm.hf_dtype)  # a dtype the served view knows
            for j, param in enumerate(segs):
                if param not in shapes:
                    raise ValueError(f"segment of {name} names unknown parameter {param!r}")
                hs, es, ln = (f.get_tensor(f"{i}.{j}.{p}")
                              for p in ("hf_start", "eng_start", "length"))
                if not (hs.ndim == es.ndim == ln.ndim == 1 and len(hs) == len(es) == len(ln)
                        and hs.dtype == es.dtype == ln.dtype == np.int64):
                    raise ValueError(f"malformed runs for {name}")
                if len(hs) and (ln.min() <= 0 or hs.min() < 0 or es.min() < 0
                                or (hs + ln).max() > tm.hf_numel
                                or (es + ln).max() > _numel(shapes[param])
                                or (np.diff(hs) < 0).any()):
                    raise ValueError(f"runs of {name} fall outside its tensors")
                tm.segments.append(Segment(param, hs, es, ln))
            tensors[tm.hf_name] = tm
    return Layout(tensors=tensors, param_shapes=shapes,
                  param_dtypes={p: _torch_dtype(d) for p, d in meta["param_dtypes"].items()},
                  param_const={p: int(v) for p, v in meta["param_const"].items()},
                  param_unwritten={p: int(v) for p, v in meta["param_unwritten"].items()})
