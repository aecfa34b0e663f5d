"""Stitch core: served views, lossless patches, versions, the engine-side apply machinery and the
version protocol. No engine, no trainer.

One layer per subpackage, each importing only the layers below it (checked in CI by
import-linter; docs/architecture.md):

    cli        the `stitch` command line (top)
    node       the composition root of an engine node: follower + coordinator + gate + ASGI
    engine     in-place apply inside an engine: layout maps, ranks, coordinator, derived copies
    serve      the version protocol over HTTP: headers, gate, ASGI middleware, metrics
    versions   manifests, boards, store and plan, materialise and pull, NATS, the follower
    format     dtypes, views, fingerprints, the codec, the `.stp` container, diff/apply

`engine` and `serve` are independent of each other. Submodules import lazily, so an engine plugin
importing `stitch_core.engine.layout` (torch and numpy) does not pay for the codec's numba kernels
until it needs them. No module below imports this package root (an import-linter contract):
`__version__` comes from the installed distribution's metadata (`stitch_core.distribution`).
"""

from __future__ import annotations

from typing import Any

from stitch_core.distribution import VERSION as __version__
from stitch_core.errors import StitchError

__all__ = ["Patch", "PatchError", "StitchError", "apply", "diff", "__version__"]


def __getattr__(name: str) -> Any:
    if name in ("Patch", "apply", "diff"):
        from stitch_core.format import patch

        return getattr(patch, name)
    if name == "PatchError":
        from stitch_core.format.stp import PatchError

        return PatchError
    raise AttributeError(f"module 'stitch_core' has no attribute {name!r}")
