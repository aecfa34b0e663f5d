"""The patch verbs of the `stitch` command line: diff, apply and inspect (their parsers are in
`stitch_core.cli.main`, which imports this module only when one of them runs)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from stitch_core.cli.main import CliError
from stitch_core.format.checkpoint import (
    Checkpoint,
    open_checkpoint,
    remove,
    replace,
    tmp_sibling,
)
from stitch_core.format.patch import PatchBuilder, check_compatible
from stitch_core.format.stp import PatchReader

__all__ = ["cmd_apply", "cmd_diff", "cmd_inspect", "inspect_summary"]


def _bar(total: int, desc: str, unit: str = "tensor") -> tqdm:
    # disable=None turns the bar off when stderr is not a TTY
    return tqdm(total=total, desc=desc, unit=unit, disable=None, file=sys.stderr, leave=False)


# ---------------------------------------------------------------- diff


class _Tensors:
    """A checkpoint's tensors by name, each shard file opened once (not once per tensor)."""

    def __init__(self, ck: Checkpoint):
        self.ck = ck
        self._files: dict[str, object] = {}

    def get(self, name: str) -> torch.Tensor | None:
        shard = self.ck.where.get(name)
        if shard is None:
            return None
        f = self._files.get(shard)
        if f is None:
            f = self._files[shard] = safe_open(self.ck.file(shard), framework="pt")
        return f.get_tensor(name)


def cmd_diff(a: argparse.Namespace) -> int:
    """`stitch diff`: write the patch that turns BASE into NEW; returns the exit status."""
    base, new = open_checkpoint(a.base), open_checkpoint(a.new)
    bases, news = _Tensors(base), _Tensors(new)
    out = Path(a.output)
    tmp = tmp_sibling(out)
    names = sorted(set(base.where) | set(new.where))
    t0 = time.perf_counter()
    try:
        with open(tmp, "wb") as f:
            b = PatchBuilder(
                f,
                run=a.run or new.run or base.run,
                base_version=a.base_version if a.base_version is not None else base.version,
                target_version=a.target_version if a.target_version is not None else new.version,
                view=a.view,
            )
            with _bar(len(names), "diff") as bar:
                for name in names:
                    b.add(name, bases.get(name), news.get(name))
                    bar.update(1)
            header = b.finish()
            f.flush()
            os.fsync(f.fileno())
        replace(tmp, out, a.force)
    except BaseException:
        remove(tmp)
        raise
    size = out.stat().st_size
    summary = {
        "patch": str(out),
        "patch_bytes": size,
        "changed_elements": header.changed_elements,
        "total_elements": header.total_elements,
        "seconds": round(time.perf_counter() - t0, 3),
    }
    if a.json:
        print(json.dumps(summary))
    else:
        pct = 100 * header.changed_elements / max(header.total_elements, 1)
        print(
            f"wrote {out}: {size:,} bytes, {header.changed_elements:,} of "
            f"{header.total_elements:,} elements changed ({pct:.3f}%)"
        )
    return 0


# ---------------------------------------------------------------- apply


def cmd_apply(a: argparse.Namespace) -> int:
    """`stitch apply`: rebuild and verify PATCH's target from BASE; returns the exit status."""
    from stitch_core.versions.materialize import apply_patches  # the board stack: apply only

    t0 = time.perf_counter()
    base = open_checkpoint(a.base)
    out = Path(a.output)
    if out.exists() and not a.force:
        raise CliError(f"{out} exists (use --force to replace it)")
    with PatchReader(a.patch) as reader:
        check_compatible(reader.header, base.names(), base_version=base.version)
        tmp = tmp_sibling(out)
        try:
            if base.is_dir:
                tmp.mkdir(parents=True)
            with _bar(len(base.shards), "apply", "shard") as bar:
                apply_patches(base, [reader], tmp, bar.update)
            replace(tmp, out, a.force)
        except BaseException:
            remove(tmp)
            raise
        h = reader.header
    summary = {
        "output": str(out),
        "target_version": h.target_version,
        "changed_elements": h.changed_elements,
        "verified": True,
        "seconds": round(time.perf_counter() - t0, 3),
    }
    if a.json:
        print(json.dumps(summary))
    else:
        print(
            f"wrote {out}: {h.changed_elements:,} elements changed, all "
            f"{len(h.tensors)} tensor fingerprints verified"
        )
    return 0


# ---------------------------------------------------------------- inspect


def inspect_summary(reader: PatchReader) -> dict:
    """A JSON-able description of a patch: header fields, sizes and one row per tensor."""
    h = reader.header
    changed = h.changed_elements
    return {
        "format_version": h.format_version,
        "run": h.run,
        "base_version": h.base_version,
        "target_version": h.target_version,
        "view": h.view,
        "created": h.created,
        "producer": h.producer,
        "changed_elements": changed,
        "total_elements": h.total_elements,
        "changed_fraction": changed / max(h.total_elements, 1),
        "patch_bytes": reader.size,
        "bits_per_changed_element": 8 * reader.size / changed if changed else None,
        "base_digest": h.base_digest,
        "target_digest": h.target_digest,
        "tensors": [
            {
                "name": t.name,
                "dtype": t.dtype,
                "shape": t.shape,
                "kind": t.kind,
                "note": t.note,
                "changed": t.changed,
                "encoding": t.encoding,
                "bytes": t.nbytes,
                "chunks": len(t.chunks),
            }
            for t in h.tensors
        ],
    }


def cmd_inspect(a: argparse.Namespace) -> int:
    """`stitch inspect`: describe a patch (a table, or JSON); returns the exit status."""
    with PatchReader(a.patch) as reader:
        s = inspect_summary(reader)
    if a.json:
        print(json.dumps(s))
        return 0
    print(
        f"run {s['run']}  version {s['base_version']} -> {s['target_version']}  "
        f"view {s['view']}  ({s['producer']}, {s['created']})"
    )
    rows = [t for t in s["tensors"] if a.all or t["changed"] or t["kind"] != "patch"]
    w = max([len(t["name"]) for t in rows] + [6])
    print(f"{'tensor':<{w}}  {'dtype':<8} {'kind':<7} {'changed':>12} {'bytes':>11}  encoding")
    for t in rows:
        kind = t["kind"] + (f" ({t['note']})" if t["note"] else "")
        print(
            f"{t['name']:<{w}}  {t['dtype']:<8} {kind:<7} {t['changed']:>12,} "
            f"{t['bytes']:>11,}  {t['encoding']}"
        )
    hidden = len(s["tensors"]) - len(rows)
    if hidden:
        print(f"({hidden} unchanged tensors not shown; --all shows them)")
    bpc = s["bits_per_changed_element"]
    print(
        f"total: {s['changed_elements']:,} of {s['total_elements']:,} elements changed "
        f"({100 * s['changed_fraction']:.3f}%), {s['patch_bytes']:,} bytes"
        + (f", {bpc:.2f} bits per changed element" if bpc else "")
    )
    return 0
