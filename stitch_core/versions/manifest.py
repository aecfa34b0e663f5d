"""Version manifests: what a published version is, as pydantic models (no I/O here).

A version lives on a board under `<run>/versions/<version:06d>/`: `manifest.json` plus the objects
it lists. `kind` says how to build it: `snapshot` (full HF safetensors files, loadable by an engine
as is) or `patch` (a `.stp` from `parent`). A snapshot may also carry the patch from its parent, so
a follower one version behind never downloads the full weights.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

RUN_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,127}$")  # safe as a path and a NATS token
OBJECT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,254}$")  # one file name, no traversal
MANIFEST = "manifest.json"
# a pulled directory's copy of its version's manifest, next to the weights (`stitch pull` writes
# it, engines started from the directory read it)
PULLED_MANIFEST = "stitch-manifest.json"
KEY_ID_PATTERN = r"^[0-9a-f]{16}$"  # stitch_core.versions.trust.key_id
MAX_VERSION = 2**53 - 1  # the largest version number (exact as a JSON number everywhere)
SIGNATURE_MAX = 128
# size limits of what readers take from a board or NATS (refused before being read whole):
# a manifest lists every tensor (~150 bytes each: 64 MiB is ~400k tensors), `latest` and an
# announcement are a few hundred bytes
MAX_MANIFEST_BYTES = 64 << 20
MAX_LATEST_BYTES = 64 << 10
MAX_ANNOUNCEMENT_BYTES = 64 << 10  # base64 of a 64-byte ed25519 signature is 88 characters


def check_run(run: str) -> str:
    """`run` itself if it is a valid run name (safe as a path and a NATS token), else ValueError."""
    if not RUN_RE.match(run):
        raise ValueError(f"invalid run name {run!r} (letters, digits, '_' and '-', at most 128)")
    return run


def version_dir(run: str, version: int) -> str:
    """The board directory of a version: ``<run>/versions/<version:06d>``."""
    return f"{check_run(run)}/versions/{version:06d}"


def manifest_key(run: str, version: int) -> str:
    """The board key of a version's manifest."""
    return f"{version_dir(run, version)}/{MANIFEST}"


def latest_key(run: str) -> str:
    """The board key of `run`'s `latest` pointer."""
    return f"{check_run(run)}/latest"


class ObjectRef(BaseModel):
    """One file of a version: name in the version directory, size, SHA-256 and role."""

    model_config = ConfigDict(extra="forbid")
    path: str  # file name inside the version directory
    size: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    role: Literal["patch", "weights", "side"]

    @field_validator("path")
    @classmethod
    def _path(cls, v: str) -> str:
        if not OBJECT_RE.match(v) or ".." in v:
            raise ValueError(f"unsafe object path {v!r}")
        return v


