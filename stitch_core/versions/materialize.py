"""Materialise versions as HF directories: a base checkpoint + a chain of patches, shard by shard.

Memory stays bounded by one shard: each shard of the base is loaded, every patch of the chain is
applied to its tensors in order (each verified by fingerprint), and the shard is written. Tensors a
patch adds go to the last shard; removed ones disappear from the index. `pull` then sets the
directory's config.json `quantization_config` for the version's view
(stitch_core.format.quant_config), so an engine loads quantized codes and scales as such.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Callable
from pathlib import Path

from tqdm import tqdm

from stitch_core.format import dtypes
from stitch_core.format import fingerprint as fpr
from stitch_core.format.checkpoint import (
    Checkpoint,
    copy_side_files,
    open_checkpoint,
    remove,
    replace,
    save_shard,
    tmp_sibling,
    write_index,
)
from stitch_core.format.patch import PatchSet, apply_entry, check_compatible, check_digests, row
from stitch_core.format.quant_config import write_quantization_config
from stitch_core.format.stp import PatchReader
from stitch_core.versions import verified
from stitch_core.versions.board.base import Board
from stitch_core.versions.cache import hold
from stitch_core.versions.manifest import PULLED_MANIFEST, Manifest
from stitch_core.versions.store import (
    Step,
    VersionError,
    fetch_object,
    fetch_patch,
    plan,
    read_latest,
    read_manifest,
)
from stitch_core.versions.trust import TrustSet


def check_chain(base: Checkpoint, readers: list[PatchReader]) -> None:
    """Check that each patch applies to the version before it in the chain, starting at `base`."""
    names = set(base.names())
    version = base.version
    for r in readers:
        check_compatible(r.header, names, base_version=version)
        names = {t.name for t in r.header.tensors if t.kind != "removed"}
        version = r.header.target_version


def apply_patches(base: Checkpoint, readers: list[PatchReader], dest: Path,
                  progress: Callable[[int], None] | None = None,
                  metadata: dict[str, str] | None = None) -> dict[str, str]:
    """Write base + patches into `dest` (a directory if base is one, else a file)."""
    check_chain(base, readers)
    shards = base.shards
    last = list(shards)[-1]
    meta = dict(base.metadata)
    if readers:
        h = readers[-1].header
        if h.run is not None:
            meta["stitch.run"] = h.run
        if h.target_version is not None:
            meta["stitch.version"] = str(h.target_version)
        else:
            meta.pop("stitch.version", None)
    meta.update(metadata or {})
    where: dict[str, str] = {}
    total = 0
    rows: list[tuple[list, list]] = [([], []) for _ in readers]  # (base, target) per patch
    for shard, names in shards.items():
        tensors = base.load_shard(shard)
        tensors = {n: tensors[n] for n in names}
        for r, (base_rows, target_rows) in zip(readers, rows, strict=True):
            entries = {t.name: t for t in r.header.tensors}
            todo = list(tensors.items())
            if shard == last:  # tensors this patch adds land in the last shard
                todo += [(t.name, None) for t in r.header.tensors
                         if t.kind == "full" and t.base_fp is None and t.name not in tensors]
            nxt = {}
            for name, t in todo:
                e = entries[name]
                out = apply_entry(r, e, t)
                if t is not None and e.base_fp is not None:
                    base_rows.append(row(name, t, fpr.parse(e.base_fp)))
                if out is not None:
                    nxt[name] = out
                    target_rows.append(row(name, out, fpr.parse(e.target_fp)))
            tensors = nxt
        for name, t in tensors.items():
            where[name] = shard
            total += t.numel() * dtypes.info(t.dtype).itemsize
        save_shard(tensors, dest / shard if base.is_dir else dest, meta)
        if progress:
            progress(1)
    for r, (base_rows, target_rows) in zip(readers, rows, strict=True):
        check_digests(r.header, base_rows, target_rows)
    if base.is_dir:
        copy_side_files(base.path, dest)
        if (base.path / "model.safetensors.index.json").exists() or len(shards) > 1:
            write_index(dest, where, total)
    return where


def default_cache_dir() -> Path:
    """Where fetched objects are cached when no directory is given: private to the user
    (`$XDG_CACHE_HOME/stitch`, else `~/.cache/stitch`), created with mode 0700. A directory
    there that another user owns is refused: a cache others can write could feed this user
    planted files."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    d = Path(base) / "stitch"
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = d.stat()
    if st.st_uid != os.getuid():
        raise VersionError(f"cache directory {d} belongs to another user; set a cache directory")
    if st.st_mode & 0o077:
        os.chmod(d, 0o700)
    return d


