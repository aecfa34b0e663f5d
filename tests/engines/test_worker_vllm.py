"""Without an engine: vLLM's executor reads the workers' replies rank by rank and raises at the
first failure, so a raising worker would leave the later ranks' replies queued for the next call;
the worker extension never raises (`rpc.Failed`), and the follower raises once all answered (the
real-engine faults: test_tp2_faults.py)."""

from __future__ import annotations

import asyncio

import pytest

from stitch_core.engine import rpc
from stitch_vllm.server import VllmFollower
from stitch_vllm.worker import StitchWorkerExtension


class _Rep:
    rank_info = {"tp_rank": 0}

    def handle(self, req):
        raise RuntimeError("boom")


def test_the_worker_never_raises_and_the_follower_raises_once_all_answered():
    w = StitchWorkerExtension()
    w._stitch_rep = _Rep()
    reply = rpc.decode(w.stitch_call(rpc.encode(rpc.Sums())))
    assert isinstance(reply, rpc.Failed) and "boom" in reply.error

    class Engine:
        async def collective_rpc(self, method, args=()):
            assert method == "stitch_call"
            return [w.stitch_call(*args), rpc.encode(rpc.Done("x"))]

    f = VllmFollower.__new__(VllmFollower)
    f.engine = Engine()
    with pytest.raises(RuntimeError, match="rank 0: RuntimeError: boom"):
        asyncio.run(f.rpc(rpc.Undo("x")))
