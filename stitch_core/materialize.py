"""Materialise versions as HF directories: a base checkpoint + a chain of patches, shard by shard.

Memory stays bounded by one shard: each shard of the base is loaded, every patch of the chain is
applied to its tensors in order (each verified by fingerprint), and the shard is written. Tensors a
patch adds go to the last shard; removed ones disappear from the index.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

from . import dtypes
from . import fingerprint as fpr
from .checkpoint import Checkpoint, copy_side_files, save_shard, write_index
from .patch import apply_entry, check_compatible, check_digests, row
from .stp import PatchReader


def check_chain(base: Checkpoint, readers: list[PatchReader]) -> None:
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


def tmp_sibling(out: Path) -> Path:
    return out.parent / f".{out.name}.tmp-{os.getpid()}"


def remove(p: Path) -> None:
    if p.is_dir():
        shutil.rmtree(p, ignore_errors=True)
    elif p.exists():
        p.unlink()


def replace(tmp: Path, out: Path, force: bool) -> None:
    if out.exists():
        if not force:
            raise FileExistsError(f"{out} exists (use --force to replace it)")
        remove(out)
    os.replace(tmp, out)
