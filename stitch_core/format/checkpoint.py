"""Reading and writing HF-layout safetensors checkpoints: one file, or a directory of shards.

Tensors are loaded lazily one at a time (safetensors mmap), so diff/apply hold at most a shard's
worth of tensors. Stitch records `stitch.run` / `stitch.version` in each written shard's
`__metadata__`, which lets `stitch apply` refuse a patch made for another version.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from stitch_core.errors import StitchError

INDEX = "model.safetensors.index.json"


class CheckpointError(StitchError, ValueError):
    """Raised when a checkpoint cannot be opened or read."""



@dataclass
class Checkpoint:
    """An opened checkpoint (one file or an HF directory): the shard file of each tensor, and the
    `__metadata__` of the file (of its first shard, for a directory)."""

    path: Path
    is_dir: bool
    where: dict[str, str]  # tensor name -> shard file name
    metadata: dict[str, str] = field(default_factory=dict)

    @property
    def shards(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for name, shard in self.where.items():
            out.setdefault(shard, []).append(name)
        return dict(sorted(out.items()))

    def file(self, shard: str) -> Path:
        return self.path / shard if self.is_dir else self.path

    def names(self) -> list[str]:
        return sorted(self.where)

    def load(self, name: str) -> torch.Tensor:
        with safe_open(self.file(self.where[name]), framework="pt") as f:
            return f.get_tensor(name)

    def load_shard(self, shard: str) -> dict[str, torch.Tensor]:
        with safe_open(self.file(shard), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open API

    @property
    def version(self) -> int | None:
        v = self.metadata.get("stitch.version")
        return int(v) if v and v.isdigit() else None

    @property
    def run(self) -> str | None:
        return self.metadata.get("stitch.run")


def _shard_names(path: Path) -> list[str]:
    with safe_open(path, framework="pt") as f:
        return list(f.keys())


def _metadata(path: Path) -> dict[str, str]:
    with safe_open(path, framework="pt") as f:
        return dict(f.metadata() or {})


def open_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Open a .safetensors file or an HF directory (with or without an index file)."""
    p = Path(path)
    try:
        if p.is_file():
            return Checkpoint(p, False, {n: p.name for n in _shard_names(p)}, _metadata(p))
        if not p.is_dir():
            raise CheckpointError(f"{p}: no such file or directory")
        index = p / INDEX
        if index.exists():
            wm = json.loads(index.read_text())["weight_map"]
            for shard in set(wm.values()):
                if "/" in shard or "\\" in shard or shard.startswith("."):
                    raise CheckpointError(f"{index}: unsafe shard name {shard!r}")
        else:
            wm = {n: f.name for f in sorted(p.glob("*.safetensors")) for n in _shard_names(f)}
        if not wm:
            raise CheckpointError(f"{p}: no .safetensors files")
        first = sorted(set(wm.values()))[0]
        return Checkpoint(p, True, dict(wm), _metadata(p / first))
    except (OSError, json.JSONDecodeError, KeyError) as e:
        raise CheckpointError(f"{p}: cannot read checkpoint ({e})") from None
    except Exception as e:  # safetensors raises its own error types
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"{p}: not a safetensors checkpoint ({e})") from None


def save_shard(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    """Write `tensors` to the safetensors file `path` with `metadata`, and fsync it."""
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=metadata)
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def copy_side_files(src: Path, dst: Path) -> None:
    """Copy config/tokenizer/etc. (everything but weights and the index) from an HF directory."""
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != INDEX:
            shutil.copy2(f, dst / f.name)


def write_index(dst: Path, where: dict[str, str], total_size: int) -> None:
    """Write `dst`'s index file: `total_size` and the weight map `where`, sorted."""
    body = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(where.items()))}
    (dst / INDEX).write_text(json.dumps(body, indent=2) + "\n")


def tmp_sibling(out: Path) -> Path:
    """A hidden temporary path next to `out` (per process) to write before `replace`."""
    return out.parent / f".{out.name}.tmp-{os.getpid()}"


def remove(p: Path) -> None:
    """Delete `p` (a file or a directory tree) if it exists."""
    if p.is_dir():
        shutil.rmtree(p, ignore_errors=True)
    elif p.exists():
        p.unlink()


def replace(tmp: Path, out: Path, force: bool) -> None:
    """Move `tmp` to `out`, replacing an existing `out` only with `force` (else FileExistsError)."""
    if out.exists():
        if not force:
            raise FileExistsError(f"{out} exists (use --force to replace it)")
        remove(out)
    os.replace(tmp, out)


MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit on a header


