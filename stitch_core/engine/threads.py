"""`thread_map`: a function over items on up to N threads, in order; one owner for that pattern.

Stitch's heavy per-item work on a rank (hashing a tensor, scanning a shadow, decoding a chunk)
runs in numba kernels or `xxhash`, both of which release the GIL, so plain threads use the
cores without a process pool. Which thread count to use is each caller's decision (start-up uses
the engine's threads, a check while the engine serves keeps to one).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")

__all__ = ["thread_map"]


def thread_map(fn: Callable[[T], R], items: Iterable[T], threads: int,
               name: str = "stitch") -> list[R]:
    """[fn(x) for x in items], on up to `threads` threads (never more than items); one thread or
    one item: a plain loop on the caller's thread. The first exception raised is re-raised."""
    items = list(items)
    threads = min(int(threads), len(items))
    if threads <= 1:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(threads, thread_name_prefix=name) as ex:
        return list(ex.map(fn, items))
