"""The faults of the fault rig, one coroutine per kind: a bad patch or manifest on the board, a
TP rank that raises / hangs / is lost mid-write, a nats-server restart or outage, an HTTP board
outage, a persistently bad object, a trainer SIGKILLed mid-publish. Each builds a fresh ``Rig``
and returns its ``Row``; the reference instant of each is said in its docstring."""

from __future__ import annotations

import asyncio
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from stitch_core.engine import rpc as rpc_
from stitch_core.versions.manifest import Manifest

from .rig import Rig, Row, gist, short, since, started
from .tamper import corrupt, manifest_key_of
from .truth import RUN, Truth

ROOT = Path(__file__).resolve().parents[2]  # the checkout (the killed trainer's sys.path)


SNAPSHOT_EVERY = 6  # the trainer's snapshot_every in the rows that need a later snapshot


async def bad_patch(name: str, make: Callable[[Rig, int], Callable[[bytes], bytes]] | None,
                    work: Path, truth: Truth, args, *, pad: int | None = None,
                    what: str, repair: bool = False) -> Row:
    """v3's patch (or manifest) as the trainer's upload path writes it is bad, with a manifest
    consistent with the bad bytes (so the engine's own checks, not the fetch's hash, must refuse
    it). The trainer goes on publishing every second (patches from its true v3) up to its next
    snapshot (v6, snapshot_every=6): the reference is that snapshot's publish. With `repair`
    there is no snapshot: the good objects are put back after `--fault-window` s (the
    reference)."""
    rig = Rig(name, work, truth, args, snapshot_every=0 if repair else SNAPSHOT_EVERY)
    try:
        n = 3  # started() leaves the follower at v2
        bad = await asyncio.to_thread(make, rig, n) if make is not None else None
        have = await started(rig)
        assert have + 1 == n
        if bad is not None:
            rig.board.bad[n] = bad
        if pad is not None:
            rig.board.pad_manifest[n] = pad
        v = await rig.publish()
        if repair:
            await asyncio.sleep(1.0)
            target = await rig.publish()  # v4: a patch from the true v3
            await asyncio.sleep(args.fault_window)
            t_ref = time.perf_counter()
            await asyncio.to_thread(rig.board.restore)
            how = "the good objects put back on the board after the fault window"
        else:
            while v % SNAPSHOT_EVERY:
                await asyncio.sleep(1.0)
                t_ref = time.perf_counter()
                v = await rig.publish()
            target = v
            how = f"the trainer's next snapshot v{v} (published every second, snapshot_every=6)"
        held_during = rig.held
        t = await rig.wait_held(target, args.settle)
        after = [await rig.publish() for _ in range(2)]
        lost, note = await rig.settle(after, args.settle if t is not None else 3.0)
        assert rig.follower is not None
        if t is None and n in getattr(rig.follower, "avoid", {}):
            from stitch_core.versions import follower as follower_mod

            note += (f"; v{n} is on the follower's avoid list after "
                     f"{getattr(follower_mod, 'BAD_AFTER', '?')} failures: not tried again "
                     f"for AVOID_TTL = {getattr(follower_mod, 'AVOID_TTL', float('nan')):g} s")
        said = "; ".join(f'"{short(gist(e), 100)}"' for e in rig.errors[:2]) or "nothing"
        notes = (f"{what}; held v{held_during} meanwhile, follower said {said}; "
                 f"next good: {how}")
        return rig.row(name, since(t, t_ref), lost, "; ".join(x for x in (notes, note) if x))
    finally:
        await rig.close()



async def rank_fault(name: str, kind: str, work: Path, truth: Truth, args) -> Row:
    """Rank 1 raises / hangs on the write of vN (once), or ("lost") fails its write and answers
    nothing for 2 s (the undo cannot be proven). Reference: the fault (the write)."""
    state = {"armed": False, "at": None, "until": 0.0}

    def fault(rank: int, req) -> str | None:
        if rank != 1:
            return None
        if kind == "lost" and time.perf_counter() < state["until"]:
            return "raise"
        if state["armed"] and isinstance(req, rpc_.Write):
            state["armed"] = False
            state["at"] = time.perf_counter()
            if kind == "lost":
                state["until"] = state["at"] + 2.0
                return "raise"
            return kind
        return None

    rig = Rig(name, work, truth, args, rpc_fault=fault)
    try:
        await started(rig)
        state["armed"] = True
        n = await rig.publish()
        t = await rig.wait_held(n, args.settle)
        ref = state["at"] if state["at"] is not None else time.perf_counter()
        if kind == "lost":
            ref = state["until"]  # from the rank's return
        after = [await rig.publish() for _ in range(2)]
        lost, note = await rig.settle(after)
        how = {"raise": "rank 1 raised in its write: undone on every rank, previous version "
                        "proven, applied on the next tick",
               "hang": f"rank 1 never answered its write: RPC timeout {args.rpc_timeout:g} s, "
                       "undone, proven, applied on the next tick",
               "lost": "rank 1 failed its write and answered nothing for 2 s: undo unprovable "
                       "-> not_ready, snapshot reloaded and chain replayed once it was back"}[kind]
        return rig.row(name, since(t, ref), lost, "; ".join(x for x in (how, note) if x))
    finally:
        await rig.close()


