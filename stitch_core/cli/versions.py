"""CLI verbs around versions: up, publish, pull, versions, gc, status, board serve."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

from stitch_core.cli.keys import trust_set
from stitch_core.versions.board import open_board
from stitch_core.versions.manifest import Manifest
from stitch_core.versions.materialize import default_cache_dir, pull
from stitch_core.versions.retention import GcReport, gc
from stitch_core.versions.store import RefusedVersionError, check_signed, list_manifests

__all__ = ["add_parsers"]



def default_cache(a: argparse.Namespace) -> Path:
    """--cache-dir, else the default cache directory."""
    return Path(a.cache_dir) if getattr(a, "cache_dir", None) else default_cache_dir()


# ---------------------------------------------------------------- pull


def cmd_pull(a: argparse.Namespace) -> int:
    """`stitch pull`: materialise a version of a run as an HF directory; returns the exit status."""
    async def go() -> Manifest:
        async with open_board(a.board) as board:
            v = None if a.version in (None, "latest") else int(a.version)
            return await pull(board, a.run, v, Path(a.output), default_cache(a), force=a.force,
                              trust=trust_set(a))

    t0 = time.perf_counter()
    m = asyncio.run(go())
    if a.json:
        print(
            json.dumps(
                {
                    "run": m.run,
                    "version": m.version,
                    "output": a.output,
                    "digest": m.digest,
                    "seconds": round(time.perf_counter() - t0, 3),
                }
            )
        )
    else:
        print(f"{a.output}: {m.run} v{m.version} ({len(m.tensors)} tensors verified)")
    return 0


# ---------------------------------------------------------------- versions


def cmd_versions(a: argparse.Namespace) -> int:
    """`stitch versions`: list a run's versions on a board; returns the exit status."""
    async def go():
        async with open_board(a.board) as board:
            return await list_manifests(board, a.run), await board.read_latest(a.run)

    ms, latest = asyncio.run(go())
    trust = trust_set(a)
    rows = [
        {
            "version": m.version,
            "kind": m.kind,
            "parent": m.parent,
            "step": m.step,
            "changed_elements": m.changed_elements,
            "total_elements": m.total_elements,
            "patch_bytes": m.patch_bytes,
            "full_bytes": m.full_bytes,
            "created": m.created,
            "digest": m.digest,
            "signed_by": m.signed_by,
            **({"trusted": _trusted(m, trust)} if trust else {}),
        }
        for m in ms
    ]
    if a.json:
        print(
            json.dumps(
                {"run": a.run, "latest": latest.version if latest else None, "versions": rows}
            )
        )
        return 0
    print(
        f"{'version':>7} {'kind':<8} {'parent':>6} {'step':>6} {'changed %':>10} "
        f"{'patch bytes':>12} {'full bytes':>12}  created"
    )
    for r in rows:
        pct = (
            ""
            if r["changed_elements"] is None
            else f"{100 * r['changed_elements'] / max(r['total_elements'], 1):.3f}"
        )
        star = " *" if latest and r["version"] == latest.version else ""
        signed = r["signed_by"] or "-"
        if "trusted" in r:
            signed += " ok" if r["trusted"] is True else " REFUSED"
        print(
            f"{r['version']:>7} {r['kind']:<8} {r['parent'] if r['parent'] is not None else '':>6} "
            f"{r['step'] if r['step'] is not None else '':>6} {pct:>10} "
            f"{r['patch_bytes'] or '':>12} {r['full_bytes'] or '':>12}  {r['created']}{star}"
            f"  {signed}"
        )
    return 0


def _trusted(m: Manifest, trust) -> bool | str:
    """True if the trust set accepts `m`'s signature, else the reason it does not."""
    try:
        check_signed(m, trust)
    except RefusedVersionError as e:
        return str(e)
    return True


# ---------------------------------------------------------------- gc


