"""stitch_core.engine.threads.thread_map: order, thread use, errors."""

from __future__ import annotations

import threading

import pytest

from stitch_core.engine.threads import thread_map


def test_results_keep_the_items_order_on_any_thread_count():
    items = list(range(50))
    for threads in (0, 1, 2, 7, 100):
        assert thread_map(lambda x: x * x, items, threads) == [x * x for x in items]
    assert thread_map(lambda x: x, iter(range(3)), 2) == [0, 1, 2]  # any iterable
    assert thread_map(lambda x: x, [], 4) == []


def test_one_thread_runs_on_the_callers_thread_more_use_named_workers():
    me = threading.current_thread().name
    assert set(thread_map(lambda _: threading.current_thread().name, range(4), 1)) == {me}
    assert set(thread_map(lambda _: threading.current_thread().name, [0], 8)) == {me}
    barrier = threading.Barrier(2, timeout=10)

    def meet(_):  # both items must be running at once, or the barrier times out
        barrier.wait()
        return threading.current_thread().name

    names = thread_map(meet, range(2), 2, name="stitch-test")
    assert len(set(names)) == 2 and all(n.startswith("stitch-test") for n in names)


def test_an_error_in_one_item_is_raised_to_the_caller():
    def fn(x):
        if x == 3:
            raise ValueError("item 3")
        return x

    for threads in (1, 3):
        with pytest.raises(ValueError, match="item 3"):
            thread_map(fn, range(6), threads)