async def nats_restart(name: str, work: Path, truth: Truth, args, *, down: float,
                       at_start: bool = False) -> Row:
    """The nats-server is stopped for `down` s (same port and store directory when it comes
    back) while the trainer publishes every second; `at_start`: it is down when the follower
    starts. Reference: each publish during the outage (median) and the restart."""
    rig = Rig(name, work, truth, args)
    try:
        if at_start:
            await rig.start_infra()
            rig.new_publisher()
            await rig.publish()
            await rig.nats_stop()
            await rig.start_engine(0)
        else:
            await started(rig)
            await rig.nats_stop()
        t_down = time.perf_counter()
        during: list[tuple[int, float]] = []
        while time.perf_counter() - t_down < down:
            t0 = time.perf_counter()
            v = await rig.publish(wait=False)
            during.append((v, t0))
            await asyncio.sleep(1.0)
        await rig.nats_start()
        t_up = time.perf_counter()
        lat, board_lat = [], []
        for v, t0 in during:
            t = await rig.wait_held(v, args.settle)
            at = rig.reached_at(v)
            if t is not None and at is not None:
                lat.append(at - t0)
                if v in rig.on_board:
                    board_lat.append(at - rig.on_board[v])
        # after NATS is back: when does the follower hear announcements again?
        heard = None
        after: list[int] = []
        assert rig.follower is not None
        while time.perf_counter() - t_up < 15.0:
            await asyncio.sleep(1.0)
            v_after = await rig.publish()
            after.append(v_after)
            await rig.wait_held(v_after, args.settle)
            h = next((h for h in rig.follower.history if h["version"] == v_after), None)
            if h is not None and h.get("announced_at") is not None:
                heard = (v_after, h["announced_at"] - t_up, h["current_at"] - h["announced_at"])
                break
        lost, note = await rig.settle(after)
        failed = [v for v, _ in rig.failed_publishes]
        notes = (f"{len(during)} versions published during the {down:g} s outage, reached by "
                 f"board polling in median {statistics.median(lat):.2f} s after publish() "
                 f"({statistics.median(board_lat):.2f} s after they landed on the board)"
                 if lat and board_lat else "no version reached during the outage")
        if heard:
            notes += (f"; announcements heard again {heard[1]:.1f} s after NATS was back (v"
                      f"{heard[0]}: announce -> current {1e3 * heard[2]:.0f} ms)")
        else:
            notes += "; no announcement heard within 15 s after NATS was back (board polling only)"
        if failed:
            notes += (f"; trainer: {len(failed)} of {len(during)} publishes reported failed "
                      f"though on the board ({short(rig.failed_publishes[0][1], 60)})")
        secs = statistics.median(lat) if lat else None
        return rig.row(name, secs, lost, "; ".join(x for x in (notes, note) if x))
    finally:
        await rig.close()


async def board_outage(name: str, mode: str, work: Path, truth: Truth, args) -> Row:
    """The HTTP board answers 503 / refuses connections / answers every request `--slow` s
    late, for `--outage` s, while the trainer publishes. Reference: the outage's end."""
    rig = Rig(name, work, truth, args)
    try:
        have = await started(rig)
        if mode == "refused":
            await asyncio.to_thread(rig.http.stop)
        else:
            rig.http.faults.update(mode=mode, delay=args.slow)
        t0 = time.perf_counter()
        published = []
        while time.perf_counter() - t0 < args.outage:
            published.append(await rig.publish())
            await asyncio.sleep(1.0)
        held_during = rig.held
        err = rig.follower.last_error if rig.follower else None
        if mode == "refused":
            await asyncio.to_thread(rig.http.start)
        else:
            rig.http.faults.clear()
        t_end = time.perf_counter()
        t = await rig.wait_held(published[-1], args.settle)
        after = [await rig.publish() for _ in range(2)]
        lost, note = await rig.settle(after)
        moved = (held_during or 0) - have
        notes = (f"{len(published)} versions published during the {args.outage:g} s outage; the "
                 f"follower moved {moved} version(s) meanwhile and served v{held_during}"
                 + (f" (follower: \"{short(err, 90)}\")" if err else ""))
        return rig.row(name, since(t, t_end), lost, "; ".join(x for x in (notes, note) if x))
    finally:
        await rig.close()


