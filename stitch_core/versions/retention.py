"""Board retention (`stitch gc`, `Publisher(keep_snapshots=K)`): delete old versions without
breaking any follower's path from the newest snapshots.

The rule: walk the chain of `latest` back through its parents and find the newest `K` snapshot
versions on it; the oldest of them is the *cut*. Every version below the cut is deleted, every
version at or above it is kept (whatever its kind, on the chain or not). So:

* a follower at any kept version still has its chain of patches to `latest` (the chain of
  `latest` runs through the cut, and nothing at or above it goes);
* a newcomer, or a follower whose version was deleted, starts from a kept snapshot (the planner
  falls back to the nearest snapshot when a chain is broken);
* `latest` is never touched, nor anything newer than the version it names (a publish under way).

With fewer than `K` snapshots on the chain (or a chain broken before the K-th: a manifest
missing, malformed, or refused by the trust set), nothing is deleted. With a trust set only
snapshots signed by one of its keys count, so followers that trust only those keys keep a
snapshot they accept.

A version is deleted manifest first (no reader finds a manifest whose objects are gone; a
follower that read it just before gets NotFoundError for an object, and re-plans on its next tick),
then the objects its manifest lists, then its squashed spans (documents first), then whatever
else the board lists in its directory. The board's listing is the truth (`Board.list_keys`; a
local directory and a NATS board list): a version directory below the cut is emptied whether or
not it still has a manifest, so a gc or a squasher killed half-way leaves nothing that the next
gc does not find (objects a failed publish left below the cut go too). Only on a board that
cannot list keys are the spans found through the `spans.json` index.
"""

from __future__ import annotations

import contextlib
import logging

from pydantic import BaseModel, ValidationError

from stitch_core.versions.board.base import Board, BoardError, NotFoundError, ReadOnlyBoardError
from stitch_core.versions.manifest import (
    Manifest,
    check_run,
    manifest_key,
    span_doc_base,
    span_index_key,
    span_key,
    span_object,
    version_dir,
)
from stitch_core.versions.span_index import span_bases
from stitch_core.versions.store import VersionError, read_latest, read_manifest
from stitch_core.versions.trust import TrustSet

log = logging.getLogger("stitch.gc")


class Deleted(BaseModel):
    """One version gc deleted (or would delete): its kind (None: no manifest, or one that did not
    parse), its keys and their bytes (the manifest and the objects it lists)."""

    version: int
    kind: str | None
    objects: int
    bytes: int


class GcReport(BaseModel):
    """What a gc of one run did (or, with `dry_run`, would do)."""

    run: str
    board: str
    latest: int | None
    keep_snapshots: int
    kept_snapshots: list[int]  # newest first, on the chain of `latest`
    cut: int | None  # the oldest version kept (None: nothing to delete)
    deleted: list[Deleted]
    bytes_freed: int
    dry_run: bool
    reason: str | None = None  # why nothing was deleted, when nothing was


async def _newest_snapshots(board: Board, run: str, latest: int, k: int,
                            trust: TrustSet | None) -> tuple[list[int], str | None]:
    """The newest `k` snapshot versions on the chain of `latest` (fewer, and why, if the chain
    holds fewer or breaks first)."""
    snaps: list[int] = []
    v: int | None = latest
    while v is not None and len(snaps) < k:
        try:
            m = await read_manifest(board, run, v, trust)
        except (NotFoundError, VersionError) as e:
            return snaps, f"the chain of latest breaks at v{v}: {e}"
        if m.kind == "snapshot":
            snaps.append(v)
        v = m.parent
    if len(snaps) < k:
        return snaps, f"the chain of latest holds {len(snaps)} snapshot(s), fewer than {k}"
    return snaps, None


