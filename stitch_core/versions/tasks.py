"""Ending asyncio tasks for certain: `cancel_all`, used by every long-lived loop's owner (the
follower, the node, the gateway)."""

from __future__ import annotations

import asyncio
import logging

log = logging.getLogger("stitch.tasks")


async def cancel_all(tasks: list[asyncio.Task], rounds: int = 5, wait: float = 2.0) -> None:
    """Cancel `tasks`, wait for each to end (whatever it raised) and empty the list.

    Bounded and repeated: on Python < 3.12 `asyncio.wait_for` (ours and nats-py's) can swallow a
    cancellation that races its inner future's completion, so a loop may outlive one cancel.
    Each round cancels what is still running again; after `rounds` rounds whatever is left is
    logged and abandoned, so a stop never hangs."""
    pending = [t for t in tasks if not t.done()]
    for _ in range(rounds):
        if not pending:
            break
        for t in pending:
            t.cancel()
        _, still = await asyncio.wait(pending, timeout=wait)
        pending = list(still)
    for t in tasks:  # retrieve results so none is reported as never retrieved
        if t.done() and not t.cancelled():
            t.exception()
    if pending:
        log.warning("%d task(s) did not end on cancel: %s", len(pending),
                    ", ".join(t.get_name() for t in pending))
    tasks.clear()
