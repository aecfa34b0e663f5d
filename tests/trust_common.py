"""The signed-versions scenario both engine suites run against a real engine with STITCH_TRUST:
four attacks on version v + 1 written straight into the board directory (as anyone with write
access to the board could), each refused while the engine keeps serving v; then the real v + 1,
signed, is followed. `stage` holds the attackers' files."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from stitch_core.format import fingerprint as fpr
from stitch_core.format.patch import diff
from stitch_core.versions.manifest import Latest, Manifest, manifest_key
from stitch_core.versions.store import now, object_ref
from stitch_core.versions.trust import SigningKey
from stitch_dev.server import ServerProcess
from stitch_dev.trainer import AdamWTrainer

from .engine_common import forge_next_version


def _write(board_dir: Path, run: str, m: Manifest, patch: Path, latest: Latest) -> None:
    vdir = board_dir / run / "versions" / f"{m.version:06d}"
    vdir.mkdir(parents=True, exist_ok=True)
    (vdir / "patch.stp").write_bytes(patch.read_bytes())
    (board_dir / manifest_key(run, m.version)).write_text(m.model_dump_json(indent=1))
    (board_dir / run / "latest").write_text(latest.model_dump_json())


def consistent_forgery(trainer: AdamWTrainer, board_dir: Path, run: str, v: int,
                       stage: Path) -> tuple[Manifest, Path]:
    """v + 1 = the trainer's v with chosen values (1000.0) in every tensor, and a manifest whose
    fingerprints, digest, size and SHA-256 all match it: only a signature tells it apart."""
    good = Manifest.model_validate_json((board_dir / manifest_key(run, v)).read_text())
    with trainer.lock:
        cur = trainer.view()
    evil = {k: t.clone() for k, t in cur.items()}
    for t in evil.values():
        t.view(-1)[:5] = torch.tensor(1000.0, dtype=torch.bfloat16)
    p = stage / "evil" / "patch.stp"
    p.parent.mkdir(parents=True)
    diff(cur, evil, run=run, base_version=v, target_version=v + 1, view="bf16").write(p)
    fps = fpr.state_fingerprints(evil)
    rows = [(t.name, t.dtype, tuple(t.shape), fps[t.name]) for t in good.tensors]
    m = good.model_copy(update={
        "version": v + 1, "parent": v, "kind": "patch", "created": now(),
        "digest": fpr.digest(rows), "objects": [object_ref(p, "patch")], "signed_by": None,
        "signature": None, "changed_elements": None,
        "tensors": [t.model_copy(update={"fingerprint": fpr.fmt(fps[t.name])})
                    for t in good.tensors]})
    return m, p


def wait_refused(server: ServerProcess, version: int, want: str, timeout: float = 60) -> dict:
    """Poll /stitch/status until the follower reports `version` refused for a reason containing
    `want`."""
    deadline = time.monotonic() + timeout
    st = server.status()
    while time.monotonic() < deadline:
        ref = (st.get("follower") or {}).get("refused") or {}
        if ref.get("version") == version and want in ref.get("reason", ""):
            return st
        time.sleep(0.2)
        st = server.status()
    raise AssertionError(f"v{version} not refused for {want!r}: {st}")


def refuses_forgeries_then_follows_signed(server: ServerProcess, trainer: AdamWTrainer,
                                          board_dir: Path, run: str, trusted: Path,
                                          attacker: Path, stage: Path) -> None:
    """Run the scenario (see the module doc); every step asserted on the live engine."""
    v = server.status()["version"]
    signer, evil_key = SigningKey.load(trusted), SigningKey.load(attacker)
    forged = forge_next_version(trainer, board_dir, run, v, stage / "forge")
    good = forged.good  # the right next state, unsigned
    good_patch = forged.stage / "good" / "patch.stp"
    evil, evil_patch = consistent_forgery(trainer, board_dir, run, v, stage)
    unsigned_latest = Latest(run=run, version=v + 1, kind="patch", updated=now())
    signed = signer.sign(good, "manifest")
    edited = signed.model_copy(update={"tensors": [
        signed.tensors[0].model_copy(update={"fingerprint": evil.tensors[0].fingerprint}),
        *signed.tensors[1:]]})
    attacks = [
        ("unsigned (right bytes)", good, good_patch, unsigned_latest, "latest (v"),
        ("signed by an untrusted key", evil_key.sign(good, "manifest"), good_patch,
         evil_key.sign(unsigned_latest, "latest"), f"key {evil_key.id}, which is not trusted"),
        ("edited after signing", edited, good_patch, signer.sign(unsigned_latest, "latest"),
         "does not match its content"),
        ("consistent forgery", evil, evil_patch, signer.sign(unsigned_latest, "latest"),
         "is unsigned"),
    ]
    for what, m, patch, latest, want in attacks:
        _write(board_dir, run, m, patch, latest)
        st = wait_refused(server, v + 1, want)
        assert st["version"] == v, (what, st)
        assert st["follower"]["health"] == "degraded", (what, st)
        r = server.complete("Hello")  # still serving v, and says so
        assert r.status_code == 200 and r.json()["stitch"]["version_end"] == v, (what, r.text)
        r = server.complete("Hello", {"X-Stitch-Version": str(v + 1), "X-Stitch-Wait": "30"})
        assert r.status_code == 409, (what, r.text)
        err = r.json()["error"]
        assert err["reason"] == "refused" and want in err["message"], (what, err)
        assert f"v{v + 1}" in err["message"], (what, err)
    check = server.http.post("/stitch/verify").json()
    assert check["ok"] is True, check  # nothing was written
    # the operator publishes the real v + 1, signed: followed, proven
    _write(board_dir, run, signed, good_patch, signer.sign(unsigned_latest, "latest"))
    st = server.wait_version(v + 1, timeout=120)
    deadline = time.monotonic() + 30  # the follower's own error clears once its sync returns
    while st["follower"]["health"] != "ok" and time.monotonic() < deadline:
        time.sleep(0.2)
        st = server.status()
    assert st["follower"]["refused"] is None and st["follower"]["health"] == "ok", st
    assert server.http.post("/stitch/verify").json()["ok"] is True
