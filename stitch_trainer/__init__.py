"""Stitch trainer side: produce versions from training (`Publisher`, `hf.StitchCallback`)."""

from .publisher import Publisher, VersionInfo

__all__ = ["Publisher", "VersionInfo"]