def map_file(path: str | os.PathLike, *, writable: bool = False) -> dict[str, torch.Tensor]:
    """Every tensor of one safetensors file as a view of one mapping of the file: nothing is
    read until used, nothing is copied. With `writable` the mapping is shared, so a write into a
    tensor writes the file (the caller must own the file and stop using the tensors before it
    changes size). Raises CheckpointError for a header that does not describe the file's bytes
    (offsets outside the data, overlapping or misaligned tensors, sizes that do not match).

    Written by hand, not with `safe_open`: safetensors gives copies or private read-only maps,
    and `stitch publish` updates its local state in place (`stitch_trainer.publish_state`)."""
    from stitch_core.format import dtypes

    path = Path(path)
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            size = st.st_size
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if n < 2 or n > MAX_HEADER_BYTES or 8 + n > size:
                raise CheckpointError(f"{path.name}: not a safetensors file (header size {n})")
            doc = json.loads(f.read(n), parse_constant=_no_constant)
    except OSError as e:
        raise CheckpointError(f"cannot read {path} ({e.strerror})") from None
    except (ValueError, RecursionError) as e:  # JSON, UTF-8, Infinity/NaN, a 5000-digit int
        raise CheckpointError(f"{path.name}: unreadable safetensors header "
                              f"({str(e)[:200]})") from None
    if not isinstance(doc, dict):
        raise CheckpointError(f"{path.name}: unreadable safetensors header")
    start, data = 8 + n, size - 8 - n
    spans: list[tuple[int, int, str, torch.dtype, list[int]]] = []
    for name, e in doc.items():
        if name == "__metadata__":
            continue
        try:
            dt = dtypes.info(e["dtype"])
            shape = [_count(d) for d in e["shape"]]
            a, b = (_count(x) for x in e["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path.name}: bad header entry for {name!r}") from None
        numel = 1
        for d in shape:
            numel *= d
        # an empty tensor's other dimensions are not bounded by its bytes: by the index type
        if not a <= b <= data or b - a != numel * dt.itemsize or (start + a) % dt.itemsize \
                or any(d > _MAX_DIM for d in shape):
            raise CheckpointError(f"{path.name}: {name} does not lie in the file as its header "
                                  "says")
        spans.append((a, b, name, dt.torch_dtype, shape))
    spans.sort()
    for (_, b, x, *_), (a, _, y, *_) in zip(spans, spans[1:], strict=False):
        if a < b:
            raise CheckpointError(f"{path.name}: {x} and {y} overlap")
    try:
        storage = torch.UntypedStorage.from_file(str(path), shared=writable, nbytes=size)
        now = os.stat(path)
    except (OSError, RuntimeError) as e:
        raise CheckpointError(f"cannot map {path} ({e})") from None
    if (now.st_dev, now.st_ino, now.st_size) != (st.st_dev, st.st_ino, size):
        # replaced or resized while being read (a shared mapping of a shorter file grows it)
        raise CheckpointError(f"{path} changed while it was being mapped")
    out: dict[str, torch.Tensor] = {}
    for a, _, name, dtype, shape in spans:
        itemsize = torch.empty(0, dtype=dtype).element_size()
        try:
            out[name] = torch.empty(0, dtype=dtype).set_(storage, (start + a) // itemsize, shape)
        except (RuntimeError, TypeError, ValueError, OverflowError) as e:
            raise CheckpointError(f"{path.name}: {name}: {str(e)[:200]}") from None
    return out


_MAX_DIM = 2**48  # no dimension of a real tensor is larger; keeps every stride in int64


def _count(x: object) -> int:
    """A header's size or offset: a JSON integer, not negative (not a bool, a float, a string)."""
    if type(x) is not int or x < 0:
        raise ValueError(f"not a count: {x!r}")
    return x


def _no_constant(c: str) -> None:
    raise ValueError(f"{c} in a safetensors header")


_MADV_POPULATE_WRITE = 23  # Linux >= 5.14


def populate_writable(tensors: dict[str, torch.Tensor]) -> bool:
    """Fault in the pages of `map_file(..., writable=True)`'s mapping for writing, ahead of the
    writes (one madvise call instead of a fault per page as a write first touches it; on a file
    whose every page will be written, as a publish state at ~1% changed elements, it moves that
    cost off the writer's path). The bytes are unchanged. False where the kernel cannot (not
    Linux, older than 5.14)."""
    import ctypes
    import ctypes.util
    import sys

    if sys.platform != "linux" or not tensors:
        return False
    storage = next(iter(tensors.values())).untyped_storage()
    libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    ptr = storage.data_ptr()
    base = ptr & ~(os.sysconf("SC_PAGE_SIZE") - 1)
    return libc.madvise(base, storage.nbytes() + ptr - base, _MADV_POPULATE_WRITE) == 0