class TensorInfo(BaseModel):
    """One tensor of a version: name, dtype, shape and fingerprint (16 hex digits)."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=1024)
    dtype: str
    shape: list[int]
    fingerprint: str = Field(pattern=r"^[0-9a-f]{16}$")


class Manifest(BaseModel):
    """A published version: how it is built (`kind`, `parent`), its tensors and its objects."""

    model_config = ConfigDict(extra="forbid")
    format: Literal["stitch-manifest"] = "stitch-manifest"
    format_version: Literal[1] = 1
    run: str
    version: int = Field(ge=0, le=MAX_VERSION)
    parent: int | None = None
    kind: Literal["patch", "snapshot"]
    view: str
    step: int | None = None
    created: str
    producer: str
    digest: str  # fingerprint digest of the whole version (see docs/format.md section 5)
    tensors: list[TensorInfo]
    objects: list[ObjectRef]
    changed_elements: int | None = None  # vs parent, when a patch was made
    total_elements: int = Field(ge=0)
    metadata: dict[str, str] = {}
    # ed25519 signature by the publisher (stitch_core.versions.trust): `signed_by` (the key id)
    # is part of what is signed, `signature` (base64) is not
    signed_by: str | None = Field(default=None, pattern=KEY_ID_PATTERN)
    signature: str | None = Field(default=None, max_length=SIGNATURE_MAX)

    @field_validator("run")
    @classmethod
    def _run(cls, v: str) -> str:
        return check_run(v)

    @model_validator(mode="after")
    def _consistent(self) -> Manifest:
        if self.parent is not None and not 0 <= self.parent < self.version:
            raise ValueError("parent must be an earlier version")
        if self.kind == "patch" and (self.parent is None or self.patch is None):
            raise ValueError("a patch version needs a parent and a patch object")
        if self.kind == "snapshot" and not self.weights:
            raise ValueError("a snapshot needs weight objects")
        paths = [o.path for o in self.objects]
        if len(set(paths)) != len(paths):
            raise ValueError("duplicate object paths")
        if self.patch is not None and self.parent is None:
            raise ValueError("a patch object needs a parent")
        return self

    @classmethod
    def from_rows(cls, *, run: str, version: int, parent: int | None, kind: str, view: str,
                  rows: Iterable[tuple[str, str, tuple[int, ...], int]],
                  objects: list[ObjectRef], producer: str, created: str,
                  step: int | None = None, changed: int | None = None) -> Manifest:
        """A version's manifest from its tensors' rows ((name, dtype name, shape, fingerprint),
        sorted here) and its objects: the one place the version digest and the element total
        are computed from the rows (publishers and `stitch warm` build with it)."""
        from stitch_core.format import fingerprint as fpr

        rows = sorted(rows)
        return cls(run=run, version=version, parent=parent, kind=kind, view=view, step=step,
                   created=created, producer=producer, digest=fpr.digest(rows),
                   tensors=[TensorInfo(name=n, dtype=d, shape=list(s), fingerprint=fpr.fmt(fp))
                            for n, d, s, fp in rows],
                   objects=objects, changed_elements=changed,
                   total_elements=sum(math.prod(s) for _, _, s, _ in rows))

    @property
    def patch(self) -> ObjectRef | None:
        return next(iter(self.patches), None)

    @property
    def patches(self) -> list[ObjectRef]:
        """The patch from the parent: one object, or one part per sharded producer."""
        return sorted((o for o in self.objects if o.role == "patch"), key=lambda o: o.path)

    @property
    def weights(self) -> list[ObjectRef]:
        return [o for o in self.objects if o.role == "weights"]

    @property
    def side_files(self) -> list[ObjectRef]:
        return [o for o in self.objects if o.role == "side"]

    @property
    def fingerprints(self) -> dict[str, int]:
        return {t.name: int(t.fingerprint, 16) for t in self.tensors}

    @property
    def patch_bytes(self) -> int:
        return sum(o.size for o in self.patches)

    @property
    def full_bytes(self) -> int:
        return sum(o.size for o in self.weights)


def span_key(run: str, version: int, base: int) -> str:
    """The board key of the span (squashed patch) from `base` straight to `version`."""
    return f"{version_dir(run, version)}/span-{base:06d}.json"


def span_object(base: int) -> str:
    """The name of a span's patch object in its target's version directory."""
    return f"span-{base:06d}.stp"


def span_index_key(run: str, version: int) -> str:
    """The board key of the list of spans that end at `version` (written by `stitch squash`):
    a hint derived from the span documents, rewritten after each change (docs/versions.md)."""
    return f"{version_dir(run, version)}/{SPAN_INDEX}"


SPAN_INDEX = "spans.json"
_SPAN_DOC_RE = re.compile(r"^span-(\d{6,})\.json$")


def span_doc_base(name: str) -> int | None:
    """The base of the span document named `name` (`span-000037.json` -> 37), else None."""
    m = _SPAN_DOC_RE.match(name)
    return int(m.group(1)) if m else None


def is_span_key(name: str) -> bool:
    """Whether the file `name` of a version directory belongs to its squashed spans (a span's
    document or object, or the span index)."""
    return name == SPAN_INDEX or name.startswith("span-")


class Span(BaseModel):
    """A squashed patch: `base` straight to `version`, carrying only the net difference (positions
    that changed and changed back are not in it). Built after both versions were published
    (`stitch squash`, stitch_core.versions.squash), stored beside the target version
    (`span_key`, its object `span_object(base)`), signed like a manifest (its own signature
    domain, so neither can stand in for the other). `digest` / `base_digest` are the target's
    and the base's manifest digests: a span names exactly the two versions it joins."""

    model_config = ConfigDict(extra="forbid")
    format: Literal["stitch-span"] = "stitch-span"
    format_version: Literal[1] = 1
    run: str
    base: int = Field(ge=0, le=MAX_VERSION)
    version: int = Field(ge=0, le=MAX_VERSION)
    base_digest: str = Field(max_length=128)
    digest: str = Field(max_length=128)
    objects: list[ObjectRef] = Field(min_length=1, max_length=4096)
    changed_elements: int = Field(ge=0)
    created: str = Field(max_length=64)
    producer: str = Field(max_length=256)
    signed_by: str | None = Field(default=None, pattern=KEY_ID_PATTERN)  # as in Manifest
    signature: str | None = Field(default=None, max_length=SIGNATURE_MAX)

    @field_validator("run")
    @classmethod
    def _run(cls, v: str) -> str:
        return check_run(v)

    @model_validator(mode="after")
    def _consistent(self) -> Span:
        if not self.base < self.version:
            raise ValueError("a span's base must be an earlier version")
        if any(o.role != "patch" for o in self.objects):
            raise ValueError("a span holds patch objects only")
        paths = [o.path for o in self.objects]
        if len(set(paths)) != len(paths) or any(not p.startswith("span-") for p in paths):
            raise ValueError("a span's objects are unique span-* files")
        return self

    @property
    def bytes(self) -> int:
        return sum(o.size for o in self.objects)

    def as_manifest(self, target: Manifest) -> Manifest:
        """The patch manifest a follower applies: `target` (its tensors and fingerprints, what
        the apply proves), reached from `base` through this span's objects. Built locally after
        both were checked (its own `signature` is dropped: it is never stored or re-checked)."""
        if target.run != self.run or target.version != self.version or \
                target.digest != self.digest:
            raise ValueError(f"span {self.base}->{self.version} does not end at "
                             f"{target.run} v{target.version}")
        return target.model_copy(update=dict(
            parent=self.base, kind="patch", objects=list(self.objects),
            changed_elements=self.changed_elements, signed_by=None, signature=None))


