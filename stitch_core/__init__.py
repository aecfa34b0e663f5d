"""Stitch core: served views, lossless patches, fingerprints. No engine, no trainer.

Submodules import lazily, so an engine plugin importing `stitch_core.layout` (torch and numpy)
does not pay for the codec's numba kernels until it needs them.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["Patch", "PatchError", "apply", "diff", "__version__"]


def __getattr__(name: str) -> Any:
    if name in ("Patch", "apply", "diff"):
        from . import patch

        return getattr(patch, name)
    if name == "PatchError":
        from .stp import PatchError

        return PatchError
    raise AttributeError(f"module 'stitch_core' has no attribute {name!r}")
