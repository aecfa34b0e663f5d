"""The coordinator <-> rank RPC as typed messages (pure: dataclasses and numpy arrays, no I/O).

The coordinator sends one request to every tensor-parallel rank of its engine and gets one reply
per rank, in rank order. Engine adapters carry the messages as they are: both transports already
pickle (vLLM's `collective_rpc`, SGLang's control request), so arrays travel with their dtype and
shape and nothing on either side agrees on a byte convention. Requests name what they carry;
replies are what `RankReplica` returns, read by attribute.

Positions and held indices are int32 when the tensor has fewer than 2**31 elements (what
`index_dtype` picks; the arrays say which), values are the served dtype's integer bits.
"""

from __future__ import annotations

import pickle
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["Setup", "SetupReply", "Sums", "SumsReply", "Gather", "Held", "GatherReply", "Write",
           "WriteReply", "Prebuild", "PrebuildReply", "Undo", "Commit", "Done", "Load",
           "LoadFiles", "LoadReply", "Arm",
           "ArmReply", "Failed", "Request", "Reply", "index_dtype", "encode", "decode",
           "in_process"]


def index_dtype(bound: int) -> type[np.signedinteger]:
    """dtype of positions / indices below `bound`: int32 when they fit, else int64."""
    return np.int32 if bound <= 2**31 else np.int64


# ------------------------------------------------------------------ start-up and full checks
@dataclass(frozen=True)
class Setup:
    """Learn the layout of these served-view tensors ({name: (shape, dtype name)}) and prove it."""

    shapes: dict[str, tuple[tuple[int, ...], str]]
    # False: learn every group through the loaders (no cached layout, no layer templates)
    use_cache: bool = True


@dataclass(frozen=True)
class SetupReply:
    """A rank's layout and full sums: per tensor the sum of h over every copy it holds
    (`sums`) and the elements it maps (`mapped`); parameters a loader wrote constants into
    (`const`) or never wrote (`unwritten`), parameters no loader writes (`derived`), kernels'
    copies of weights kept in step by kind (`derived_copies`), stale ones (`stale_derived`) and
    closures over state no adapter registered (`unmanaged`); whether the layout came from the
    rank's layout cache (`cached`), how many layer groups took a learned twin's map
    (`templated`), and, when learned, the most bytes of shadows and index tensors it held at
    once (`learn_bytes`) and the groups loaded with the full HF-shaped index
    (`full_index_groups`; `layout_load`)."""

    rank: dict[str, Any]
    sums: dict[str, int]
    mapped: dict[str, int]
    learn_s: float
    sums_s: float
    const: dict[str, int] = field(default_factory=dict)
    unwritten: dict[str, int] = field(default_factory=dict)
    derived: list[str] = field(default_factory=list)
    derived_copies: dict[str, int] = field(default_factory=dict)
    stale_derived: list[str] = field(default_factory=list)
    unmanaged: list[str] = field(default_factory=list)
    cached: bool = False  # the layout came from the rank's layout cache, not from the loaders
    templated: int = 0  # layer groups whose map was a learned twin's (`layout_template`)
    learn_bytes: int = 0
    full_index_groups: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Sums:
    """Recompute the full per-copy sums of `names` (None: every tensor)."""

    names: list[str] | None = None


@dataclass(frozen=True)
class SumsReply:
    """A rank's full per-copy sums of the tensors asked for, and its stale derived copies."""

    sums: dict[str, int]
    stale_derived: list[str] = field(default_factory=list)


# ------------------------------------------------------------------ one apply
@dataclass(frozen=True)
class Gather:
    """Apply `id`, step 1: locate these HF flat positions per tensor and return their old bits.
    An apply over the coordinator's batch budget gathers in batches (`batch` 0, 1, ...; the rank
    keeps each batch's plan until that batch is written); a new `id` drops every earlier plan."""

    id: str
    positions: dict[str, np.ndarray]
    batch: int = 0


@dataclass(frozen=True)
class Held:
    """Old bits of the positions a rank holds: `index` into the request's positions (None: all
    of them, in order) and their `bits`."""

    index: np.ndarray | None
    bits: np.ndarray


@dataclass(frozen=True)
class GatherReply:
    """Per tensor the old bits of the positions the rank holds (`old`), and the time taken."""

    old: dict[str, Held]
    seconds: float


@dataclass(frozen=True)
class Write:
    """Apply `id`, step 2: new bits for every gathered position of each tensor, in gather order.
    `last` False: more batches of this apply follow (derived copies are rebuilt with the last).
    `staged`: write every batch whose bits `Prebuild` carried, in one call (`values` is empty):
    nothing of their size crosses the engine's channel inside the pause. Else `values` are the
    bits of batch `batch` (as gathered)."""

    id: str
    values: dict[str, np.ndarray]
    last: bool = True
    staged: bool = False
    batch: int = 0


