"""The fault rig of the real engines: faults during an apply on a real TP=2 engine, the scenario
both engine suites run (tests/engines/test_tp2_faults.py, once per engine).

The engine runs with STITCH_FAILPOINTS=1 (so `POST /stitch/debug/arm` arms a rank's failpoint,
stitch_core.engine.failpoints) and a short STITCH_RPC_TIMEOUT. For each fault the trainer
publishes the next version, which the engine fails to apply; meanwhile `Probe` threads send
requests back to back (unpinned, and pinned to the new version; neither waits) and record every
answer. What each fault must show:

* no answer is a 200 from an unproven state (`Probe.unproven`): every 200 carries a start and
  an end version; none was admitted at the new version before the engine proved it (its commit
  time, `last_apply_time`); and where the old version could not be proven after the abort, none
  was answered between the abort and the next proof (requests admitted before stay frozen, steps
  held). A 200 completing while an apply runs is stamped version_end = the version being applied
  (an upper bound, docs/protocol.md: no tokens come from it, steps are held), so an end version
  alone is no claim;
* the engine serves the new version afterwards, proven on every rank (`/stitch/verify`) against
  a manifest whose fingerprints are the trainer's weights (bit-exact), no version lost.

Recorded per fault (printed, and appended as a JSON line to $STITCH_FAULTS_OUT when set):
``{"fault", "engine", "seconds_to_next_good", "unproven_served", "lost"}`` plus details.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from stitch_core.format import fingerprint as fpr
from stitch_core.versions.board import LocalBoard
from stitch_core.versions.store import read_manifest

from .procs import group_alive
from .server import ServerProcess, verify_clean
from .trainer import AdamWTrainer

ARM_PATH = "/stitch/debug/arm"
RPC_TIMEOUT = 4  # STITCH_RPC_TIMEOUT of the engines under test
HANG = 15.0  # a hung rank's sleep: beyond the Write's and the Undo's timeouts (2 x RPC_TIMEOUT)
# a request's JSON body -> the response; the engine suites give one per engine (small, greedy)
Send = Callable[[httpx.Client, dict], httpx.Response]

FAULT_ENV = {"failpoints": "1", "rpc_timeout": str(RPC_TIMEOUT), "reconcile_interval": "1",
             "verify_cooldown": "0"}


@dataclass
class Answer:
    t: float  # wall clock when the answer was complete
    status: int
    pinned: bool
    start: int | None = None
    end: int | None = None
    reason: str | None = None


class Probe:
    """Threads sending requests back to back through `send` while a fault runs, alternately
    unpinned and pinned to `pinned` (no X-Stitch-Wait), each answer recorded: two wait as long as
    an answer takes (requests frozen by a fault come back when it ends), two give up after
    `SHORT` s (they keep asking while the others are frozen)."""

    SHORT = 3.0

    def __init__(self, url: str, send: Send, pinned: int, headers: dict | None = None):
        self.url, self.send, self.pinned, self.headers = url, send, pinned, headers or {}
        self.answers: list[Answer] = []
        self.errors = 0  # no HTTP answer (the engine down or restarting)
        self.gave_up = 0  # no answer within SHORT s
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, args=(i, t), daemon=True)
                         for i, t in enumerate((300.0, 300.0, self.SHORT, self.SHORT))]

    def __enter__(self) -> Probe:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(300)

    def _loop(self, i: int, timeout: float) -> None:
        n, client = i, None
        while not self._stop.is_set():
            if client is None or str(client.base_url).rstrip("/") != self.url:
                if client is not None:
                    client.close()
                client = httpx.Client(base_url=self.url, timeout=timeout, headers=self.headers)
            pinned = n % 2 == 1
            n += 1
            h = {"X-Stitch-Version": str(self.pinned)} if pinned else {}
            try:
                r = self.send(client, h)
            except httpx.TimeoutException:
                self.gave_up += 1
                continue
            except httpx.HTTPError:
                self.errors += 1
                time.sleep(0.2)
                continue
            a = Answer(time.time(), r.status_code, pinned)
            try:
                body = r.json()
            except ValueError:
                body = {}
            body = body if isinstance(body, dict) else {}
            if r.status_code == 200:
                st = body.get("stitch") or {}
                a.start, a.end = st.get("version_start"), st.get("version_end")
            else:
                err = body.get("error")
                a.reason = err.get("reason") if isinstance(err, dict) else None
            self.answers.append(a)
            time.sleep(0.05)
        if client is not None:
            client.close()

    def unproven(self, new: int, proven_at: float,
                 unproven_from: float | None = None, reproven_at: float | None = None
                 ) -> list[Answer]:
        """200s from an unproven state (the engine's clock is ours): a start or end version
        missing; admitted at `new` before the engine proved it (`proven_at`); answered while no
        version was proven (`unproven_from`, `reproven_at`), if there was such a time."""
        return [a for a in self.answers if a.status == 200 and (
            a.start is None or a.end is None or (a.start == new and a.t < proven_at)
            or (unproven_from is not None and reproven_at is not None
                and unproven_from < a.t < reproven_at))]

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {"errors": self.errors, "gave_up": self.gave_up}
        for a in self.answers:
            k = "200" if a.status == 200 else f"{a.status} {a.reason}"
            out[k] = out.get(k, 0) + 1
        return out


@dataclass
class FaultRecord:
    fault: str
    engine: str
    seconds_to_next_good: float
    unproven_served: int
    lost: int
    details: dict = field(default_factory=dict)

    def emit(self) -> None:
        line = json.dumps(asdict(self))
        print(f"\nfault record: {line}")
        out = os.environ.get("STITCH_FAULTS_OUT")
        if out:
            with open(out, "a") as f:
                f.write(line + "\n")


def arm(server: ServerProcess, rank: int | None, point: str = "write", action: str = "raise",
        **kw) -> dict:
    r = server.http.post(ARM_PATH, json={"rank": rank, "point": point, "action": action, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def wait_for(cond: Callable[[dict], bool], server: ServerProcess, timeout: float,
             what: str) -> dict:
    deadline = time.monotonic() + timeout
    st: dict = {}
    while time.monotonic() < deadline:
        server._alive()
        try:
            st = server.status()
        except (httpx.HTTPError, ValueError):
            st = {}
        if st and cond(st):
            return st
        time.sleep(0.1)
    raise AssertionError(f"{what}: not after {timeout} s: {st}\n{server.tail()}")


def check_latest(server: ServerProcess, trainer: AdamWTrainer, board_dir: Path, run: str,
                 v: int, send: Send) -> None:
    """The engine serves `v`, proven on every rank against v's manifest, whose fingerprints are
    the trainer's weights: the engine holds them bit for bit. A request pinned to v is a 200."""
    verify_clean(server)
    m = asyncio.run(read_manifest(LocalBoard(board_dir), run, v))
    with trainer.lock:
        assert m.fingerprints == fpr.state_fingerprints(trainer.view())
    st = server.status()
    assert st["version"] == v and st["state"] == "serving" and not st["steps_held"], st
    r = send(server.http, {"X-Stitch-Version": str(v)})
    assert r.status_code == 200 and r.json()["stitch"]["version_end"] == v, r.text


def apply_fault(server: ServerProcess, trainer: AdamWTrainer, board_dir: Path, run: str,
                engine: str, send: Send, fault: str, *, rank: int, point: str, action: str,
                undone: bool, **arm_kw) -> FaultRecord:
    """Arm rank `rank`'s failpoint, publish the next version and follow the engine through the
    failure (undone and the old version proven: `undone`; else not_ready until a snapshot load
    is proven) to serving that version; the record."""
    old = server.status()["version"]
    armed = arm(server, rank, point, action, **arm_kw)
    assert any(r["armed"] for r in armed["ranks"]), armed
    with Probe(server.url, send, old + 1, dict(server.http.headers)) as probe:
        v = trainer.publish()
        t_board = time.time()  # v is on the board (the engine may have started applying it)
        assert v == old + 1
        st = wait_for(lambda s: (s.get("last_abort") or {}).get("version") == v, server,
                      120, f"v{v} failing ({fault})")
        failure = st["last_abort"]
        t_pub = min(t_board, failure["at"])
        assert failure["undone"] is undone, failure
        if not undone:  # nothing proven: requests refused, steps held (frozen, not served)
            assert st["version"] in (None, old), st
            if st["version"] is None:
                assert st["steps_held"] is True, st
        st = wait_for(lambda s: s.get("version") == v and s.get("state") == "serving", server,
                      240, f"v{v} served after {fault}")
        served_at = time.time()
        time.sleep(1.0)  # answers frozen during the fault come back now
    proven_at = st["last_apply_time"]
    reproven_at = None
    if not undone:  # the snapshot load that proved a version again
        check = st["fingerprint_check"]
        assert check["ok"] is True and check["kind"] == "snapshot", check
        reproven_at = check["at"]
    bad = probe.unproven(v, proven_at, failure["at"], reproven_at)
    counts = probe.counts()
    assert bad == [], (fault, bad[:5], counts)
    assert counts.get("200", 0) > 0, counts  # the probe did get answers (not all refused)
    if not undone:
        assert counts.get("409 not_ready", 0) > 0, counts  # it stopped admitting
    left = arm(server, None, action="off")  # it fired (times=1): nothing left armed
    assert all(r["armed"] == [] for r in left["ranks"]), left
    check_latest(server, trainer, board_dir, run, v, send)
    # from the faulty version on the board (the engine starts applying it at once) to serving
    # it, proven; and from the abort (undo + proof, or giving up on proving) to serving it
    return FaultRecord(fault, engine, round(proven_at - t_pub, 3), len(bad),
                       v - server.status()["version"],
                       {"answers": counts, "error": failure["error"][:200],
                        "undone": failure["undone"],
                        "abort_to_next_good_s": round(proven_at - failure["at"], 3),
                        "observed_s": round(served_at - t_pub, 3)})


def sigkill(server: ServerProcess, timeout: float = 60.0) -> None:
    """SIGKILL the server's whole process group (every engine process at once), wait until it
    is empty, close the helper's handles."""
    pgid = server.proc.pid
    os.killpg(pgid, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and group_alive(pgid):
        server.proc.poll()
        time.sleep(0.1)
    server.stop(grace=1.0)


def kill_mid_apply(server: ServerProcess, restart: Callable[[], ServerProcess],
                   trainer: AdamWTrainer, board_dir: Path, run: str, engine: str, send: Send
                   ) -> tuple[ServerProcess, FaultRecord]:
    """Rank 1 hangs mid-write; the whole engine is SIGKILLed while it hangs and started again
    (`restart`: same pulled directory, same board). The restarted engine proves its start-up and
    catches up to the version it was applying. The new server and the record."""
    old = server.status()["version"]
    arm(server, 1, "write", "hang", seconds=600)
    with Probe(server.url, send, old + 1, dict(server.http.headers)) as probe:
        v = trainer.publish()
        wait_for(lambda s: s.get("applying_to") == v or (s.get("last_abort") or {})
                 .get("version") == v, server, 120, f"v{v} applying")
        time.sleep(1.0)  # inside the hung write
        t_kill = time.time()
        sigkill(server)
        server = restart()
        probe.url = server.url  # the restarted engine's answers too
        st = wait_for(lambda s: s.get("version") == v and s.get("state") == "serving", server,
                      600, f"v{v} served after the restart")
        served_at = time.time()
        time.sleep(1.0)
    check = st["fingerprint_check"]  # the restarted engine's start-up proof
    assert check["ok"] is True and check["kind"] == "full", st
    # same model, code and cache directory: every rank read its layout from the layout cache
    assert check.get("layout_cached") is True, check
    print(f"restart: layout read from the cache in {check['layout_s']:.2f} s, proof "
          f"{check['seconds']:.2f} s")
    bad = probe.unproven(v, st["last_apply_time"])
    assert bad == [], bad[:5]
    check_latest(server, trainer, board_dir, run, v, send)
    rec = FaultRecord("sigkill-mid-apply", engine, round(st["last_apply_time"] - t_kill, 3),
                      len(bad), v - server.status()["version"],
                      {"answers": probe.counts(), "observed_s": round(served_at - t_kill, 3)})
    return server, rec
