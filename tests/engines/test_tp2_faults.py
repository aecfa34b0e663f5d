"""Faults during an apply on a real engine at TP=2 (CPU, two worker / scheduler processes, gloo),
the scenario of stitch_dev/engine_faults.py: a rank raising mid-write (rank 1) and after its whole
write (rank 0), rank 1 hanging mid-write past STITCH_RPC_TIMEOUT (SGLang: rank 0 waits for it in
the RPC's all-gather, so the whole engine waits), and the whole engine SIGKILLed mid-apply and
restarted. The session's TP=2 engine (conftest `tp2`; started again once, by the last test, and
then followed on by test_tp_follow.py's shared case); the records go to $STITCH_FAULTS_OUT when
set.
"""

from __future__ import annotations

import pytest

from stitch_dev.engine_faults import HANG, apply_fault, kill_mid_apply

FAULTS = [  # name, rank, point, action, undone, extra
    ("rank1-raise-mid-write", 1, "write", "raise", True, {}),
    ("rank0-raise-after-write", 0, "written", "raise", True, {}),
    ("rank1-hang-mid-write", 1, "write", "hang", False, {"seconds": HANG}),
]


@pytest.mark.parametrize(("fault", "rank", "point", "action", "undone", "extra"), FAULTS,
                         ids=[f[0] for f in FAULTS])
def test_fault_mid_apply_never_serves_unproven_and_recovers(engine, tp2, fault, rank, point,
                                                            action, undone, extra):
    server = tp2["server"]
    rec = apply_fault(server, tp2["trainer"], tp2["root"] / "board", tp2["run"], engine.name,
                      engine.sender(server.model), fault, rank=rank, point=point,
                      action=action, undone=undone, **extra)
    rec.emit()
    assert rec.unproven_served == 0 and rec.lost == 0


def test_engine_sigkilled_mid_apply_restarts_and_catches_up(engine, tp2):
    n = {"i": 0}

    def restart():
        n["i"] += 1
        tp2["server"] = tp2["start"](n["i"], wait=False)  # it catches up at once
        return tp2["server"]

    server, rec = kill_mid_apply(tp2["server"], restart, tp2["trainer"], tp2["root"] / "board",
                                 tp2["run"], engine.name, engine.sender(tp2["server"].model))
    tp2["server"] = server
    rec.emit()
    assert rec.unproven_served == 0 and rec.lost == 0
