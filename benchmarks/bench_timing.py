"""Timing helpers the benchmarks share: one call timed with the cyclic GC paused, the best of N.

The best (minimum) of a few calls is what every benchmark here reports for a kernel or a pass:
on these shared machines the other calls measure the neighbours. The cyclic GC is paused inside
the timer (a full collection costs ~0.4 s once torch is imported, and would land in whichever
call triggers it). Scripts import this module by name (run as ``python benchmarks/X.py``, the
script's own directory is on ``sys.path``; the tests that import benchmarks put it there).
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable, Mapping
from typing import TypeVar

import torch

T = TypeVar("T")

__all__ = ["timed", "best_of", "best", "best_on_clones"]


def timed(fn: Callable[[], T]) -> tuple[float, T]:
    """(seconds, result) of one call, with the cyclic GC paused."""
    gc.disable()
    try:
        t0 = time.perf_counter()
        out = fn()
        return time.perf_counter() - t0, out
    finally:
        gc.enable()


def best_of(reps: int, fn: Callable[[], T]) -> tuple[float, T]:
    """(min seconds, last result) of `reps` calls."""
    fastest, out = math.inf, None
    for _ in range(reps):
        dt, out = timed(fn)
        fastest = min(fastest, dt)
    return fastest, out  # type: ignore[return-value]


def best(fn: Callable[[], object], reps: int = 3) -> float:
    """The min seconds of `reps` calls."""
    return best_of(reps, fn)[0]


def best_on_clones(reps: int, fn: Callable[[dict[str, torch.Tensor]], T],
                   base: Mapping[str, torch.Tensor]) -> tuple[float, T]:
    """`best_of` for an in-place fn: each call gets a fresh clone of `base`, made outside the
    timer."""
    fastest, out = math.inf, None
    for _ in range(reps):
        arg = {n: t.clone() for n, t in base.items()}
        dt, out = timed(lambda: fn(arg))  # noqa: B023 - called at once
        fastest = min(fastest, dt)
    return fastest, out  # type: ignore[return-value]
