"""Stitch core: served views, lossless patches, fingerprints. No engine, no trainer."""

__version__ = "0.1.0"

from .patch import Patch, apply, diff  # noqa: E402
from .stp import PatchError  # noqa: E402

__all__ = ["Patch", "PatchError", "apply", "diff", "__version__"]
