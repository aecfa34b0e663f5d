"""CLI verbs around versions: up, publish, pull, versions, status, board serve."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

from . import fingerprint as fpr
from .board import Board, open_board
from .checkpoint import open_checkpoint
from .manifest import Manifest
from .materialize import apply_patches, remove, replace, tmp_sibling
from .patch import PatchSet
from .stp import PatchReader
from .versions import VersionError, fetch_object, fetch_patch, plan, read_manifest

PULLED_MANIFEST = "stitch-manifest.json"


def _cache(a: argparse.Namespace) -> Path:
    return (
        Path(a.cache_dir)
        if getattr(a, "cache_dir", None)
        else Path(tempfile.gettempdir()) / "stitch-cache"
    )


# ---------------------------------------------------------------- pull


def _open_patch(parts: list[Path]) -> PatchReader | PatchSet:
    readers = [PatchReader(p) for p in parts]
    if len(readers) == 1 and readers[0].header.part is None:
        return readers[0]
    return PatchSet(readers)


async def pull(
    board: Board,
    run: str,
    version: int | None,
    out: Path,
    cache: Path,
    *,
    force: bool = False,
    quiet: bool = False,
) -> Manifest:
    """Materialise `version` (None: latest) of `run` as an HF directory at `out`."""
    if version is None:
        latest = await board.read_latest(run)
        if latest is None:
            raise VersionError(f"run {run!r} has no versions on {board.url}")
        version = latest.version
    if out.exists() and not force:
        raise FileExistsError(f"{out} exists (use --force to replace it)")
    steps = await plan(board, run, None, version)
    snap, patches = steps[0], steps[1:]
    files = [r for r in snap.manifest.objects if r.role != "patch"]
    total = sum(r.size for r in files) + sum(s.manifest.patch_bytes for s in patches)
    with tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        desc="fetch",
        disable=quiet or None,
        file=sys.stderr,
        leave=False,
    ) as bar:
        for ref in files:
            p = await fetch_object(board, snap.manifest, ref, cache)
            bar.update(ref.size)
        snap_dir = p.parent
        paths = []
        for s in patches:
            paths.append(await fetch_patch(board, s.manifest, cache))
            bar.update(s.manifest.patch_bytes)
    target = steps[-1].manifest
    base = open_checkpoint(snap_dir)
    if not base.is_dir:
        raise VersionError("snapshot is not a directory")
    tmp = tmp_sibling(out)
    readers = [_open_patch(p) for p in paths]
    try:
        tmp.mkdir(parents=True)
        if not readers:
            got = {n: fpr.fingerprint(n, base.load(n)) for n in base.names()}
        else:
            got = {
                t.name: fpr.parse(t.target_fp) for t in readers[-1].header.tensors if t.target_fp
            }
        if got != target.fingerprints:
            raise VersionError(f"{run} v{version}: fingerprints do not match the manifest")
        with tqdm(
            total=len(base.shards),
            unit="shard",
            desc="apply",
            disable=quiet or None,
            file=sys.stderr,
            leave=False,
        ) as bar:
            await asyncio.to_thread(apply_patches, base, readers, tmp, bar.update)
        (tmp / PULLED_MANIFEST).write_text(target.model_dump_json(indent=1))
        replace(tmp, out, force)
    except BaseException:
        remove(tmp)
        raise
    finally:
        for r in readers:
            r.close()
    return target


def cmd_pull(a: argparse.Namespace) -> int:
    async def go() -> Manifest:
        async with open_board(a.board) as board:
            v = None if a.version in (None, "latest") else int(a.version)
            return await pull(board, a.run, v, Path(a.output), _cache(a), force=a.force)

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


# ---------------------------------------------------------------- publish


def cmd_publish(a: argparse.Namespace) -> int:
    from stitch_trainer.publisher import Publisher

    src = open_checkpoint(a.src)
    masters = {n: src.load(n) for n in src.names()}
    config_dir = a.config_dir or (str(src.path) if src.is_dir else None)
    cache = _cache(a)
    with Publisher(
        a.board, a.run, a.view, nats=a.nats, snapshot_every=a.snapshot_every, config_dir=config_dir
    ) as pub:
        if pub._published is not None:  # diff against the run's latest: materialise it
            prev = pub._published

            async def fetch() -> Path:
                async with open_board(a.board) as board:
                    d = cache / a.run / f"pulled-{prev:06d}"
                    if not d.exists():
                        await pull(board, a.run, prev, d, cache, quiet=True)
                    return d

            d = asyncio.run(fetch())
            ck = open_checkpoint(d)
            view = {n: ck.load(n) for n in ck.names()}
            m = Manifest.model_validate_json((d / PULLED_MANIFEST).read_text())
            pub.resume_from(prev, view, m.fingerprints)
        info = pub.publish(a.step if a.step is not None else 0, masters)
        m = info.result()
    out = {
        "run": m.run,
        "version": m.version,
        "kind": m.kind,
        "parent": m.parent,
        "patch_bytes": m.patch_bytes,
        "full_bytes": m.full_bytes,
        "changed_elements": m.changed_elements,
        "total_elements": m.total_elements,
        "digest": m.digest,
    }
    if a.json:
        print(json.dumps(out))
    else:
        print(
            f"published {m.run} v{m.version} ({m.kind}"
            + (f", patch {m.patch_bytes:,} bytes" if m.patch_bytes else "")
            + ")"
        )
    return 0


# ---------------------------------------------------------------- versions


async def list_manifests(board: Board, run: str) -> list[Manifest]:
    versions = await board.list_versions(run)
    out: list[Manifest] = []
    if versions is not None:
        for v in versions:
            out.append(await read_manifest(board, run, v))
        return out
    latest = await board.read_latest(run)
    v = latest.version if latest else None
    while v is not None:  # static HTTP boards cannot list: walk parents from latest
        m = await read_manifest(board, run, v)
        out.append(m)
        v = m.parent
    return sorted(out, key=lambda m: m.version)


def cmd_versions(a: argparse.Namespace) -> int:
    async def go():
        async with open_board(a.board) as board:
            return await list_manifests(board, a.run), await board.read_latest(a.run)

    ms, latest = asyncio.run(go())
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
        print(
            f"{r['version']:>7} {r['kind']:<8} {r['parent'] if r['parent'] is not None else '':>6} "
            f"{r['step'] if r['step'] is not None else '':>6} {pct:>10} "
            f"{r['patch_bytes'] or '':>12} {r['full_bytes'] or '':>12}  {r['created']}{star}"
        )
    return 0


# ---------------------------------------------------------------- status / up / serve


def cmd_status(a: argparse.Namespace) -> int:
    import nats

    from .announce import fleet

    async def go():
        nc = await nats.connect(a.nats, connect_timeout=5, max_reconnect_attempts=1)
        try:
            return await fleet(nc.jetstream(), a.run)
        finally:
            await nc.close()

    hbs = asyncio.run(go())
    now = time.time()
    if a.json:
        print(
            json.dumps(
                {
                    "run": a.run,
                    "engines": [
                        {**h.model_dump(), "last_seen_seconds": round(now - h.time, 3)} for h in hbs
                    ],
                }
            )
        )
        return 0
    print(f"{'engine':<28} {'version':>7} {'lag':>4} {'state':<12} {'last seen':>10}  url")
    for h in hbs:
        print(
            f"{h.id:<28} {h.version if h.version is not None else '-':>7} "
            f"{h.lag if h.lag is not None else '-':>4} {h.state:<12} {now - h.time:>9.1f}s  "
            f"{h.url or ''}"
        )
    if not hbs:
        print(f"(no engine has reported for run {a.run})")
    return 0


def cmd_up(a: argparse.Namespace) -> int:
    from .natsserver import run_dev_stack

    return run_dev_stack(Path(a.dir), a.port)


def cmd_board_serve(a: argparse.Namespace) -> int:
    from .board.serve import run_server

    run_server(Path(a.dir), a.host, a.port)
    return 0


def add_parsers(sub: argparse._SubParsersAction) -> None:
    u = sub.add_parser("up", help="start the dev stack: local nats-server (JetStream) + a board")
    u.add_argument("--dir", default="./stitch-dev", help="board + JetStream store directory")
    u.add_argument("--port", type=int, default=4222, help="NATS port (0: any free port)")
    u.set_defaults(fn=cmd_up)

    p = sub.add_parser("publish", help="publish master weights as the run's next version")
    p.add_argument("board")
    p.add_argument("src", help="safetensors file or HF directory of master weights (any dtype)")
    p.add_argument("--run", required=True)
    p.add_argument("--view", default="bf16", help="bf16 | fp16 | fp8-e4m3-{tensor,channel,block}")
    p.add_argument("--nats", help="NATS URL to announce on")
    p.add_argument("--step", type=int, help="training step recorded in the manifest")
    p.add_argument("--snapshot-every", type=int, default=0, help="every K-th version a snapshot")
    p.add_argument("--config-dir", help="HF dir with config/tokenizer files for snapshots")
    p.add_argument("--cache-dir")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_publish)

    pl = sub.add_parser("pull", help="materialise a version as an HF directory")
    pl.add_argument("board")
    pl.add_argument("--run", required=True)
    pl.add_argument("--version", default="latest", help="N or latest")
    pl.add_argument("-o", "--output", required=True)
    pl.add_argument("--cache-dir")
    pl.add_argument("--force", action="store_true")
    pl.add_argument("--json", action="store_true")
    pl.set_defaults(fn=cmd_pull)

    v = sub.add_parser("versions", help="list a run's versions")
    v.add_argument("board")
    v.add_argument("--run", required=True)
    v.add_argument("--json", action="store_true")
    v.set_defaults(fn=cmd_versions)

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
    sv.set_defaults(fn=cmd_board_serve)

    # `stitch analyze`: defined in stitch_trainer.analyze (transformers/matplotlib load on use)
    from stitch_trainer.analyze import add_parser as add_analyze

    add_analyze(sub)
