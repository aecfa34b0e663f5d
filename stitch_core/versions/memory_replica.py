"""`MemoryReplica`: an `apply` target of a `stitch_core.versions.follower.Follower` that holds a
version's tensors in host memory, verified at every step (tests, the demo, the benchmarks, and a
trainer-side follower, examples/fsdp2_publish.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch
from safetensors.torch import load_file

from stitch_core.format import fingerprint as fpr
from stitch_core.format.patch import apply as apply_patch
from stitch_core.format.stp import PatchError, PatchReader
from stitch_core.versions.manifest import Manifest
from stitch_core.versions.store import Step


class MemoryReplica:
    """An `apply` target holding a version's tensors in memory, verified at every step.

    Snapshots are loaded and every tensor's fingerprint checked against the manifest; patches are
    applied in place with undo on failure, using tracked fingerprints (cost ∝ patch size).
    """

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.fingerprints: dict[str, int] = {}
        self.digest: str | None = None

    async def __call__(self, step: Step, path: Path) -> None:
        await asyncio.to_thread(self._apply, step.manifest, step.kind, path, step.patch_parts)

    def _apply(self, m: Manifest, kind: str, path: Path, parts: list[Path] | None = None) -> None:
        want = m.fingerprints
        if kind == "snapshot":
            tensors: dict[str, torch.Tensor] = {}
            for f in sorted(path.glob("*.safetensors")):
                tensors.update(load_file(f))
            fps = fpr.state_fingerprints(tensors)
            if fps != want:
                raise PatchError(f"v{m.version}: snapshot fingerprints do not match the manifest")
            self.tensors, self.fingerprints, self.digest = tensors, fps, m.digest
            return
        with PatchReader(path) as r:
            h = r.header
            fps = {t.name: fpr.parse(t.target_fp) for t in h.tensors if t.target_fp}
        if h.run != m.run or h.target_version != m.version or fps != want:
            raise PatchError(f"patch file does not produce {m.run} v{m.version} of the manifest")
        # in place, undone on any error; every tensor's result is verified against `fps`
        apply_patch(self.tensors, list(parts or [path]), base_fingerprints=self.fingerprints,
                    inplace=True)
        self.fingerprints, self.digest = fps, m.digest
