"""CLI verbs `stitch plan` (the steps a follower would take) and `stitch squash` (write spans)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
from pathlib import Path

from stitch_core.cli.keys import trust_set
from stitch_core.versions.board import open_board
from stitch_core.versions.materialize import default_cache_dir
from stitch_core.versions.squash import DEFAULT_HORIZON, KEEP_TARGETS, Squasher
from stitch_core.versions.store import VersionError, path_bytes, plan, read_latest
from stitch_core.versions.trust import SigningKey


def _version(text: str) -> int | None:
    if text in ("none", "-"):
        return None
    v = int(text)
    if v < 0:
        raise argparse.ArgumentTypeError("a version is >= 0")
    return v


def cmd_plan(a: argparse.Namespace) -> int:
    """`stitch plan`: print the steps a follower at --from would take to --to (default latest)."""
    async def go() -> tuple[int, list]:
        async with open_board(a.board) as board:
            trust = trust_set(a)
            to = a.to
            if to is None:
                latest = await read_latest(board, a.run, trust)
                if latest is None:
                    raise VersionError(f"run {a.run!r} has no versions on {board.url}")
                to = latest.version
            if a.from_ is not None and a.from_ >= to:
                return to, []
            return to, await plan(board, a.run, a.from_, to, a.max_chain, trust=trust,
                                  spans=not a.no_spans)

    to, steps = asyncio.run(go())
    rows = [{"kind": s.label, "from": s.base, "to": s.version, "bytes": s.bytes} for s in steps]
    total = path_bytes(steps)
    if a.json:
        print(json.dumps({"run": a.run, "from": a.from_, "to": to, "steps": rows,
                          "bytes": total}))
        return 0
    if not rows:
        print(f"{a.run}: v{a.from_} is already at or past v{to}: nothing to do")
        return 0
    print(f"{'kind':<9} {'from':>8} {'to':>8} {'bytes':>14}")
    for r in rows:
        src = "-" if r["from"] is None else r["from"]
        print(f"{r['kind']:<9} {src:>8} {r['to']:>8} {r['bytes']:>14,}")
    print(f"{len(rows)} step(s), {total:,} bytes")
    return 0


def cmd_squash(a: argparse.Namespace) -> int:
    """`stitch squash`: follow a run on its board and write spans to each new version."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    signer = SigningKey.load(a.sign) if a.sign else None
    cache = Path(a.cache_dir) if a.cache_dir else default_cache_dir()

    async def go() -> list[dict]:
        async with open_board(a.board) as board:
            sq = Squasher(board, a.run, cache, horizon=a.horizon, signer=signer,
                          trust=trust_set(a), keep_targets=a.keep_targets)
            if not a.once:
                await sq.run(a.interval)
                return []
            out = []
            while (r := await sq.step()) is not None:
                out.append({"version": r.version, "spans": r.spans, "skipped": r.skipped,
                            "deleted": r.deleted})
            return out

    rounds = asyncio.run(go())
    if a.json:
        print(json.dumps({"run": a.run, "rounds": rounds}))
    else:
        for r in rounds:
            print(f"{a.run} v{r['version']}: {len(r['spans'])} spans, "
                  f"{sum(s['bytes'] for s in r['spans']):,} bytes")
    return 0


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Add `plan` and `squash` to `sub`."""
    p = sub.add_parser("plan", help="print the steps (patches, spans, snapshots) a follower at "
                                    "--from would take")
    p.add_argument("board")
    p.add_argument("--run", required=True)
    p.add_argument("--from", dest="from_", type=_version, required=True,
                   help="the version the follower holds (none: nothing)")
    p.add_argument("--to", type=_version, default=None, help="target version (default: latest)")
    p.add_argument("--max-chain", type=int, default=64)
    p.add_argument("--no-spans", action="store_true", help="plan as a follower ignoring spans")
    p.add_argument("--json", action="store_true",
                   help='print {"steps": [{"kind", "from", "to", "bytes"}], "bytes": N}')
    p.add_argument("--trust", action="append", metavar="PUB",
                   help="use only versions and spans signed by this key (repeatable; default "
                        "$STITCH_TRUST)")
    p.set_defaults(fn=cmd_plan)

    s = sub.add_parser("squash", help="write squashed spans to each new version of a run "
                                      "(needs only the board)")
    s.add_argument("board", help="a writable board (directory or nats://)")
    s.add_argument("--run", required=True)
    s.add_argument("--horizon", type=int, default=DEFAULT_HORIZON,
                   help=f"spans from this many versions back (default {DEFAULT_HORIZON})")
    s.add_argument("--keep-targets", type=int, default=KEEP_TARGETS,
                   help="versions whose spans are kept (older ones are deleted)")
    s.add_argument("--sign", metavar="KEY", help="sign spans with this private key")
    s.add_argument("--trust", action="append", metavar="PUB",
                   help="squash only versions signed by this key (default $STITCH_TRUST)")
    s.add_argument("--cache-dir")
    s.add_argument("--interval", type=float, default=2.0, help="seconds between board polls")
    s.add_argument("--once", action="store_true", help="squash up to latest, then exit")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_squash)
