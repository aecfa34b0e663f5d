"""Checks shared by the engine suites (tests/vllm and tests/sglang run in venvs of their own, both
with stitch installed and transformers available): following published versions, a forged version
for the "refuse, keep serving, recover" tests, SSE parsing. The server subprocess, its command
lines and the trainer are the development harness's (stitch_dev.server, stitch_dev.procs,
stitch_dev.trainer)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

import torch

from stitch_core.format import fingerprint as fpr
from stitch_core.format.patch import diff
from stitch_core.versions.board import LocalBoard
from stitch_core.versions.manifest import Manifest
from stitch_core.versions.store import object_ref, read_manifest, write_version
from stitch_dev.server import ServerProcess
from stitch_dev.trainer import AdamWTrainer


def follow_versions(trainer: AdamWTrainer, server: ServerProcess, n: int, request) -> list[int]:
    """Publish `n` versions; after each, `request(v)` (a request pinned to v that waits for it)
    must answer 200 and the server's last apply be v. Returns the elements each apply changed,
    every one of them > 0 (a test whose versions change nothing could not fail)."""
    changed = []
    for _ in range(n):
        v = trainer.publish()
        r = request(v)
        assert r.status_code == 200, r.text
        last = server.wait_applied(v, timeout=60)["last_apply"]
        changed.append(last["changed"])
    assert all(changed), changed
    return changed


@dataclass
class ForgedVersion:
    """Version v + 1 written by hand: its manifest claims the fingerprints of a real next state,
    but the patch first put on the board produces another state (a forged or corrupted upload).
    `repair()` puts the right patch and manifest in place, as an operator would."""

    board_dir: Path
    run: str
    version: int
    stage: Path
    bad: Manifest
    good: Manifest

    def publish_bad(self) -> None:
        asyncio.run(write_version(LocalBoard(self.board_dir), self.bad,
                                  {"patch.stp": self.stage / "bad" / "patch.stp"},
                                  expected_latest=self.version - 1))

    def repair(self) -> None:
        vdir = self.board_dir / self.run / "versions" / f"{self.version:06d}"
        (vdir / "patch.stp").write_bytes((self.stage / "good" / "patch.stp").read_bytes())
        (vdir / "manifest.json").write_text(self.good.model_dump_json(indent=1))


def forge_next_version(trainer: AdamWTrainer, board_dir: Path, run: str, v: int,
                       stage: Path) -> ForgedVersion:
    """Forge v + 1 on top of the trainer's current state, which must be version v."""
    good = asyncio.run(read_manifest(LocalBoard(board_dir), run, v))
    with trainer.lock:
        cur = trainer.view()
    assert good.fingerprints == fpr.state_fingerprints(cur)
    nxt = {k: t.clone() for k, t in cur.items()}
    other = {k: t.clone() for k, t in cur.items()}
    for t in nxt.values():
        t.view(-1)[::97] = (t.view(-1)[::97].float() * 1.01 + 1e-3).to(torch.bfloat16)
    for t in other.values():
        t.view(-1)[::89] = (t.view(-1)[::89].float() * 0.99 - 1e-3).to(torch.bfloat16)
    (stage / "bad").mkdir(parents=True)
    (stage / "good").mkdir()
    kw = dict(run=run, base_version=v, target_version=v + 1, view="bf16")
    diff(cur, other, **kw).write(stage / "bad" / "patch.stp")
    diff(cur, nxt, **kw).write(stage / "good" / "patch.stp")
    fps = fpr.state_fingerprints(nxt)
    tensors = [t.model_copy(update={"fingerprint": fpr.fmt(fps[t.name])}) for t in good.tensors]

    def manifest(which: str) -> Manifest:
        ref = object_ref(stage / which / "patch.stp", "patch")
        return Manifest(run=run, version=v + 1, parent=v, kind="patch", view="bf16",
                        created=good.created, producer="test", tensors=tensors,
                        digest=fpr.digest((t.name, t.dtype, tuple(t.shape), fps[t.name])
                                          for t in tensors),
                        objects=[ref], total_elements=good.total_elements)

    return ForgedVersion(board_dir, run, v + 1, stage, manifest("bad"), manifest("good"))


def sse_events(text: str) -> list[tuple[str | None, object]]:
    """(event name or None, data: parsed JSON or '[DONE]') of each event of an SSE body."""
    import json

    out: list[tuple[str | None, object]] = []
    for ev in text.replace("\r\n", "\n").split("\n\n"):
        lines = ev.splitlines()
        name = next((ln[7:] for ln in lines if ln.startswith("event: ")), None)
        data = "\n".join(ln[6:] if ln.startswith("data: ") else ln[5:]
                         for ln in lines if ln.startswith("data:"))
        if data:
            out.append((name, data if data == "[DONE]" else json.loads(data)))
    return out


class Stamp:
    """The ``"stitch"`` field of an answer served wholly by version `v` of `run`, to compare with
    ``==``: run, version_start = version_end = v and, where the engine reported per-token spans
    (docs/protocol.md), one span of `v` from token 0 for every output; nothing else."""

    SPANS = ("version_spans", "choice_version_spans")

    def __init__(self, run: str, v: int):
        self.run, self.v = run, v

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, dict):
            return NotImplemented
        if {k: other.get(k) for k in ("run", "version_start", "version_end")} != {
                "run": self.run, "version_start": self.v, "version_end": self.v}:
            return False
        if set(other) - {"run", "version_start", "version_end", *self.SPANS}:
            return False
        outputs = other.get("choice_version_spans")
        if outputs is None:
            return "version_spans" not in other
        one = all(len(o) == 1 and o[0][0] == self.v and o[0][1] == 0 for o in outputs)
        single = other.get("version_spans") == outputs[0] if len(outputs) == 1 else \
            "version_spans" not in other
        return bool(outputs) and one and single

    def __repr__(self) -> str:
        return f"Stamp(run={self.run!r}, v={self.v}, spans of v only)"