def cmd_gc(a: argparse.Namespace) -> int:
    """`stitch gc`: delete a run's versions older than its newest K snapshots (and their
    chains); returns the exit status."""
    async def go() -> GcReport:
        async with open_board(a.board) as board:
            return await gc(board, a.run, a.keep_snapshots, dry_run=a.dry_run,
                            trust=trust_set(a))

    r = asyncio.run(go())
    if a.json:
        print(r.model_dump_json())
        return 0
    verb = "would delete" if r.dry_run else "deleted"
    for d in r.deleted:
        print(f"{verb} v{d.version} ({d.kind or 'unreadable manifest'}, {d.objects} objects, "
              f"{d.bytes:,} bytes)")
    kept = ", ".join(f"v{v}" for v in r.kept_snapshots) or "none"
    print(f"{r.run}: latest v{r.latest}; kept snapshots {kept}; "
          + (f"{verb} {len(r.deleted)} versions below v{r.cut}, {r.bytes_freed:,} bytes"
             if r.deleted else (r.reason or "nothing to delete")))
    return 0


def _at_least_one(s: str) -> int:
    n = int(s)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 (got {n}): gc never deletes the "
                                         "last snapshot")
    return n


# ---------------------------------------------------------------- status / up / serve


def cmd_status(a: argparse.Namespace) -> int:
    """`stitch status`: the fleet table from engine heartbeats (and the gateways'); returns the
    exit status. Only heartbeats published on their own engine's subject are shown
    (`announce.speaks_for`), and "last seen" is when the NATS server stored each one, not the
    time its sender claims."""
    from stitch_core.versions.announce import fleet_stored, gateways
    from stitch_core.versions.nats_conn import connect

    async def go():  # connect(): $STITCH_NATS_CREDS and $STITCH_NATS_TLS_* apply
        nc = await connect(a.nats, name="stitch-status")
        try:
            js = nc.jetstream()
            stored = await fleet_stored(js, a.run)
            try:  # a user without rights on the gateway stream still sees the engines
                gws = await gateways(js, a.run)
            except Exception as e:  # noqa: BLE001
                print(f"stitch status: cannot read the gateways of {a.run}: {e}", file=sys.stderr)
                gws = []
            return stored, gws
        finally:
            await nc.close()

    stored, gws = asyncio.run(go())
    now = time.time()
    hbs = [s.hb for s in stored]
    seen = {s.hb.id: max(0.0, now - s.stored) for s in stored}
    if a.json:
        print(
            json.dumps(
                {
                    "run": a.run,
                    "engines": [
                        {**h.model_dump(), "last_seen_seconds": round(seen[h.id], 3)} for h in hbs
                    ],
                    "gateways": [
                        {**g.model_dump(), "last_seen_seconds": round(now - g.time, 3)} for g in gws
                    ],
                }
            )
        )
        return 0
    print(f"{'engine':<28} {'version':>7} {'lag':>4} {'state':<12} {'health':<9} "
          f"{'last seen':>10}  url")
    for h in hbs:
        print(
            f"{h.id:<28} {h.version if h.version is not None else '-':>7} "
            f"{h.lag if h.lag is not None else '-':>4} {h.state:<12} {h.health:<9} "
            f"{seen[h.id]:>9.1f}s  "
            f"{h.url or ''}"
        )
    if not hbs:
        print(f"(no engine has reported for run {a.run})")
    if gws:
        print(f"\n{'gateway':<28} {'engines':>7} {'versions':<12} {'in flight':>9} "
              f"{'last seen':>10}  url")
    for g in gws:
        vs = ",".join(map(str, g.versions)) or "-"
        print(f"{g.id:<28} {g.engines:>7} {vs:<12} {g.in_flight:>9} {now - g.time:>9.1f}s  "
              f"{g.url or ''}")
    return 0


def cmd_up(a: argparse.Namespace) -> int:
    """`stitch up`: run the dev stack (nats-server and a board); returns the exit status."""
    from stitch_core.versions.natsserver import run_dev_stack

    return run_dev_stack(Path(a.dir), a.port)