async def _doomed(board: Board, run: str, version: int,
                  listed: list[str] | None) -> tuple[Deleted, list[str]]:
    """What deleting `version` removes: its entry and its keys, the manifest first, then the
    objects it lists, then the span documents, then everything else the board lists in the
    version's directory (span objects, the span index, what a killed writer left). `listed`:
    the directory's keys as the board lists them (None: it cannot list; the spans are then
    found through the span index)."""
    key = manifest_key(run, version)
    try:
        raw: bytes | None = await board.get(key)
    except NotFoundError:
        raw = None
    m: Manifest | None = None
    if raw is not None:
        with contextlib.suppress(ValidationError):
            m = Manifest.model_validate_json(raw)
    keys = [key] if raw is not None else []
    size = len(raw or b"")
    vdir = version_dir(run, version)
    if m is not None:
        keys += [f"{vdir}/{o.path}" for o in m.objects]
        size += sum(o.size for o in m.objects)
    if listed is not None:
        rest = [k for k in listed if k not in keys]
        docs = [k for k in rest if span_doc_base(k.rsplit("/", 1)[-1]) is not None]
        keys += docs + [k for k in rest if k not in docs]
    else:
        for b in await span_bases(board, run, version):  # squashed spans ending there
            keys += [span_key(run, version, b), f"{vdir}/{span_object(b)}"]
        if await board.exists(span_index_key(run, version)):
            keys.append(span_index_key(run, version))
    if not keys:
        raise NotFoundError(f"{vdir}: nothing there")
    return Deleted(version=version, kind=m.kind if m else None, objects=len(keys),
                   bytes=size), keys


async def _listed_versions(board: Board, run: str) -> dict[int, list[str]] | None:
    """The keys under each version directory of `run`, as the board lists them (None: it
    cannot list keys)."""
    keys = await board.list_keys(f"{run}/versions")
    if keys is None:
        return None
    out: dict[int, list[str]] = {}
    for k in keys:
        parts = k.split("/")
        if len(parts) >= 4 and parts[2].isdigit():
            out.setdefault(int(parts[2]), []).append(k)
    return out


async def gc(board: Board, run: str, keep_snapshots: int, *, dry_run: bool = False,
             trust: TrustSet | None = None) -> GcReport:
    """Delete `run`'s versions below the oldest of the newest `keep_snapshots` snapshots on the
    chain of `latest` (see the module doc); `dry_run`: only report what would go. Raises
    ValueError for `keep_snapshots` < 1 and ReadOnlyBoardError for a board that cannot delete."""
    check_run(run)
    if keep_snapshots < 1:
        raise ValueError(f"keep_snapshots must be at least 1 (got {keep_snapshots}): gc never "
                         "deletes the last snapshot")
    if board.readonly:
        raise ReadOnlyBoardError(f"board {board.url} is read-only: run gc on the board it mirrors "
                            "(the directory an HTTP board serves, or a NATS board)")
    report = GcReport(run=run, board=board.url, latest=None, keep_snapshots=keep_snapshots,
                      kept_snapshots=[], cut=None, deleted=[], bytes_freed=0, dry_run=dry_run)
    latest = await read_latest(board, run)
    if latest is None:
        report.reason = f"run {run!r} has no latest on the board"
        return report
    report.latest = latest.version
    snaps, why = await _newest_snapshots(board, run, latest.version, keep_snapshots, trust)
    report.kept_snapshots = snaps
    if why is not None:
        report.reason = f"nothing deleted: {why}"
        return report
    report.cut = cut = snaps[-1]
    versions = await board.list_versions(run)
    if versions is None:
        raise BoardError(f"board {board.url} cannot list the versions of {run}")
    listed = await _listed_versions(board, run)
    for v in sorted(x for x in set(versions) | set(listed or ()) if x < cut):
        try:
            entry, keys = await _doomed(board, run, v,
                                        None if listed is None else listed.get(v, []))
        except NotFoundError:  # deleted meanwhile (another gc)
            continue
        if not dry_run:
            for key in keys:  # the manifest first: no reader sees a version without objects
                await board.delete(key)
        report.deleted.append(entry)
        report.bytes_freed += entry.bytes
    if not report.deleted:
        report.reason = f"nothing below v{cut} to delete"
    log.info("gc %s on %s: %s %d versions below v%d (%d bytes); kept snapshots %s", run,
             board.url, "would delete" if dry_run else "deleted", len(report.deleted), cut,
             report.bytes_freed, snaps)
    return report
