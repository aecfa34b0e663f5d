"""Board mode of `stitch analyze`: the published versions' manifests, split by tensor group from
the patch headers when the patches are local (a local board, or the fetch cache)."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

from stitch_core.format.stp import PatchReader
from stitch_core.versions.board import LocalBoard, open_board
from stitch_core.versions.manifest import version_dir
from stitch_core.versions.materialize import default_cache_dir

from .groups import group_fractions, group_of, summary


async def _board_rows(url: str, run: str, cache: Path, fetch: bool) -> list[dict]:
    from stitch_core.versions.store import fetch_patch, list_manifests

    rows = []
    async with open_board(url) as board:
        for m in await list_manifests(board, run):
            row = {
                "version": m.version,
                "step": m.step,
                "kind": m.kind,
                "parent": m.parent,
                "changed_elements": m.changed_elements,
                "total_elements": m.total_elements,
                "patch_bytes": m.patch_bytes or None,
                "groups": None,
            }
            if m.changed_elements is not None:
                row["changed_fraction"] = m.changed_elements / max(m.total_elements, 1)
            if m.patches:
                if isinstance(board, LocalBoard):
                    paths = [board.root / version_dir(run, m.version) / r.path for r in m.patches]
                else:
                    paths = [cache / run / f"{m.version:06d}" / r.path for r in m.patches]
                if fetch and not all(p.is_file() for p in paths):
                    paths = await fetch_patch(board, m, cache)
                if all(p.is_file() for p in paths):
                    row["groups"] = _patch_groups(m, paths)
            rows.append(row)
    return rows


def _patch_groups(m, paths: list[Path]) -> dict[str, dict[str, float]]:
    groups: dict[str, dict[str, float]] = {}
    for t in m.tensors:
        c = groups.setdefault(
            group_of(t.name), {"total_elements": 0, "changed_elements": 0, "payload_bytes": 0}
        )
        c["total_elements"] += math.prod(t.shape)
    for p in paths:  # parts of a sharded patch each hold their slices' changes
        with PatchReader(p) as r:
            for e in r.header.tensors:
                c = groups[group_of(e.name)]
                c["changed_elements"] += e.changed
                c["payload_bytes"] += e.nbytes
    return group_fractions(groups)


def analyze_board(url: str, run: str, *, cache: Path | None = None, fetch: bool = False) -> dict:
    """Per published version: manifest totals, plus a per-group split where patches are local."""

    cache = cache or default_cache_dir()
    rows = asyncio.run(_board_rows(url, run, cache, fetch))
    note = None
    if any(r["groups"] is None and r["patch_bytes"] for r in rows):
        note = "some patches are not local: totals only for those (--fetch downloads them)"
    return {
        "mode": "board",
        "board": url,
        "run": run,
        "steps": rows,
        "summary": summary(rows),
        **({"note": note} if note else {}),
    }
