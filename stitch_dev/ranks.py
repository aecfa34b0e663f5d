"""Run one process per rank for the multi-process (gloo, CPU) trainer tests and benchmarks; fail
with their logs if any rank fails or the group runs past its time."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import NoReturn


def rank_env(**extra: str) -> dict[str, str]:
    """This environment for rank processes: one OpenMP thread, gloo on loopback, `extra`."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **extra}
    if sys.platform == "linux":
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    return env


def run_ranks(work: Path, world: int, argv: Callable[[int], list[str]],
              env: Callable[[int], Mapping[str, str]], timeout: float,
              fail: Callable[[str], NoReturn] | None = None) -> None:
    """Start `argv(r)` with `env(r)` for every rank r, logs in WORK/rank{r}.log; wait for all.
    Stops the rest as soon as one rank fails or at `timeout`, then calls `fail` (a test passes
    pytest.fail; default: SystemExit) with the tails of every rank's log."""
    procs, logs = [], []
    try:
        for r in range(world):
            log = open(work / f"rank{r}.log", "w")  # noqa: SIM115 - closed below
            logs.append(log)
            procs.append(subprocess.Popen(argv(r), stdout=log, stderr=log, env=dict(env(r))))
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs):
            if any(p.poll() not in (None, 0) for p in procs) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
    codes = [p.returncode for p in procs]
    if codes != [0] * world:
        tails = "\n".join(
            f"--- rank {r} (exit {c}):\n" + (work / f"rank{r}.log").read_text()[-4000:]
            for r, c in enumerate(codes)
        )
        msg = f"workers failed or timed out: {codes}\n{tails}"
        if fail is None:
            raise SystemExit(msg)
        fail(msg)
