"""Tests only: an engine plugin installs a dev stand-in of `stitch_dev` named by a setting.

The engine plugins read a dev setting (``STITCH_DEV_FP8_KERNEL``, ``STITCH_DEV_HOST_ALLOC``) in
every engine process and, when it is set, install the matching stand-in module of `stitch_dev`
(its ``install(mode)``). `stitch_dev` is not in the wheel: it is imported by name, and without
the source tree on the engine's path a warning says what the engine keeps instead. A bad value or
a failing install is logged, never raised: the engine starts with its own parts and the tests
that need the stand-in fail on what it would have named.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Mapping

from stitch_core.settings import Settings, SettingsError, env_name

__all__ = ["install_dev"]


def install_dev(setting: str, module: str, keeps: str, log: logging.Logger,
                env: Mapping[str, str] | None = None) -> str | None:
    """Install ``stitch_dev.<module>`` in the mode `setting` names (read from `env`, default the
    process environment) if it is set; `keeps`: what the engine keeps otherwise (for the log).
    The stand-in's ``install`` result (its name or mode), or None."""
    try:
        mode = Settings.read(setting, env)
    except SettingsError as e:
        log.warning("stitch: %s; %s", e, keeps)
        return None
    if not mode:
        return None
    try:
        dev = importlib.import_module(f"stitch_dev.{module}")
    except ModuleNotFoundError as e:
        if e.name != "stitch_dev":
            log.exception("stitch: stitch_dev.%s could not be imported: %s", module, keeps)
            return None
        log.warning("stitch: %s=%s needs stitch_dev (the source tree) on the engine's path; it "
                    "is not in the wheel: %s", env_name(setting), mode, keeps)
        return None
    try:
        return dev.install(mode)
    except Exception:
        log.exception("stitch: stitch_dev.%s was not installed: %s", module, keeps)
        return None
