"""Versions on a board: write one (objects, then manifest, then `latest`), read and verify one,
and plan how a holder of version `have` reaches version `target`.

Size: about 410 lines, one job: the versions of a run on a board: write them, read them
through their checks, and plan a path between them from what those checked reads return. `Step`
and `plan` are pinned at this path beside `read_manifest` (tests/test_architecture.py)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal, TypeVar

from pydantic import ValidationError

from stitch_core.failpoints import kill_point
from stitch_core.versions import verified
from stitch_core.versions.board.base import (
    BadCopyError,
    Board,
    BoardError,
    NotFoundError,
    TooLargeError,
    sha256_file,
)
from stitch_core.versions.manifest import (
    MAX_MANIFEST_BYTES,
    Latest,
    Manifest,
    ObjectRef,
    Span,
    manifest_key,
    span_key,
    version_dir,
)
from stitch_core.versions.trust import SigningKey, TrustSet, UntrustedVersionError

log = logging.getLogger("stitch.store")
M = TypeVar("M", Manifest, Span)


class VersionError(BoardError):
    """A version on the board is malformed, foreign, or its objects do not match the manifest."""


class RefusedVersionError(VersionError, UntrustedVersionError):
    """A version (or `latest`) the trust set does not accept: unsigned, signed by an untrusted
    key, or its signature does not match (both a VersionError and an UntrustedVersionError).
    `version`: the version refused (for `latest`: the one it claims)."""

    def __init__(self, message: str, version: int):
        super().__init__(message)
        self.version = version


def _checked(trust: TrustSet, obj: Manifest | Latest, kind: str, what: str,
             version: int) -> str:
    """`trust.check(...)`, its refusal as a RefusedVersionError of `version`."""
    try:
        return trust.check(obj, kind, what)
    except UntrustedVersionError as e:
        raise RefusedVersionError(str(e), version) from None


def now() -> str:
    """The current UTC time in ISO 8601 (milliseconds)."""
    return datetime.now(UTC).isoformat(timespec="milliseconds")


def object_ref(path: Path, role: str, name: str | None = None,
               sha256: str | None = None) -> ObjectRef:
    """An ObjectRef for the file at `path` (named `name`, default its file name) in `role`.
    `sha256`: the file's digest where its writer computed it as it wrote (a patch's
    `PatchBuilder.sha256`), so the file is not read back to hash it."""
    return ObjectRef(path=name or path.name, size=path.stat().st_size,
                     sha256=sha256 or sha256_file(path), role=role)


async def write_version(board: Board, manifest: Manifest, files: dict[str, Path],
                        expected_latest: int | None, signer: SigningKey | None = None) -> None:
    """Upload objects, then the manifest, then CAS `latest` (each `put` is durable when it
    returns, so everything a version holds is stored before `latest` names it; a crash at any
    point before the move leaves `latest` at the previous version, see docs/versions.md).
    With `signer`, the manifest (unless already signed by it) and `latest` are signed."""
    if signer is not None and manifest.signed_by != signer.id:
        manifest = signer.sign(manifest, "manifest")
    vdir = version_dir(manifest.run, manifest.version)
    for ref in manifest.objects:
        await board.put(f"{vdir}/{ref.path}", files[ref.path], sha256=ref.sha256)
        kill_point("publish:after-object")
    kill_point("publish:after-objects")
    await board.put(manifest_key(manifest.run, manifest.version),
                    manifest.model_dump_json(indent=1).encode())
    kill_point("publish:after-manifest")
    latest = Latest(run=manifest.run, version=manifest.version, kind=manifest.kind,
                    updated=now())
    if signer is not None:
        latest = signer.sign(latest, "latest")
    await board.move_latest(manifest.run, expected_latest, latest)
    kill_point("publish:after-latest")


def check_signed(m: Manifest, trust: TrustSet | None) -> str | None:
    """The trusted key id that signed `m` (None without a trust set); RefusedVersionError if the
    trust set does not accept it."""
    if not trust:
        return None
    return _checked(trust, m, "manifest", f"{m.run} v{m.version}", m.version)


async def _read_doc(board: Board, key: str, model: type[M], limit: int, what: str) -> M:
    """The document at `key` parsed strictly as `model`; VersionError (naming `what`) if it is
    over `limit` bytes or malformed (unusable alike: the planner may route around it)."""
    try:
        raw = await board.get(key, limit)
    except TooLargeError as e:
        raise VersionError(f"{what} refused: {e}") from None
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        first = " ".join(str(e).splitlines()[:3])
        raise VersionError(f"malformed {what}: {first}") from None


async def read_manifest(board: Board, run: str, version: int,
                        trust: TrustSet | None = None) -> Manifest:
    """The manifest of `run` v`version` on the board; VersionError if malformed or misplaced,
    RefusedVersionError if a trust set is given and does not accept its signature."""
    m = await _read_doc(board, manifest_key(run, version), Manifest, MAX_MANIFEST_BYTES,
                        f"manifest of {run} v{version}")
    if m.run != run or m.version != version:
        raise VersionError(f"manifest at {run} v{version} describes {m.run} v{m.version} "
                           "(foreign or misplaced)")
    check_signed(m, trust)
    return m


async def read_latest(board: Board, run: str, trust: TrustSet | None = None) -> Latest | None:
    """`run`'s `latest` pointer (None if there is none yet); with a trust set, RefusedVersionError
    unless it is signed by a trusted key."""
    try:
        latest = await board.read_latest(run)
    except ValueError as e:  # pydantic's ValidationError: what the board holds is not a Latest
        first = " ".join(str(e).splitlines()[:3])
        raise VersionError(f"malformed latest for {run}: {first}") from None
    if latest is None or not trust:
        return latest
    if latest.run != run:
        raise VersionError(f"latest of {run} names run {latest.run}")
    _checked(trust, latest, "latest", f"{run} latest (v{latest.version})", latest.version)
    return latest


async def fetch_patch(board: Board, m: Manifest, cache: Path) -> list[Path]:
    """All parts of a version's patch, fetched and verified."""
    return [await fetch_object(board, m, ref, cache) for ref in m.patches]