@dataclass(frozen=True)
class WriteReply:
    """Per tensor the fingerprint delta of what is in memory now over every copy the rank holds
    (`delta`), the engine parameters written (`dirty`), the modules whose derived copies (packed,
    re-quantized) were rebuilt from them (`rebuilt`), the seconds that took (`rebuild_s`, part of
    `seconds`) and how many of them were built ahead and only installed (`ahead`)."""

    delta: dict[str, int]
    dirty: list[str]
    seconds: float
    rebuilt: list[str] = field(default_factory=list)
    rebuild_s: float = 0.0
    ahead: int = 0  # of `rebuilt`: installed from builds ahead of the pause (`Prebuild`)


@dataclass(frozen=True)
class Prebuild:
    """Apply `id`, between gather and write, while the engine serves: the new bits of batch
    `batch`, staged on the rank (the `Write` then says `staged` instead of carrying them; an
    apply over the coordinator's batch budget stages each of its batches in turn). With `build`
    (the last batch) the rank also starts building, off to the side, the kernels' copies of
    weights (packed layouts) the staged bits of every batch will change
    (`stitch_core.engine.prebuild`); the write installs them instead of rebuilding them in the
    pause. `values` None: only say how far the building is."""

    id: str
    values: dict[str, np.ndarray] | None = None
    batch: int = 0
    build: bool = True


@dataclass(frozen=True)
class PrebuildReply:
    """How many derived copies the rank builds ahead (`copies`, `nbytes` of their sources),
    whether all are built (`done`), the seconds since it started, why it built none (`why`),
    and once done the seconds of each step summed over the copies (`phases`: copy aside, write
    the bits, build, digest; on Linux `build_sys`, the kernel's share of build)."""

    id: str
    copies: int
    nbytes: int
    done: bool
    seconds: float = 0.0
    why: str = ""
    phases: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Undo:
    """Apply `id`, abort: restore the bits its write replaced."""

    id: str


@dataclass(frozen=True)
class Commit:
    """Apply `id`, done: forget its undo record, its gather plans and any bits staged for it
    (also sent for an apply that failed before anything was written: it only forgets)."""

    id: str


@dataclass(frozen=True)
class Done:
    """Reply to Undo / Commit."""

    id: str
    undone: bool = False


# ------------------------------------------------------------------ the engine's own loader
@dataclass(frozen=True)
class Load:
    """Load whole tensors through the model's `load_weights`: {name: (dtype name, shape, bits)}."""

    tensors: dict[str, tuple[str, tuple[int, ...], np.ndarray]]


@dataclass(frozen=True)
class LoadFiles:
    """Load every tensor of these safetensors files (a snapshot) through the model's loader."""

    files: list[str]


@dataclass(frozen=True)
class LoadReply:
    """How many tensors went through the model's loader, and the time taken."""

    loaded: int
    seconds: float


# ------------------------------------------------------------------ tests and chaos drills
@dataclass(frozen=True)
class Arm:
    """Arm a failpoint (`stitch_core.engine.failpoints`; refused unless the rank's process has
    STITCH_FAILPOINTS=1) on TP rank `rank` (None: every rank): at `point` of the next `times`
    writes (after `after` tensors of the write, at least one, for "write"), `action` it."""

    rank: int | None
    point: str = "write"  # "write" (mid-write) | "written" (wrote all, then the call fails)
    action: str = "raise"  # "raise" | "hang" (sleep `seconds`, then carry on) | "exit" | "off"
    seconds: float = 3600.0
    after: int = 0
    times: int = 1


@dataclass(frozen=True)
class ArmReply:
    """The failpoints armed on a rank now, and its rank info."""

    rank: dict[str, Any]
    armed: list[dict[str, Any]]


@dataclass(frozen=True)
class Failed:
    """A rank's request failed: what it raised. Adapters whose transport must get exactly one
    reply per rank (vLLM's) send this instead of raising, and raise once every rank answered."""

    error: str
    rank: dict[str, Any] = field(default_factory=dict)


Request = (Setup | Sums | Gather | Prebuild | Write | Undo | Commit | Load | LoadFiles | Arm)
Reply = (SetupReply | SumsReply | GatherReply | PrebuildReply | WriteReply | Done | LoadReply
         | ArmReply | Failed)


def encode(msg: Request | Reply) -> bytes:
    """The bytes an adapter's transport carries (the engine's own channel, between its own
    processes: pickle, as both engines' RPCs already use)."""
    return pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)


def decode(blob: bytes) -> Any:
    """The message `encode` turned into `blob`."""
    return pickle.loads(blob)


def in_process(replicas: Sequence[Any]) -> Callable[[Any], Awaitable[list[Any]]]:
    """A coordinator's RPC to ranks in this process (each with `handle(request)`, e.g.
    `RankReplica`), every message encoded and decoded both ways as an engine's transport does,
    so arrays arrive as they do there (`stitch warm`, tests, the dev harness)."""
    async def call(req: Any) -> list[Any]:
        req = decode(encode(req))
        return [decode(encode(r.handle(req))) for r in replicas]
    return call
