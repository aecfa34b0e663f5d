"""The installed distribution's name and version: one owner, the package metadata.

The version is written once, in pyproject.toml; the wheel's metadata carries it and every module
that stamps it (a patch's or a span's `producer`, `stitch --version`) asks here. A source tree
that was never installed (no metadata) says so instead of guessing.
"""

from __future__ import annotations

import importlib.metadata

DISTRIBUTION = "stitch-rl"


def _installed_version() -> str:
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return "0+not-installed"


VERSION = _installed_version()
PRODUCER = f"{DISTRIBUTION} {VERSION}"
"""What patches, spans and manifests name as their producer."""
