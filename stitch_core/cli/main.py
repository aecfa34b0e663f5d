"""The `stitch` command line: the parser, the patch verbs (diff, apply, inspect) and `main`.

Version verbs are in `stitch_core.cli.versions`; verbs of other packages arrive through the
``stitch.cli`` entry-point group (`add_plugin_verbs`). Every StitchError becomes exit 1 and one
line on stderr."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from importlib.metadata import entry_points
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from stitch_core.cli import gateway, keys, squash
from stitch_core.cli.versions import add_parsers
from stitch_core.distribution import PRODUCER
from stitch_core.errors import StitchError
from stitch_core.format.checkpoint import Checkpoint, open_checkpoint
from stitch_core.format.patch import PatchBuilder, check_compatible
from stitch_core.format.stp import PatchReader
from stitch_core.versions.materialize import apply_patches, remove, replace, tmp_sibling


class CliError(StitchError, RuntimeError):
    """Raised for a command-line request that cannot be carried out."""



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


# ---------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    """The `stitch` argument parser: patch verbs, version verbs and plugin verbs."""
    p = argparse.ArgumentParser(prog="stitch", description=__doc__)
    p.add_argument("--version", action="version", version=PRODUCER)
    sub = p.add_subparsers(dest="cmd", required=True)

    d = sub.add_parser("diff", help="write the patch that turns BASE into NEW")
    d.add_argument("base", help=".safetensors file or HF directory")
    d.add_argument("new", help=".safetensors file or HF directory")
    d.add_argument("-o", "--output", required=True, help="patch file to write (.stp)")
    d.add_argument("--run", help="run name recorded in the patch")
    d.add_argument("--base-version", type=int)
    d.add_argument("--target-version", type=int)
    d.add_argument("--view", help="served view recorded in the patch (e.g. bf16)")
    d.add_argument("--force", action="store_true", help="replace OUTPUT if it exists")
    d.add_argument("--json", action="store_true", help="print one JSON object")
    d.set_defaults(fn=cmd_diff)

    ap = sub.add_parser("apply", help="reconstruct the target version from BASE and PATCH")
    ap.add_argument("base")
    ap.add_argument("patch")
    ap.add_argument("-o", "--output", required=True, help="written in the same form as BASE")
    ap.add_argument("--force", action="store_true", help="replace OUTPUT if it exists")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.set_defaults(fn=cmd_apply)

    i = sub.add_parser("inspect", help="describe a patch")
    i.add_argument("patch")
    i.add_argument("--json", action="store_true", help="print one JSON object")
    i.add_argument("--all", action="store_true", help="list unchanged tensors too")
    i.set_defaults(fn=cmd_inspect)
    add_parsers(sub)
    keys.add_parsers(sub)
    squash.add_parsers(sub)
    gateway.add_parsers(sub)
    add_plugin_verbs(sub)
    return p


def add_plugin_verbs(sub: argparse._SubParsersAction) -> None:
    """Verbs other packages add through the ``stitch.cli`` entry-point group (each entry point is a
    function taking the subparsers): `stitch_trainer` adds ``publish`` and ``analyze``."""
    for ep in sorted(entry_points(group="stitch.cli"), key=lambda e: e.name):
        ep.load()(sub)


def main(argv: list[str] | None = None) -> int:
    """Run the `stitch` command line on `argv`; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except (StitchError, FileExistsError, ValueError) as e:  # every Stitch error is a StitchError
        print(f"stitch: error: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"stitch: error: {e.strerror or e}: {e.filename or ''}".rstrip(": "), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