async def fetch_object(board: Board, m: Manifest, ref: ObjectRef, cache: Path) -> Path:
    """Download one object into the node-local cache once; verify size and SHA-256. A verified
    file is recorded (`verified`): a later reader in this process does not hash it again."""
    dest = cache / m.run / f"{m.version:06d}" / ref.path
    if verified.identity(dest, ref.sha256) is not None:
        return dest  # verified by this process and unchanged since
    if dest.is_file() and dest.stat().st_size == ref.size and \
            await asyncio.to_thread(sha256_file, dest) == ref.sha256:
        verified.record(dest, ref.sha256)
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:  # checked against the manifest; a FallbackBoard tries the next board on a bad copy
        await board.get_verified(f"{version_dir(m.run, m.version)}/{ref.path}", dest,
                                 ref.size, ref.sha256)
    except BadCopyError as e:
        raise VersionError(f"{m.run} v{m.version}/{ref.path}: checksum mismatch ({e})") \
            from None
    verified.record(dest, ref.sha256)
    return dest


MAX_SPAN_BYTES = 1 << 20  # a span document lists its objects only (a few hundred bytes)


async def read_span(board: Board, run: str, version: int, base: int,
                    trust: TrustSet | None = None) -> Span | None:
    """The span from `base` straight to `version`, if the board holds one (None if not);
    VersionError if malformed or misplaced, RefusedVersionError if the trust set refuses it."""
    what = f"span {run} v{base}->v{version}"
    try:
        sp = await _read_doc(board, span_key(run, version, base), Span, MAX_SPAN_BYTES, what)
    except NotFoundError:
        return None
    if (sp.run, sp.base, sp.version) != (run, base, version):
        raise VersionError(f"span at {run} v{base}->v{version} describes {sp.run} "
                           f"v{sp.base}->v{sp.version} (foreign or misplaced)")
    if trust:
        _checked(trust, sp, "span", what, version)
    return sp