class RollbackRefusedError(VersionError):
    """`pull` of `latest` into a directory that holds a newer pulled version of the same run:
    a stale board or relay (its `latest` behind, however well signed) must not roll it back."""


def pulled_version(out: Path, run: str) -> int | None:
    """The version of `run` that a directory `stitch pull` wrote holds (its PULLED_MANIFEST),
    else None (no directory, another run, no or an unreadable manifest)."""
    try:
        m = Manifest.model_validate_json((out / PULLED_MANIFEST).read_bytes())
    except (OSError, ValueError):
        return None
    return m.version if m.run == run else None


def check_not_back(out: Path, run: str, version: int) -> None:
    """RollbackRefusedError if `out` holds a version of `run` newer than `version`."""
    held = pulled_version(out, run)
    if held is not None and version < held:
        raise RollbackRefusedError(
            f"{out} holds {run} v{held} and the board's latest is v{version} (a stale board or "
            f"relay?): not rolling it back; name --version {version} to go back on purpose")


def open_patch(parts: list[Path], m: Manifest) -> PatchReader | PatchSet:
    """The fetched parts of `m`'s patch as one reader (a PatchSet for a multi-part patch)."""
    # each part hashed through the descriptor it is then read from (the bytes used), unless
    # this process verified it at fetch and it is unchanged since (`verified`)
    readers = [PatchReader(p, sha256=r.sha256, verified=verified.identity(p, r.sha256))
               for p, r in zip(parts, m.patches, strict=True)]
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
    trust: TrustSet | None = None,
) -> Manifest:
    """Materialise `version` (None: latest) of `run` as an HF directory at `out`. With a trust
    set, `latest` and every manifest used must be signed by one of its keys (RefusedVersionError
    before anything is fetched or written). Never backwards unless asked: when `version` is None
    and `out` holds a newer pulled version of `run`, RollbackRefusedError (even with `force`),
    before anything is fetched, and again just before `out` is replaced."""
    back_ok = version is not None  # an explicit version may be an older one, on purpose
    if version is None:
        latest = await read_latest(board, run, trust)
        if latest is None:
            raise VersionError(f"run {run!r} has no versions on {board.url}")
        version = latest.version
        check_not_back(out, run, version)
    if out.exists() and not force:
        raise FileExistsError(f"{out} exists (use --force to replace it)")
    await read_manifest(board, run, version, trust)  # the target itself: refused by name
    steps = await plan(board, run, None, version, trust=trust)
    # in use while we read them: a follower sharing the cache never prunes them meanwhile
    holds = [await asyncio.to_thread(hold, cache, run, s.version) for s in steps]
    try:
        return await _materialise(board, steps, out, cache, force=force, quiet=quiet,
                                  back_ok=back_ok)
    finally:
        for h in holds:
            if h is not None:
                h.release()


async def _materialise(board: Board, steps: list[Step], out: Path, cache: Path, *, force: bool,
                       quiet: bool, back_ok: bool = True) -> Manifest:
    """`pull` once planned: fetch the steps' objects, apply the chain, write `out`."""
    run, version = steps[-1].manifest.run, steps[-1].manifest.version
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
    readers = [open_patch(p, s.manifest) for p, s in zip(paths, patches, strict=True)]
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
        # how engines read the view's tensors (quantized views: codes + scales)
        write_quantization_config(tmp / "config.json", target.view,
                                  {t.name: (t.dtype, t.shape) for t in target.tensors})
        (tmp / PULLED_MANIFEST).write_text(target.model_dump_json(indent=1))
        if not back_ok:  # another pull may have written a newer one meanwhile
            check_not_back(out, run, version)
        replace(tmp, out, force)
    except BaseException:
        remove(tmp)
        raise
    finally:
        for r in readers:
            r.close()
    return target
