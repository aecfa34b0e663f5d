"""The `.stp` header: pydantic models of what a patch says about itself (no I/O here)."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from stitch_core.format.dtypes import INFOS
from stitch_core.format.entropy import min_stream_bytes

FORMAT_NAME = "stitch-patch"
FORMAT_VERSION = 2  # what this build writes; 2: streams may have several rANS lanes
READ_VERSIONS = (1, 2)  # what it reads (version 1 streams all have one lane)
MAX_NUMEL = 1 << 40  # elements per tensor
MAX_CHUNK_SPAN = 1 << 24  # positions per chunk: bounds every allocation of the decoder
MAX_NAME = 1024
DTYPE_NAMES = frozenset(i.name for i in INFOS)


class Chunk(BaseModel):
    """One chunk of a tensor entry: span, changed count, encodings, and where its payload lies
    (offset, sizes, CRC-32)."""

    model_config = ConfigDict(extra="forbid")
    start: int = Field(ge=0)
    stop: int = Field(ge=0)
    count: int = Field(ge=1)
    pos: Literal["all", "gaps", "bitmap"]
    val: Literal["ulp", "xor", "raw"]
    ctx: list[int] | None = None  # [exponent base, exponent buckets, sign] for ulp contexts
    offset: int = Field(ge=0)  # from the start of the file
    pos_bytes: int = Field(ge=0)
    val_bytes: int = Field(ge=0)
    crc32: int = Field(ge=0, lt=1 << 32)

    @model_validator(mode="after")
    def _span(self) -> Chunk:
        if not self.start < self.stop <= self.start + MAX_CHUNK_SPAN:
            raise ValueError(f"chunk span [{self.start}, {self.stop}) is empty or too large")
        if self.count > self.stop - self.start:
            raise ValueError("chunk count exceeds its span")
        if min_stream_bytes(self.count) > self.val_bytes:  # refused before any decoding
            raise ValueError(f"chunk claims {self.count} values in {self.val_bytes} bytes: over "
                             "the format's expansion limit (a decompression bomb?)")
        return self

    @property
    def nbytes(self) -> int:
        return self.pos_bytes + self.val_bytes

    @property
    def encoding(self) -> str:
        return f"{self.pos}+{self.val}" + ("/ctx" if self.ctx else "")


class TensorEntry(BaseModel):
    """A patch's entry for one tensor: name, dtype, shape, kind, fingerprints and chunks."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=MAX_NAME)
    dtype: str
    shape: list[int]
    kind: Literal["patch", "full", "removed"]
    note: str | None = None  # why a tensor is carried whole: added, reshaped, dtype changed
    base_fp: str | None = Field(default=None, pattern=r"^[0-9a-f]{16}$")
    target_fp: str | None = Field(default=None, pattern=r"^[0-9a-f]{16}$")
    changed: int = Field(ge=0)
    chunks: list[Chunk] = []

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if "\x00" in v:
            raise ValueError("NUL in tensor name")
        return v

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, v: str) -> str:
        if v not in DTYPE_NAMES:
            raise ValueError(f"unknown dtype {v!r}")
        return v

    @field_validator("shape")
    @classmethod
    def _shape(cls, v: list[int]) -> list[int]:
        if len(v) > 16 or any(not 0 <= d <= MAX_NUMEL for d in v) or math.prod(v) > MAX_NUMEL:
            raise ValueError(f"implausible shape {v}")
        return v

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.chunks)

    @property
    def encoding(self) -> str:
        encs = sorted({c.encoding for c in self.chunks})
        return ",".join(encs) if encs else ("removed" if self.kind == "removed" else "none")

    @model_validator(mode="after")
    def _chunks(self) -> TensorEntry:
        prev = 0
        for c in self.chunks:
            if c.start < prev or c.stop > self.numel:
                raise ValueError(f"{self.name}: chunks overlap, are unsorted or out of range")
            prev = c.stop
        if sum(c.count for c in self.chunks) != self.changed:
            raise ValueError(f"{self.name}: changed != sum of chunk counts")
        if self.kind == "full" and self.changed != self.numel:
            raise ValueError(f"{self.name}: a full tensor must carry every element")
        if self.kind == "removed" and (self.chunks or self.target_fp):
            raise ValueError(f"{self.name}: a removed tensor carries no data")
        if self.kind != "removed" and self.target_fp is None:
            raise ValueError(f"{self.name}: target fingerprint missing")
        if self.kind != "full" and self.base_fp is None:
            raise ValueError(f"{self.name}: base fingerprint missing")
        return self


class PatchHeader(BaseModel):
    """The whole `.stp` header: run, versions, view, both version digests and every tensor entry."""

    model_config = ConfigDict(extra="forbid")
    format: Literal["stitch-patch"] = FORMAT_NAME
    format_version: Literal[1, 2] = FORMAT_VERSION
    run: str | None = None
    base_version: int | None = None
    target_version: int | None = None
    view: str | None = None
    created: str
    producer: str
    base_digest: str
    target_digest: str
    tensors: list[TensorEntry]
    metadata: dict[str, str] = {}
    part: list[int] | None = None  # [index, count] of a multi-part patch (sharded producers)

    @model_validator(mode="after")
    def _unique(self) -> PatchHeader:
        names = [t.name for t in self.tensors]
        if len(set(names)) != len(names):
            raise ValueError("duplicate tensor names")
        if self.part is not None and (len(self.part) != 2 or not 0 <= self.part[0] < self.part[1]
                                      or self.part[1] > 1 << 16):
            raise ValueError(f"bad part {self.part}")
        return self

    @property
    def changed_elements(self) -> int:
        return sum(t.changed for t in self.tensors)

    @property
    def total_elements(self) -> int:
        return sum(t.numel for t in self.tensors if t.kind != "removed")