async def write_span(board: Board, span: Span, files: dict[str, Path],
                     signer: SigningKey | None = None) -> Span:
    """Upload a span's objects, then the span document (signed with `signer`): readers find
    the document only once everything it names is stored."""
    if signer is not None:
        span = signer.sign(span, "span")
    vdir = version_dir(span.run, span.version)
    for ref in span.objects:
        await board.put(f"{vdir}/{ref.path}", files[ref.path], sha256=ref.sha256)
    await board.put(span_key(span.run, span.version, span.base),
                    span.model_dump_json(indent=1).encode())
    return span


@dataclass(frozen=True)
class Step:
    """One move of a follower: load the snapshot `manifest` describes (`kind` "snapshot"), or
    apply its patch on top of `manifest.parent` ("patch"). A squashed span is a patch step too:
    `span` is set and `manifest` is the target's, reached from the span's base
    (`Span.as_manifest`). `files` is empty as planned; a fetched step (`fetched`) carries its
    local files: the patch's parts in order, or the snapshot's directory."""

    kind: Literal["snapshot", "patch"]
    manifest: Manifest
    files: tuple[Path, ...] = ()
    span: Span | None = None

    @property
    def version(self) -> int:
        return self.manifest.version

    @property
    def base(self) -> int | None:
        """The version this step starts from (None for a snapshot)."""
        return None if self.kind == "snapshot" else self.manifest.parent

    @property
    def label(self) -> Literal["snapshot", "patch", "span"]:
        """What `stitch plan` calls it: snapshot, patch (one published step) or span."""
        return "span" if self.span is not None else self.kind

    @property
    def bytes(self) -> int:
        """Bytes this step downloads: the patch (or span), or the snapshot's weights and side
        files."""
        if self.kind == "patch":
            return self.manifest.patch_bytes
        return sum(o.size for o in self.manifest.objects if o.role != "patch")

    def fetched(self, files: Iterable[Path]) -> Step:
        """This step with its local files."""
        return replace(self, files=tuple(files))

    @property
    def patch_parts(self) -> list[Path]:
        """A fetched patch step's files, in part order ([] for a snapshot or before fetching)."""
        return list(self.files) if self.kind == "patch" else []

    @property
    def snapshot_dir(self) -> Path | None:
        """A fetched snapshot step's directory (None for a patch or before fetching)."""
        return self.files[0] if self.kind == "snapshot" and self.files else None

    @property
    def paths(self) -> list[Path] | None:
        """The patch's parts once fetched (None otherwise); kept for one release, as
        `patch_parts`."""
        return self.patch_parts or None


# newest versions of the chain probed for a span from the follower's version (a span may lag
# the newest version while `stitch squash` builds it; the rest of the way is then the chain)
SPAN_PROBES = 4


def path_bytes(steps: Iterable[Step]) -> int:
    """Bytes a path downloads (what the planner minimises)."""
    return sum(s.bytes for s in steps)


