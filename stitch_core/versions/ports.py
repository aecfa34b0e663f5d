"""What the versions layer asks of the layers above: `ApplyTarget`, what a Follower applies to.

Implemented by `versions.memory_replica.MemoryReplica` (host memory, tests, a trainer-side
follower) and `engine.coordinator.Coordinator` (an engine's ranks); any ``async def f(step,
path)`` is one too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from stitch_core.versions.store import Step


class ApplyTarget(Protocol):
    """Applies one step (a patch or a snapshot, fetched and checked) to reach `step.version`.

    It owns the step's atomicity: raising leaves it holding the version it held before (or, if
    it proves what it holds, none: it then clears the `ServedVersion` it shares with the
    follower). Steps come in order, one at a time.
    """

    async def __call__(self, step: Step, path: Path) -> None: ...
