"""What the serve layer asks of the node that builds its gate: `CatchUp` and `StatusSource`.

Both are handed to `serve.gate.VersionGate` at its construction (`stitch_core.node` passes its
own bound methods: the gate exists before the follower it will ask, so requests get 409 while
the engine starts).
"""

from __future__ import annotations

from typing import Any, Protocol


class CatchUp(Protocol):
    """Asked by a request that waits (``X-Stitch-Wait``) for a version the engine does not hold
    yet: get there within `timeout` seconds if possible (the follower wakes its loop and waits
    for the served version to reach `version`). True once it is held."""

    async def __call__(self, version: int, timeout: float) -> bool: ...


class StatusSource(Protocol):
    """More fields for ``GET /stitch/status`` (the engine's: fingerprint check, ranks, the
    follower's health), merged over the gate's own."""

    def __call__(self) -> dict[str, Any]: ...
