"""`stitch_core.versions.tasks.cancel_all` ends a task that swallows a cancellation (as
`asyncio.wait_for` can on Python < 3.12 when the cancel races its inner future) and never hangs on
one that never ends."""
import asyncio
import contextlib

import pytest

from stitch_core.versions.tasks import cancel_all


@pytest.mark.asyncio
async def test_a_swallowed_cancel_is_cancelled_again():
    swallowed = 0

    async def stubborn():
        nonlocal swallowed
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                swallowed += 1
                if swallowed > 1:
                    raise

    t = asyncio.create_task(stubborn())
    await asyncio.sleep(0)
    tasks = [t]
    await asyncio.wait_for(cancel_all(tasks, wait=0.2), 10)
    assert t.cancelled() and swallowed == 2 and tasks == []


@pytest.mark.asyncio
async def test_a_task_that_never_ends_is_abandoned_in_bounded_time(caplog):
    release = asyncio.Event()

    async def immortal():
        while not release.is_set():
            with contextlib.suppress(asyncio.CancelledError):
                await release.wait()

    t = asyncio.create_task(immortal(), name="immortal")
    await asyncio.sleep(0)
    tasks = [t]
    await asyncio.wait_for(cancel_all(tasks, rounds=3, wait=0.1), 10)
    assert not t.done() and tasks == [] and "immortal" in caplog.text
    release.set()  # the test's own clean-up
    await asyncio.wait_for(t, 5)


@pytest.mark.asyncio
async def test_results_of_failed_tasks_are_retrieved():
    async def fails():
        raise ValueError("x")

    t = asyncio.create_task(fails())
    await asyncio.sleep(0)
    tasks = [t]
    await cancel_all(tasks)
    assert t.done() and isinstance(t.exception(), ValueError)
