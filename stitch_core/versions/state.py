"""The served state of a holder of versions: what `/stitch/status` and heartbeats call `state`
and `lag`. Pure functions (the follower, the gate and the HTTP protocol share them)."""

from __future__ import annotations

from typing import Literal

__all__ = ["EngineState", "engine_state", "lag"]

EngineState = Literal["not_ready", "applying", "catching_up", "serving"]


def engine_state(applying: bool, version: int | None, latest: int | None) -> EngineState:
    """The `state` of `/stitch/status` (and of a follower's heartbeat)."""
    if applying:
        return "applying"
    if version is None:
        return "not_ready"
    if latest is not None and latest > version:
        return "catching_up"
    return "serving"


def lag(version: int | None, latest: int | None) -> int | None:
    """Versions published beyond the one served (None while either is unknown)."""
    if version is None or latest is None:
        return None
    return max(0, latest - version)
