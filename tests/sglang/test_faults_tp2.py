"""Faults during an apply on a real SGLang engine at TP=2 (CPU, two scheduler processes, gloo),
the scenario of stitch_dev/engine_faults.py: a rank raising mid-write (rank 1) and after its whole
write (rank 0), rank 1 hanging mid-write past STITCH_RPC_TIMEOUT (rank 0 waits for it in the
RPC's all-gather, so the whole engine waits), and the whole engine SIGKILLed mid-apply and
restarted. One engine for the module (started again once, by the last test); the records go to
$STITCH_FAULTS_OUT when set."""

from __future__ import annotations

import asyncio
import os

import httpx
import pytest

if os.environ.get("STITCH_REQUIRE_SGLANG") != "1":
    pytest.importorskip("sglang", reason="run in the SGLang venv (scripts/dev.py test)")

from stitch_core.versions.board import LocalBoard  # noqa: E402
from stitch_core.versions.materialize import pull  # noqa: E402
from stitch_dev.engine_faults import FAULT_ENV, HANG, apply_fault, kill_mid_apply  # noqa: E402
from stitch_dev.tinymodel import build_tiny_model  # noqa: E402
from stitch_dev.trainer import AdamWTrainer  # noqa: E402

from .engines import Server  # noqa: E402

RUN = "sg-faults"


def send(client: httpx.Client, headers: dict) -> httpx.Response:
    """A small greedy native /generate (the probe's request)."""
    return client.post("/generate", headers=headers, json={
        "text": "Hello", "sampling_params": {"temperature": 0.0, "max_new_tokens": 2}})


@pytest.fixture(scope="module")
def stack(tmp_path_factory, nats_server):
    root = tmp_path_factory.mktemp("sglang-faults")
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
        # SGLang's own warm-up request kills the server on a non-200: let it pass before a
        # fault can make it a 409
        st["server"].wait_healthy(300)
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
    rec = apply_fault(stack["server"], stack["trainer"], stack["root"] / "board", RUN, "sglang",
                      send, fault, rank=rank, point=point, action=action, undone=undone,
                      **extra)
    rec.emit()
    assert rec.unproven_served == 0 and rec.lost == 0


def test_engine_sigkilled_mid_apply_restarts_and_catches_up(stack):
    n = {"i": 0}

    def restart() -> Server:
        n["i"] += 1
        stack["server"] = stack["start"](n["i"], wait=False)  # it catches up at once
        return stack["server"]

    server, rec = kill_mid_apply(stack["server"], restart, stack["trainer"],
                                 stack["root"] / "board", RUN, "sglang", send)
    stack["server"] = server
    rec.emit()
    assert rec.unproven_served == 0 and rec.lost == 0
