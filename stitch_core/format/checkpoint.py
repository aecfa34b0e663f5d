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
