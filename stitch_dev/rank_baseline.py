"""The engine-apply benchmark's baseline on a rank: a bare ``index_put_`` of the last write.

Importing this module registers `Baseline` with `stitch_core.engine.replica.register_handler`,
so every `RankReplica.handle` of the process answers it. It need not be imported in the rank's
process by hand: a `Baseline` sent through an engine's RPC is unpickled there, which imports
this module (the checkout on the rank's ``sys.path``, as benchmarks/engine_apply.py arranges).
Production code never sends or registers it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from stitch_core.engine.replica import RankReplica, ReplicaError, register_handler


@dataclass(frozen=True)
class Baseline:
    """Time a bare `index_put_` of the last write (best of `repeat`)."""

    repeat: int = 3


@dataclass(frozen=True)
class BaselineReply:
    """The best time of the bare `index_put_` and the engine elements it wrote."""

    index_put_s: float
    elements: int


def baseline(rep: RankReplica, req: Baseline) -> BaselineReply:
    """The best time of a bare ``index_put_`` of the last write's values at the same engine
    positions of the same tensors (rewrites identical bits)."""
    if not rep.last_write:
        raise ReplicaError("no write to compare with")
    vals = [flat[eng].clone() for flat, eng in rep.last_write]
    best = float("inf")
    for _ in range(max(1, req.repeat)):
        t0 = time.perf_counter()
        for (flat, eng), v in zip(rep.last_write, vals, strict=True):
            flat.index_put_((eng,), v)
        if vals and vals[0].device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return BaselineReply(best, sum(int(e.numel()) for _, e in rep.last_write))


register_handler(Baseline, baseline)
