"""The trainer's verbs of the `stitch` command line: `publish` (and `analyze`, in
`stitch_trainer.analyze`).

They plug into `stitch_core`'s CLI through the ``stitch.cli`` entry-point group (pyproject.toml):
the core lists the verbs it finds there, so it never imports a trainer.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the modules a publish needs are imported by `cmd_publish`: every other verb
    import torch  # of the command line loads this module, and pays nothing for them

    from stitch_core.format.checkpoint import Checkpoint
    from stitch_core.versions.manifest import Manifest
    from stitch_trainer.publish_state import Loaded
    from stitch_trainer.publisher import Publisher

__all__ = ["add_publish"]


def cmd_publish(a: argparse.Namespace) -> int:
    """`stitch publish`: publish masters as the run's next version; returns the exit status.

    The base of the patch is the run's `latest`: the view the last `stitch publish` kept in its
    local state (`stitch_trainer.publish_state`) when that is exactly the board's `latest`,
    else `latest` materialised from the board (said on stderr)."""
    from stitch_core.format.checkpoint import open_checkpoint
    from stitch_core.versions.materialize import default_cache_dir
    from stitch_trainer.publisher import BaseProofError

    src = open_checkpoint(a.src)
    cache = Path(a.cache_dir) if a.cache_dir else default_cache_dir()
    try:
        m, prev, problem = _publish(a, src, cache)
    except BaseProofError as e:  # the local state's deferred proof failed: nothing uploaded
        m, prev, problem = _publish(a, src, cache, state_problem=str(e.__cause__))
    if problem:
        print(f"stitch publish: {problem}; the next publish rebuilds its base from the board",
              file=sys.stderr)
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


def _publish(a: argparse.Namespace, src: Checkpoint, cache: Path,
             state_problem: str | None = None) -> tuple[Manifest, int | None, str | None]:
    """One publish of `src`: (its manifest, the version it was made from, why the local state
    could not be kept or None). The base is the local state if it is the board's `latest` (its
    proof runs while the patch is made; a failed one stops the publish before anything is
    uploaded: BaseProofError), else `latest` rebuilt from the board; `state_problem`: the state
    is not used (why, for the message)."""
    from stitch_trainer import publish_state
    from stitch_trainer.publisher import Publisher

    masters = load_all(src)
    config_dir = a.config_dir or (str(src.path) if src.is_dir else None)
    state = None
    with Publisher(
        a.board, a.run, a.view, nats=a.nats, snapshot_every=a.snapshot_every,
        config_dir=config_dir, signing_key=a.sign, keep_snapshots=a.keep_snapshots,
        keep_patch=True,
    ) as pub:
        prev = pub.published
        if prev is not None:  # diff against the run's latest
            state = base_of(pub, cache, prev, state_problem)
            state.warm()
            pub.resume_from(prev, state.view, state.fingerprints, proof=state.prove)
        # the checkpoint is read from disk and never changed here: a view in its dtype is used
        # as it is (a file mapping), not copied
        info = pub.publish(a.step if a.step is not None else 0, masters, copy=False)
        del masters
        # a publish from the local state moves it forward in place once the version is on the
        # board; any other writes the whole view to a new file while the version is published
        pending = None if state is not None and state.file is not None else \
            publish_state.begin(cache, a.run, pub.last_view)
        try:
            m = info.result()
        except BaseException:
            if pending is not None:
                pending.abort()
            raise
        problem = _keep_state(cache, a.run, pub, state, m) if pending is None else \
            pending.commit(m)
    return m, prev, problem


def load_all(ck: Checkpoint) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint, in name order, each shard file opened once."""
    out: dict[str, torch.Tensor] = {}
    for shard, names in ck.shards.items():
        tensors = ck.load_shard(shard)
        out.update((n, tensors[n]) for n in names)
    return {n: out[n] for n in sorted(out)}


def _keep_state(cache: Path, run: str, pub: Publisher, state: Loaded, m: Manifest) -> str | None:
    """Advance the local state `state` (this publish's base) to `m` in place, or, for a patch
    that cannot be applied to its file as it is, write `m`'s whole view as the new state."""
    from stitch_trainer import publish_state

    if pub.last_patch is not None:
        try:
            return publish_state.advance(cache, run, state, pub.last_patch, m)
        except publish_state.NotInPlaceError:
            pass
    pending = publish_state.begin(cache, run, pub.last_view)
    return pending.commit(m)


def base_of(pub: Publisher, cache: Path, prev: int, state_problem: str | None = None) -> Loaded:
    """The view of the run's `latest` (`prev`) and its fingerprints, exactly as the board's
    manifest of `prev` lists them: the local state when it holds exactly that and
    `state_problem` is None (its `file` set: the view maps it; its proof deferred), else `prev`
    materialised from the board (`pull`, which proves every fingerprint; no `file`). The
    manifest read here is the only board read when the state is used: no object of any version
    is fetched."""
    from stitch_core.format.checkpoint import open_checkpoint
    from stitch_core.versions.materialize import pull, remove
    from stitch_core.versions.store import read_manifest
    from stitch_trainer import publish_state

    run = pub.run
    m = pub.call(read_manifest(pub.board, run, prev))
    # the state's proof runs while the patch is made (`Loaded.prove`, before any upload)
    got = state_problem or publish_state.load(cache, run, m, defer_proof=True)
    if isinstance(got, publish_state.Loaded):
        return got
    print(f"stitch publish: rebuilding {run} v{prev} from the board (local state: {got})",
          file=sys.stderr)
    d = cache / run / f"pulled-{prev:06d}"
    remove(d)  # what a killed publish left: never used unverified
    pulled = pub.call(pull(pub.board, run, prev, d, cache, quiet=True))
    if pulled.digest != m.digest:  # pull proved its fingerprints against this manifest
        raise ValueError(f"{run} v{prev} changed on the board while it was read")
    return publish_state.Loaded(prev, load_all(open_checkpoint(d)), pulled.fingerprints)


def drop_pulled(cache: Path, run: str, upto: int) -> None:
    """Remove the `pulled-N` directories (N <= `upto`) `stitch publish` materialised to diff
    against: once a newer version is published, none of them is the base of a publish again."""
    from stitch_core.versions.materialize import remove

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