class SpanIndex(BaseModel):
    """`spans.json` of a version directory: the bases of the spans that end there, derived from
    the span documents (the truth) for readers that cannot list a board (HTTP); candidate names
    only: each span is still read and checked on its own, and retention lists the documents."""

    model_config = ConfigDict(extra="forbid")
    run: str
    version: int = Field(ge=0, le=MAX_VERSION)
    bases: list[int] = Field(max_length=1 << 16)


class Latest(BaseModel):
    """Content of `<run>/latest`: the newest complete version. Only ever moves forward."""

    model_config = ConfigDict(extra="forbid")
    run: str
    version: int = Field(ge=0, le=MAX_VERSION)
    kind: Literal["patch", "snapshot"]
    updated: str = Field(max_length=64)
    signed_by: str | None = Field(default=None, pattern=KEY_ID_PATTERN)  # as in Manifest
    signature: str | None = Field(default=None, max_length=SIGNATURE_MAX)

    @field_validator("run")
    @classmethod
    def _run(cls, v: str) -> str:
        return check_run(v)


class Announcement(BaseModel):
    """Published on `stitch.<run>.versions` for each new version."""

    model_config = ConfigDict(extra="ignore")
    run: str
    version: int = Field(ge=0, le=MAX_VERSION)
    parent: int | None
    kind: Literal["patch", "snapshot"]
    board: str  # board URL
    manifest: str  # key of the manifest on the board
    patch_bytes: int = 0
    digest: str = ""
    created: str = ""


def announcement(m: Manifest, board_url: str) -> Announcement:
    """The announcement of a published version."""
    return Announcement(run=m.run, version=m.version, parent=m.parent, kind=m.kind,
                        board=board_url, manifest=manifest_key(m.run, m.version),
                        patch_bytes=m.patch_bytes, digest=m.digest, created=m.created)


class Heartbeat(BaseModel):
    """Published by followers on `stitch.<run>.engines.<id>`."""

    model_config = ConfigDict(extra="ignore")
    id: str
    run: str
    url: str | None = None
    version: int | None
    latest: int | None = None
    state: Literal["serving", "applying", "catching_up", "not_ready"]
    lag: int | None = None
    region: str | None = None
    health: Literal["ok", "degraded", "dead"] = "ok"  # the follower's own (see Follower.health)
    error: str | None = None  # its last error while not ok
    # requests in flight in the engine's middleware (its VersionGate) at `time`; None: unknown
    load: int | None = Field(default=None, ge=0)
    time: float


class GatewayHeartbeat(BaseModel):
    """Published by `stitch gateway` on `stitch.<run>.gateways.<id>` (`stitch status` shows it)."""

    model_config = ConfigDict(extra="ignore")
    id: str
    run: str
    url: str | None = None
    region: str | None = None
    engines: int = 0  # engines it routes to now (fresh heartbeat, serving, not dead)
    versions: list[int] = []  # the versions those engines serve, ascending, distinct
    in_flight: int = 0
    requests_total: int = 0
    time: float
