"""Process helpers shared by the engine tests and tests/sglang/smoke.py (standard library only,
so the smoke script can run on its own): a free port, and stopping a server's process group."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def stop(proc: subprocess.Popen, grace: float = 30.0, signal_group: bool = False) -> None:
    """SIGTERM the server (only its leader, or its whole group with `signal_group`), wait for its
    process group to empty, SIGKILL whatever is left after `grace` seconds. The server must have
    been started with start_new_session=True. SGLang's launcher stops its own schedulers and
    detokenizer; signalling its whole group makes it treat their exit as a crash (SIGQUIT
    diagnostics, 5 s sleep)."""
    pgid = proc.pid  # the leader of its own group
    if proc.poll() is None:
        if signal_group:
            os.killpg(pgid, signal.SIGTERM)
        else:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and _group_alive(pgid):
        proc.poll()  # reap the leader so that the group can empty
        time.sleep(0.2)
    if _group_alive(pgid):
        os.killpg(pgid, signal.SIGKILL)
    proc.wait()
