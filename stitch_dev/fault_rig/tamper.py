"""Tampering with what the fault rig's trainer writes: a board with a fault in its upload path
(``TamperingBoard``), a decompression bomb (``bomb_patch``), and the bad bytes of the rows
(``corrupt``, ``truncate``)."""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from stitch_core.format import fingerprint as fpr
from stitch_core.versions.board import LocalBoard
from stitch_core.versions.manifest import Manifest

from .truth import RUN


def patch_key(run: str, version: int) -> str:
    return f"{run}/versions/{version:06d}/patch.stp"


def manifest_key_of(run: str, version: int) -> str:
    return f"{run}/versions/{version:06d}/manifest.json"


class TamperingBoard(LocalBoard):
    """The trainer's board with a fault in its upload path for chosen versions: `bad[v]` turns
    the patch bytes of v into other bytes; with `consistent` the manifest is rewritten to list
    the bad bytes' size and SHA-256 (a writer that hashes what it uploads: the follower's fetch
    checks pass and the engine's own proofs must refuse it), else the manifest keeps the good
    hash (an object damaged on the board: the fetch check refuses it). `pad_manifest[v]`: the
    manifest of v is padded to that many bytes. The good bytes are kept (`restore`)."""

    def __init__(self, root: Path):
        super().__init__(root)
        self.bad: dict[int, Callable[[bytes], bytes]] = {}
        self.consistent = True
        self.pad_manifest: dict[int, int] = {}
        self.good: dict[str, bytes] = {}
        self.bad_ref: dict[int, tuple[int, str]] = {}

    @staticmethod
    def _version(key: str) -> int | None:
        parts = key.split("/")
        if len(parts) == 4 and parts[1] == "versions" and parts[2].isdigit():
            return int(parts[2])
        return None

    async def put(self, key: str, src: bytes | Path, *, sha256: str | None = None) -> None:
        v = self._version(key)
        name = key.rsplit("/", 1)[-1]
        if v is not None and (v in self.bad or v in self.pad_manifest):
            data = src.read_bytes() if isinstance(src, Path) else bytes(src)
            if name == "patch.stp" and v in self.bad:
                self.good[key] = data
                data = self.bad[v](data)
                self.bad_ref[v] = (len(data), hashlib.sha256(data).hexdigest())
            elif name == "manifest.json":
                self.good[key] = data
                m = Manifest.model_validate_json(data)
                if v in self.bad and self.consistent:
                    size, sha = self.bad_ref[v]
                    objs = [o.model_copy(update={"size": size, "sha256": sha})
                            if o.role == "patch" else o for o in m.objects]
                    data = m.model_copy(update={"objects": objs}).model_dump_json(
                        indent=1).encode()
                if v in self.pad_manifest:
                    data = data + b" " * max(0, self.pad_manifest[v] - len(data))
            return await super().put(key, data)
        return await super().put(key, src, sha256=sha256)

    def restore(self) -> None:
        """Put the good bytes back in place (an operator repairing the board)."""
        for key, data in self.good.items():
            dst = self.root / key
            tmp = dst.with_name(dst.name + ".restore")
            tmp.write_bytes(data)
            os.replace(tmp, dst)
        self.good.clear()


def bomb_patch(base: dict[str, torch.Tensor], version: int) -> bytes:
    """A patch of `RUN` v(version - 1) -> v`version` that adds a 32 MiB constant tensor coded in
    under 4 KB by an encoder without the format's cap on symbol probability (as in
    tests/test_patch.py::test_a_decompression_bomb_is_refused_before_decoding)."""
    from stitch_core.format import entropy, header
    from stitch_core.format.patch import PatchBuilder

    saved = entropy.MIN_COST_SHIFT, header.min_stream_bytes
    entropy.MIN_COST_SHIFT, header.min_stream_bytes = 40, (lambda k: 0)
    try:
        with tempfile.TemporaryDirectory() as d:
            path = Path(d) / "bomb.stp"
            fps = fpr.state_fingerprints(base)
            with open(path, "wb") as f:
                b = PatchBuilder(f, run=RUN, base_version=version - 1, target_version=version,
                                 view="bf16")
                for name in sorted(base):
                    b.add(name, base[name], base[name], fps[name])
                b.add("w", None, torch.zeros(4096, 4096, dtype=torch.bfloat16), None)
                b.finish()
            return path.read_bytes()
    finally:
        entropy.MIN_COST_SHIFT, header.min_stream_bytes = saved


def corrupt(data: bytes) -> bytes:
    b = bytearray(data)
    b[20] ^= 0x40  # in the first chunk payload (the preamble is 16 bytes)
    return bytes(b)


def truncate(data: bytes) -> bytes:
    return data[: len(data) // 2]
