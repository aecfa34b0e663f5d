"""The engine layer: applying versions in place inside a running engine, and proving the result.

Engine-agnostic (no vLLM or SGLang import): where each served element lives in an engine's
parameters (`layout`), kernels' private copies of weights kept in step (`derived`), the rank side of
an apply (`replica`) and the node's coordinator that decodes a patch once and drives every rank
(`coordinator`). Uses the format and versions layers; knows nothing of HTTP (the serve layer).

`stitch_core.engine` was a module before the layered tree; its names (`EngineFollower`,
`FollowerMiddleware`, `Settings`, `current`) now live in the composition root `stitch_core.node`
and are still found here, with a DeprecationWarning, for one release.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

_MOVED_TO_NODE = ("EngineFollower", "FollowerMiddleware", "Settings", "current")


def __getattr__(name: str) -> Any:
    if name in _MOVED_TO_NODE:
        warnings.warn(f"stitch_core.engine.{name} moved to stitch_core.node.{name}",
                      DeprecationWarning, stacklevel=2)
        # by name: the engine layer does not import the composition root (a one-release alias)
        return getattr(importlib.import_module("stitch_core.node"), name)
    raise AttributeError(f"module 'stitch_core.engine' has no attribute {name!r}")