def cmd_board_serve(a: argparse.Namespace) -> int:
    """`stitch board serve`: serve a board directory over HTTP; returns the exit status."""
    from stitch_core.versions.board.serve import run_server

    # flags left out keep the server's defaults (not imported here: uvicorn loads only to serve)
    kw = {k: v for k, v in (("max_conns", a.max_conns or a.workers),
                            ("max_conns_per_client", a.max_conns_per_client),
                            ("head_timeout", a.head_timeout)) if v is not None}
    run_server(Path(a.dir), a.host, a.port, verbose=a.verbose, **kw)
    return 0


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Add the version verbs (up, pull, versions, gc, status, board serve) to `sub`."""
    u = sub.add_parser("up", help="start the dev stack: local nats-server (JetStream) + a board")
    u.add_argument("--dir", default="./stitch-dev", help="board + JetStream store directory")
    u.add_argument("--port", type=int, default=4222, help="NATS port (0: any free port)")
    u.set_defaults(fn=cmd_up)

    pl = sub.add_parser("pull", help="materialise a version as an HF directory")
    pl.add_argument("board")
    pl.add_argument("--run", required=True)
    pl.add_argument("--version", default="latest",
                    help="N or latest (going back from the version the output directory holds "
                         "takes naming N)")
    pl.add_argument("-o", "--output", required=True)
    pl.add_argument("--cache-dir")
    pl.add_argument("--force", action="store_true",
                    help="replace an existing output directory (never with an older version "
                         "of its run through latest: a stale board or relay is refused)")
    pl.add_argument("--json", action="store_true")
    pl.add_argument("--trust", action="append", metavar="PUB",
                    help="accept only versions signed by this public key (a .pub file or an "
                         "inline ed25519:... key; repeatable; default $STITCH_TRUST)")
    pl.set_defaults(fn=cmd_pull)

    v = sub.add_parser("versions", help="list a run's versions")
    v.add_argument("board")
    v.add_argument("--run", required=True)
    v.add_argument("--json", action="store_true")
    v.add_argument("--trust", action="append", metavar="PUB",
                   help="also check each version's signature against these keys (repeatable)")
    v.set_defaults(fn=cmd_versions)

    g = sub.add_parser("gc", help="delete a run's versions older than its newest K snapshots "
                                  "(latest and every follower's chain from them are kept)")
    g.add_argument("board", help="a writable board (directory or nats://; not HTTP)")
    g.add_argument("--run", required=True)
    g.add_argument("--keep-snapshots", type=_at_least_one, required=True, metavar="K",
                   help="keep the newest K snapshots on the chain of latest and every version "
                        "after the oldest of them")
    g.add_argument("--dry-run", action="store_true", help="list what would go, delete nothing")
    g.add_argument("--json", action="store_true")
    g.add_argument("--trust", action="append", metavar="PUB",
                   help="count only snapshots signed by these keys (repeatable; default "
                        "$STITCH_TRUST)")
    g.set_defaults(fn=cmd_gc)

    s = sub.add_parser("status", help="fleet table from engine heartbeats")
    s.add_argument("--nats", required=True)
    s.add_argument("--run", required=True)
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_status)

    b = sub.add_parser("board", help="board utilities")
    bs = b.add_subparsers(dest="board_cmd", required=True)
    sv = bs.add_parser("serve", help="serve a board directory over HTTP (read-only, Range)")
    sv.add_argument("dir")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--max-conns", type=int, default=None, metavar="N",
                    help="connections open at once, all clients (over it, the connection that "
                         "has waited longest for a request is closed, else the new one gets a "
                         "503; default 1024)")
    sv.add_argument("--workers", type=int, default=None, metavar="N",
                    help="deprecated: the old name of --max-conns (no threads per connection "
                         "any more)")
    sv.add_argument("--max-conns-per-client", type=int, default=None, metavar="N",
                    help="connections open at once from one client address (0: no cap; "
                         "followers behind one NAT share one; default 256)")
    sv.add_argument("--head-timeout", type=float, default=None, metavar="S",
                    help="seconds a whole request head may take, counted from the connection "
                         "opening or its previous answer (slow clients and idle keep-alive "
                         "connections are closed after it; default 10)")
    sv.add_argument("-v", "--verbose", action="store_true", help="log each request to stderr")
    sv.set_defaults(fn=cmd_board_serve)

    from stitch_core.versions import relay

    rl = sub.add_parser("relay", help="a region's relay of a board: nginx for HTTP boards, a "
                                      "leafnode nats-server with mirrors for NATS (docs/relays.md)")
    relay.add_parsers(rl.add_subparsers(dest="relay_cmd", required=True))
