#!/usr/bin/env python3
"""Fault suite: what a follower does when things break, with real parts, one table.

    .venv/bin/python benchmarks/faults.py [--json] [--only NAME,...] [--reconcile 2]
    .venv/bin/python benchmarks/faults.py --engines    # + the real vLLM / SGLang rows

Every row builds a fresh rig on this machine: a real ``Publisher`` (stitch_trainer) writing a
LocalBoard directory and announcing on a real ``nats-server`` (``NatsServer``); that directory
served over HTTP by ``stitch_core.versions.board.serve`` in a thread (its ``BoardHandler``
subclassed to answer 5xx, answer slowly, or drop connections); and one engine-shaped follower: a
``Follower`` (HTTP board + NATS) driving a ``Coordinator`` over two in-process ``RankReplica``s of
the TP=2 toy engine of ``stitch_dev/toy_engine.py`` (fused, sharded, padded, one loader-transformed
tensor), with a ``VersionGate`` wired as ``stitch_core.node.EngineFollower`` wires it. The trainer
publishes precomputed AdamW versions of the toy model (``views[k]`` after k steps), so every
version's true bits are known to the harness independently of the board. The rig is
``stitch_dev.fault_rig`` (tests/test_fault_suite.py runs some of its rows, shorter).

**Served from an unproven state.** An engine-step loop runs beside the follower, as an engine's
API server and scheduler would: every ~5 ms it asks ``gate.admit()`` for an unpinned request;
an admitted request then runs one engine step, which waits while the coordinator holds engine
steps (its ``pause``/``resume`` hooks, as ``STITCH_PAUSE_STEPS`` does), and at the instant the
step runs the loop checks that (a) the coordinator's last check ``check["ok"]`` is True, (b)
the coordinator holds a version and the gate says the same one, (c) the coordinator's
fingerprints are the publisher's fingerprints of that version (computed here from the view, not
read from the board), and (d) every parameter of both ranks is bit-identical to a fresh TP=2 toy
engine loaded with that version's view. A request whose step runs while any of (a)-(d) fails
counts as served from an unproven state. Requests the gate refuses (``not_ready``) are not
served and are counted separately.

**Seconds to next good version.** From the row's reference instant (stated per row: the fault's
end, or the publish of the next good version) to the first instant the follower holds the row's
target version (the newest good version published by then), proven as above.

**Versions lost.** Versions published after the fault ended that the follower had not reached
when the row ended (it waits up to ``--settle`` s for them), plus any version it ever served
with bits other than the publisher's view. A row whose follower never recovers says so ("stuck
at vN") with the follower's own last error.

Times scale with the follower's reconcile interval (``--reconcile``, 2 s here; engines default to
``STITCH_RECONCILE_INTERVAL`` = 5 s) and the rank RPC timeout (``--rpc-timeout``, 1 s here;
``STITCH_RPC_TIMEOUT`` = 300 s by default). With ``--engines`` the rows of the real engines come
from ``tests/engines/test_tp2_faults.py``, run by each engine venv's pytest with
``STITCH_ENGINE`` and ``STITCH_FAULTS_OUT`` set (one JSON line per row).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the checkout first: measure this tree's stitch_core, not a wheel installed in the venv
# (the rig, stitch_dev, comes from here too)
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from stitch_dev.fault_rig.rig import Row, short  # noqa: E402
from stitch_dev.fault_rig.scenarios import scenarios  # noqa: E402
from stitch_dev.fault_rig.truth import N_VIEWS, Truth, make_views  # noqa: E402

log = logging.getLogger("faults")
ENGINE_ROWS = [("TP=2 rank raises mid-write", e) for e in ("vLLM", "SGLang")] + \
    [("TP=2 rank hangs mid-write", e) for e in ("vLLM", "SGLang")] + \
    [("engine SIGKILL mid-apply + restart", e) for e in ("vLLM", "SGLang")]


# ---------------------------------------------------------------- engines (--engines)

def engine_notes(d: dict) -> str:
    """A record's details in a sentence (the keys stitch_dev/engine_faults.py writes; others
    as is)."""
    parts = []
    if isinstance(d.get("answers"), dict):
        parts.append("probe answers " + ", ".join(f"{k} x{v}" for k, v in d["answers"].items()))
    if "undone" in d:
        parts.append("undone and the old version proven" if d["undone"] else
                     "not provable: not_ready until a snapshot load was proven")
    if "abort_to_next_good_s" in d:
        parts.append(f"abort -> next good {d['abort_to_next_good_s']:.2f} s")
    if d.get("error"):
        parts.append(f"error \"{short(d['error'], 90)}\"")
    known = {"answers", "undone", "abort_to_next_good_s", "error", "observed_s"}
    parts += [f"{k} {short(json.dumps(v), 60)}" for k, v in d.items() if k not in known][:4]
    return "; ".join(parts)


def read_engine_rows(path: Path) -> list[Row]:
    """Rows from the JSON lines the engine tests append to $STITCH_FAULTS_OUT."""
    rows = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError, KeyError):
            d = json.loads(line)
            details = d.get("details") or {}
            notes = d.get("notes") or engine_notes(details)
            rows.append(Row(d["fault"], d.get("seconds_to_next_good"),
                            d.get("unproven_served"), d.get("lost"), notes,
                            engine=d["engine"], extra={"details": details}))
    return rows


def engine_rows(args) -> list[Row]:
    out = Path(tempfile.mkdtemp(prefix="stitch-faults-engines-")) / "rows.jsonl"
    print(f"engine rows: {out}", file=sys.stderr, flush=True)
    test = ROOT / "tests/engines/test_tp2_faults.py"
    runs = [("vLLM", ROOT / ".venv-vllm", test,
             {"STITCH_ENGINE": "vllm", "STITCH_REQUIRE_VLLM": "1"}),
            ("SGLang", ROOT / ".venv-sglang", test,
             {"STITCH_ENGINE": "sglang", "STITCH_REQUIRE_SGLANG": "1", "STITCH_REQUIRE_VLLM": "1",
              "STITCH_VLLM_PYTHON": str(ROOT / ".venv-vllm/bin/python")})]
    missing: list[Row] = []
    for engine, venv, test, extra in runs:
        py = venv / "bin" / "python"
        if not test.exists() or not py.exists():
            why = f"{test.relative_to(ROOT)} not present" if not test.exists() else \
                f"{venv.name} not built (scripts/dev.py test builds it)"
            missing += [Row(f, None, None, None, why, engine=e) for f, e in ENGINE_ROWS
                        if e == engine]
            continue
        env = dict(os.environ, STITCH_FAULTS_OUT=str(out),
                   PATH=f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}", **extra)
        base = Path(tempfile.mkdtemp(prefix=f"stitch-faults-{engine.lower()}-"))
        print(f"running {test.relative_to(ROOT)} with {py.relative_to(ROOT)}", file=sys.stderr,
              flush=True)
        r = subprocess.run([str(py), "-m", "pytest", "-q", "-x", str(test), f"--basetemp={base}",
                            "-p", "no:cacheprovider"], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=args.engine_timeout)
        if r.returncode != 0:
            tail = short(" ".join((r.stdout + r.stderr).splitlines()[-3:]), 160)
            missing.append(Row(f"{test.name} failed", None, None, None, tail, engine=engine))
    rows = read_engine_rows(out) if out.exists() else []
    return rows + missing


# ---------------------------------------------------------------- the table

def fmt_s(x: float | None) -> str:
    return "not reached" if x is None else f"{x:.2f}"


def table(rows: list[Row]) -> str:
    lines = ["| fault | engine | seconds to next good version | served from unproven state | "
             "versions lost | notes |", "|---|---|---|---|---|---|"]
    for r in rows:
        un = "—" if r.unproven is None else str(r.unproven)
        lost = "—" if r.lost is None else str(r.lost)
        secs = "—" if r.unproven is None and r.seconds is None else fmt_s(r.seconds)
        lines.append(f"| {r.fault} | {r.engine} | {secs} | {un} | {lost} | "
                     f"{r.notes.replace('|', '/')} |")
    return "\n".join(lines)


async def run_all(args) -> list[Row]:
    views = await asyncio.to_thread(make_views, N_VIEWS)
    table_ = scenarios(views)
    names = args.only.split(",") if args.only else list(table_)
    work = Path(tempfile.mkdtemp(prefix="stitch-faults-"))
    rows = []
    try:
        for name in names:
            t0 = time.perf_counter()
            truth = Truth(views)
            try:
                row = await table_[name](work, truth, args)
            except Exception as e:  # noqa: BLE001 - a broken rig is a row too, never hidden
                log.exception("%s failed", name)
                row = Row(name, None, None, None, f"harness error: {type(e).__name__}: {e}")
            row.extra["wall_s"] = round(time.perf_counter() - t0, 1)
            print(f"[{row.extra['wall_s']:5.1f} s] {row.fault}: {fmt_s(row.seconds)} s, "
                  f"unproven {row.unproven}, lost {row.lost}", file=sys.stderr, flush=True)
            rows.append(row)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    ap.add_argument("--only", default="", help="comma-separated scenario keys")
    ap.add_argument("--list", action="store_true", help="list the scenario keys")
    ap.add_argument("--engines", action="store_true",
                    help="also run the real vLLM / SGLang fault tests (engine venvs)")
    ap.add_argument("--engine-timeout", type=float, default=1800)
    ap.add_argument("--engine-rows", default="",
                    help="take the engine rows from this JSON-lines file (an earlier "
                         "STITCH_FAULTS_OUT) instead of running the engine tests")
    ap.add_argument("--reconcile", type=float, default=2.0, help="follower reconcile interval")
    ap.add_argument("--rpc-timeout", type=float, default=1.0, help="coordinator rank RPC timeout")
    ap.add_argument("--fault-window", type=float, default=3.0,
                    help="seconds a bad patch stays on the board before it is restored")
    ap.add_argument("--outage", type=float, default=6.0, help="board outage seconds")
    ap.add_argument("--slow", type=float, default=1.5, help="seconds per board response when slow")
    ap.add_argument("--settle", type=float, default=20.0,
                    help="seconds to wait for a version before calling it not reached")
    ap.add_argument("--md", default="", help="also write the report to this file")
    ap.add_argument("-v", "--verbose", action="store_true")
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO if a.verbose else logging.CRITICAL,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if a.list:
        print("\n".join(scenarios([])))
        return
    t0 = time.perf_counter()
    torch.set_num_threads(1)
    rows = asyncio.run(run_all(a))
    if a.engine_rows:
        rows += read_engine_rows(Path(a.engine_rows))
    elif a.engines:
        rows += engine_rows(a)
    else:
        rows += [Row(f, None, None, None, "run with --engines", engine=e) for f, e in ENGINE_ROWS]
    wall = time.perf_counter() - t0
    if a.json:
        print(json.dumps([r.__dict__ for r in rows], indent=1, default=str))
        return
    load = os.getloadavg()[0]
    text = [f"$ {' '.join([Path(sys.executable).name, *sys.argv])}",
            f"cpus={os.cpu_count()} load={load:.2f} torch={torch.__version__} "
            f"reconcile={a.reconcile:g}s rpc_timeout={a.rpc_timeout:g}s wall={wall:.0f}s", "",
            table(rows)]
    served = sum(r.served for r in rows)
    refused = sum(r.refused for r in rows)
    text += ["", f"engine-step loop (toy rows): {served:,} requests admitted and checked, "
                 f"{refused:,} refused not_ready"]
    bad = [r for r in rows if isinstance(r.unproven, int) and r.unproven]
    if bad:
        text.append(f"UNPROVEN STATE SERVED in: {', '.join(r.fault for r in bad)}")
    print("\n".join(text))
    if a.md:
        Path(a.md).write_text("\n".join(text) + "\n")


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    main()