async def plan(board: Board, run: str, have: int | None, target: int,
               max_chain: int = 64, *, fallback_ok: bool = True,
               trust: TrustSet | None = None, avoid: frozenset[int] = frozenset(),
               avoid_spans: frozenset[tuple[int, int]] = frozenset(), spans: bool = True
               ) -> list[Step]:
    """Cheapest known path by bytes from `have` (None: nothing) to `target`.

    Walk parents back from target; every version with a patch object is a patch step. The
    walk stops at `have` (a chain), or at a snapshot when the chain would be longer than
    max_chain, broken (missing or malformed manifest), or there is nothing held. The candidates
    are then: the chain; the nearest snapshot on it plus the patches after it; and, with
    `spans`, a squashed span from `have` straight to one of the SPAN_PROBES newest versions of
    the walk plus the patches after it. The one that downloads the fewest bytes wins (fewer
    steps on a tie). Raises VersionError if there is no path. With a trust set every manifest
    and span used must be signed by one of its keys. `avoid`: versions whose patch keeps
    failing (a persistently bad object): paths through their patch are not taken, or
    VersionError if no other path reaches `target`; `avoid_spans`: (base, version) of spans
    that failed.
    """
    steps: list[Step] = []  # patch steps, target first
    walked: list[Manifest] = []  # every manifest read, target first
    v: int | None = target
    fallback: list[Step] | None = None
    chain: list[Step] | None = None
    blocked: int | None = None  # a version of `avoid` the walk stopped at
    reason = "the chain of parents does not reach it"
    while v is not None and (have is None or v > have):
        try:
            m = await read_manifest(board, run, v, trust)
        except (NotFoundError, VersionError) as e:
            log.warning("version %s of %s unusable (%s); looking for a snapshot", v, run, e)
            reason = str(e)
            break
        walked.append(m)
        if m.kind == "snapshot":
            fallback = [Step("snapshot", m), *reversed(steps)]
            if have is None or m.patch is None or len(steps) >= max_chain or v in avoid:
                break
        if v in avoid:  # its patch keeps failing: a later snapshot or a span gets past it
            blocked = v
            break
        if m.patch is None:
            break
        steps.append(Step("patch", m))
        v = m.parent
    else:
        if v is not None and v == have:
            chain = list(reversed(steps))
    if have is None:
        if fallback is not None:
            return fallback
    else:
        options = [p for p in (chain, fallback) if p is not None]
        if spans:
            options += await _span_paths(board, run, have, walked, steps, trust, avoid_spans)
        if options:
            best = min(options, key=lambda p: (path_bytes(p), len(p)))
            if blocked is not None:
                log.warning("v%s of %s: its patch keeps failing; going %s", blocked, run,
                            f"through snapshot v{best[0].version}" if best[0].kind == "snapshot"
                            else f"through span v{best[0].base}->v{best[0].version}")
            return best
    if blocked is not None:
        raise VersionError(f"the patch of {run} v{blocked} keeps failing and no snapshot or "
                           f"span after it (up to v{target}) routes around it")
    if not fallback_ok:
        raise VersionError(f"no path from {run} v{have} to v{target}: {reason}")
    # chain broken or not reaching `have`: scan back for the nearest usable snapshot
    return await _from_snapshot(board, run, target, trust)


async def _span_paths(board: Board, run: str, have: int, walked: list[Manifest],
                      steps: list[Step], trust: TrustSet | None,
                      avoid_spans: frozenset[tuple[int, int]]) -> list[list[Step]]:
    """Paths that start with a span from `have` to one of the newest walked versions and go on
    with the walked patches after it."""
    out: list[list[Step]] = []
    for m in walked[:SPAN_PROBES]:
        if m.version <= have + 1 or (have, m.version) in avoid_spans:
            continue  # a span of one version is that version's patch
        try:
            sp = await read_span(board, run, m.version, have, trust)
        except VersionError as e:  # refused or malformed: the other paths remain
            log.warning("%s; not using it", e)
            continue
        if sp is None:
            continue
        if sp.digest != m.digest:
            log.warning("span %s v%d->v%d names another target digest; not using it", run,
                        have, m.version)
            continue
        rest = [s for s in reversed(steps) if s.version > m.version]
        out.append([Step("patch", sp.as_manifest(m), span=sp), *rest])
    return out


# manifests read at most when searching back for a snapshot (bounded work whatever the board or
# NATS claim: a target of 10**15 on a board that cannot list must not mean 10**15 reads)
MAX_SNAPSHOT_SCAN = 1024


async def _from_snapshot(board: Board, run: str, target: int,
                         trust: TrustSet | None = None) -> list[Step]:
    versions = await board.list_versions(run)
    candidates = sorted((x for x in versions if x <= target), reverse=True) if versions else \
        range(target, -1, -1)
    for i, s in enumerate(candidates):
        if i >= MAX_SNAPSHOT_SCAN:
            raise VersionError(f"no usable snapshot of {run} within {MAX_SNAPSHOT_SCAN} versions "
                               f"before v{target}")
        try:
            m = await read_manifest(board, run, s, trust)
        except (NotFoundError, VersionError):
            continue
        if m.kind != "snapshot":
            continue
        rest = await plan(board, run, s, target, fallback_ok=False, trust=trust) \
            if s < target else []
        return [Step("snapshot", m), *rest]
    raise VersionError(f"no path to {run} v{target}: no usable snapshot at or before it")


async def list_manifests(board: Board, run: str) -> list[Manifest]:
    """Every manifest of `run`, oldest first (boards that cannot list: walked back from latest)."""
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
