"""What the engine layer asks of the layers beside and above it: `ApplyGate`, what a coordinator
applies through.

Implemented by `serve.gate.VersionGate` (an engine serving requests: drain, in-flight accounting,
apply metrics) and by `versions.served.ServedVersion` itself (no requests to gate: tests, the
benchmarks). The engine never imports serve; the node hands the gate in.
"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from typing import Protocol

from stitch_core.versions.served import ServedVersion


class ApplyHandle(Protocol):
    """Yielded by `ApplyGate.applying`."""

    def commit(self, patch_bytes: int | None = None) -> None:
        """The target is in place and proven: the served version becomes it when the
        transaction ends."""


class ApplyGate(Protocol):
    """The owner of the served version, and the transaction around each weight mutation."""

    @property
    def served(self) -> ServedVersion:
        """Where the coordinator records what the ranks are proven to hold."""

    def applying(self, target: int) -> AbstractAsyncContextManager[ApplyHandle]:
        """``async with gate.applying(target) as h: <mutate>; h.commit()``: the served version
        becomes `target` at the end iff `h.commit()` was called."""
