"""The trainer's verbs of the `stitch` command line: `publish` (and `analyze`, in
`stitch_trainer.analyze`).

They plug into `stitch_core`'s CLI through the ``stitch.cli`` entry-point group (pyproject.toml):
the core lists the verbs it finds there, so it never imports a trainer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

from stitch_core.format.checkpoint import open_checkpoint
from stitch_core.versions.board import open_board
from stitch_core.versions.manifest import PULLED_MANIFEST, Manifest
from stitch_core.versions.materialize import default_cache_dir, pull, remove
from stitch_trainer.publisher import Publisher

__all__ = ["add_publish"]


def cmd_publish(a: argparse.Namespace) -> int:
    """`stitch publish`: publish masters as the run's next version; returns the exit status."""
    src = open_checkpoint(a.src)
    masters = {n: src.load(n) for n in src.names()}
    config_dir = a.config_dir or (str(src.path) if src.is_dir else None)
    cache = Path(a.cache_dir) if a.cache_dir else default_cache_dir()
    with Publisher(
        a.board, a.run, a.view, nats=a.nats, snapshot_every=a.snapshot_every,
        config_dir=config_dir, signing_key=a.sign, keep_snapshots=a.keep_snapshots,
    ) as pub:
        prev = pub.published
        if prev is not None:  # diff against the run's latest: materialise it

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
    if prev is not None:
        drop_pulled(cache, a.run, prev)
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
        "signed_by": m.signed_by,
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


def drop_pulled(cache: Path, run: str, upto: int) -> None:
    """Remove the `pulled-N` directories (N <= `upto`) `stitch publish` materialised to diff
    against: once a newer version is published, none of them is the base of a publish again."""
    for d in (cache / run).glob("pulled-*"):
        n = d.name.removeprefix("pulled-")
        if n.isdigit() and int(n) <= upto:
            remove(d)


def add_publish(sub: argparse._SubParsersAction) -> None:
    """Add `stitch publish` to the CLI's subparsers."""
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
    p.add_argument("--sign", metavar="PATH",
                   help="sign the version (manifest and latest) with this private key "
                        "(`stitch keys new PATH`)")
    p.add_argument("--keep-snapshots", type=int, metavar="K",
                   help="after publishing a snapshot, delete versions older than the newest K "
                        "snapshots (as `stitch gc --keep-snapshots K`)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_publish)