async def persistent_bad(name: str, work: Path, truth: Truth, args) -> Row:
    """vN's patch object is damaged on the board for good (the manifest keeps the true hash);
    the trainer goes on and publishes a snapshot (snapshot_every) a few versions later.
    Reference: the snapshot's publish."""
    every = 6
    rig = Rig(name, work, truth, args, snapshot_every=every)
    try:
        have = await started(rig)
        n = have + 1
        rig.board.consistent = False
        rig.board.bad[n] = corrupt
        v = await rig.publish()
        while v % every:
            await asyncio.sleep(1.0)
            t_snap = time.perf_counter()
            v = await rig.publish()
        t = await rig.wait_held(v, args.settle)
        after = [await rig.publish() for _ in range(2)]
        lost, note = await rig.settle(after)
        m = await asyncio.to_thread(lambda: Manifest.model_validate_json(
            (rig.board_dir / manifest_key_of(RUN, v)).read_bytes()))
        has_patch = m.patch is not None
        carries = f" that also carries its patch from v{v - 1}" if has_patch else ""
        notes = (f"v{n}'s patch damaged on the board (SHA-256 mismatch on every fetch); v{v} is "
                 f"a snapshot{carries}")
        return rig.row(name, since(t, t_snap), lost, "; ".join(x for x in (notes, note) if x))
    finally:
        await rig.close()


TRAINER = """
import os, signal, sys, time
sys.path.insert(0, {root!r})
import torch
from stitch_core.versions.board import LocalBoard
from stitch_trainer.publisher import Publisher
board_dir, nats, views_file, first, last, kill_at = sys.argv[1:7]
first, last, kill_at = int(first), int(last), int(kill_at)
views = torch.load(views_file)

class Board(LocalBoard):
    async def move_latest(self, run, expected, latest):
        if latest.version == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)  # objects and manifest are up, latest is not
        return await super().move_latest(run, expected, latest)

pub = Publisher(Board(board_dir), {run!r}, "bf16", nats=nats or None)
for i in range(first, last + 1):
    info = pub.publish(i, views[i])
    m = info.result()
    print(f"published {{m.version}} {{i}} {{m.kind}} {{time.time()}}", flush=True)
pub.close()
"""


async def trainer_killed(name: str, work: Path, truth: Truth, args) -> Row:
    """A trainer process is SIGKILLed while publishing vN (objects and manifest uploaded,
    `latest` not moved); a new trainer process starts on the same board and publishes on.
    Reference: the restarted trainer's first publish."""
    rig = Rig(name, work, truth, args)
    script = rig.dir / "trainer.py"
    script.write_text(TRAINER.format(root=str(ROOT), run=RUN))
    views_file = rig.dir / "views.pt"
    torch.save(truth.views, views_file)

    async def trainer(first: int, last: int, kill_at: int) -> tuple[int, list[list[str]]]:
        p = await asyncio.create_subprocess_exec(
            sys.executable, str(script), str(rig.board_dir), rig.nats_url or "", str(views_file),
            str(first), str(last), str(kill_at), stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL)
        lines = []
        assert p.stdout is not None
        async for line in p.stdout:
            parts = line.decode().split()
            lines.append(parts)
            truth.published(int(parts[1]), int(parts[2]))
        return await p.wait(), lines

    try:
        await rig.start_infra()
        rc, _ = await trainer(0, 0, -1)  # v0
        await rig.start_engine(0)
        killed_at = 4
        rc, lines = await trainer(1, 6, killed_at)  # v1..v3 land, SIGKILL inside v4
        await rig.wait_held(killed_at - 1, args.settle)
        held_before = rig.held
        rc2, lines2 = await trainer(killed_at + 1, killed_at + 3, -1)  # the restarted trainer
        new = [int(x[1]) for x in lines2]
        seconds = None
        if new:
            await rig.wait_held(max(new), args.settle)
            at = rig.reached_at(new[0])  # perf_counter of the follower's step
            if at is not None:  # from the restarted trainer's first publish (wall clock)
                seconds = max(0.0, time.time() - (time.perf_counter() - at) - float(lines2[0][4]))
        lost, note = await rig.settle(new)
        kinds = ", ".join(f"v{x[1]} {x[3]}" for x in lines2)
        left = sorted(p.name for p in (rig.board_dir / RUN / "versions" /
                                       f"{killed_at:06d}").glob("*"))
        notes = (f"trainer exit {rc} (SIGKILL inside v{killed_at}'s publish, after "
                 f"{'+'.join(left) or 'nothing'}, before latest); follower held v{held_before}; "
                 f"restarted trainer (exit {rc2}) published {kinds} (v{killed_at} skipped: it "
                 "holds objects)")
        return rig.row(name, seconds, lost, "; ".join(x for x in (notes, note) if x))
    finally:
        await rig.close()
