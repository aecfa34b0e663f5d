"""Signed versions on a real board: keys, signatures, trust sets, the follower, `stitch pull`.

Everything here runs on real files (a LocalBoard directory, real Publisher output, the `stitch`
CLI as a subprocess). The attacks are the ones of docs/security.md: an unsigned version, one signed
by a key outside the trust set, an edited manifest, a consistent forgery (a patch for another
state with its manifest's fingerprints, sizes and SHA-256 fixed up to match), a forged `latest`,
and signatures moved between a manifest and a `latest`.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from stitch_core.format import fingerprint as fpr
from stitch_core.format.patch import diff
from stitch_core.versions.board import LocalBoard
from stitch_core.versions.follower import Follower
from stitch_core.versions.manifest import Latest, Manifest, manifest_key
from stitch_core.versions.memory_replica import MemoryReplica
from stitch_core.versions.store import (
    RefusedVersionError,
    VersionError,
    now,
    object_ref,
    read_latest,
    read_manifest,
)
from stitch_core.versions.trust import (
    PublicKey,
    SigningKey,
    TrustError,
    TrustSet,
    UntrustedVersionError,
    new_key,
)
from stitch_trainer.publisher import Publisher

RUN = "signed"
STITCH = [sys.executable, "-m", "stitch_core.cli"]


def stitch(*args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([*STITCH, *map(str, args)], capture_output=True, text=True,
                          env={**os.environ, **(env or {})})


def _model(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.weight": torch.randn(48, 64, generator=g) * 0.02 for i in range(3)}


def _step(masters: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + seed)
    return {k: v + torch.randn(v.shape, generator=g) * 3e-4 for k, v in masters.items()}


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("keys")
    return {name: _new(d / name) for name in ("trainer", "rotated", "attacker")}


def _new(path: Path) -> Path:
    new_key(path)
    return path


@pytest.fixture(scope="module")
def signed_board(tmp_path_factory, keys) -> tuple[Path, list[dict[str, torch.Tensor]]]:
    """v0 (snapshot) .. v3 signed by the trainer's key; the bf16 view of each."""
    root = tmp_path_factory.mktemp("signed")
    masters, views = _model(0), []
    with Publisher(str(root / "board"), RUN, "bf16", signing_key=keys["trainer"]) as pub:
        for step in range(4):
            pub.publish(step, masters).result()
            views.append({k: v.to(torch.bfloat16) for k, v in masters.items()})
            masters = _step(masters, step)
    return root / "board", views


def _copy(board: Path, tmp: Path) -> Path:
    dst = tmp / "board"
    shutil.copytree(board, dst)
    return dst


def _equal(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k].view(torch.int16),
                                                    b[k].view(torch.int16)) for k in a)


# ------------------------------------------------------------------ keys


def test_keys_new_writes_private_0600_and_public_and_never_overwrites(tmp_path):
    r = stitch("keys", "new", tmp_path / "k")
    assert r.returncode == 0, r.stderr
    pub = r.stdout.strip()
    assert pub.startswith("ed25519:")
    assert stat.S_IMODE((tmp_path / "k").stat().st_mode) == 0o600
    assert (tmp_path / "k.pub").read_text().strip() == pub
    assert SigningKey.load(tmp_path / "k").public == PublicKey.parse(pub)
    again = stitch("keys", "new", tmp_path / "k")
    assert again.returncode == 1 and "exists" in again.stderr
    assert (tmp_path / "k.pub").read_text().strip() == pub  # untouched
    js = json.loads(stitch("keys", "new", tmp_path / "j", "--json").stdout)
    assert js["key_id"] == PublicKey.parse(js["public_key"]).id


def test_trust_set_reads_files_inline_keys_and_pem(keys, tmp_path):
    a, b = (SigningKey.load(keys[n]).public for n in ("trainer", "rotated"))
    ts = TrustSet.parse(f"{keys['trainer']}.pub, {b.text}")
    assert ts.ids == sorted([a.id, b.id])
    many = tmp_path / "fleet.pub"
    many.write_text(f"# the fleet's keys\n{a.text}\n\n{b.text}  # rotated in\n")
    assert TrustSet.parse([str(many)]).ids == ts.ids
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    pem = Ed25519PublicKey.from_public_bytes(a.raw).public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo).decode()
    (tmp_path / "a.pem").write_text(pem)
    assert TrustSet.parse([str(tmp_path / "a.pem")]).ids == [a.id]
    for bad in ("ed25519:AAAA", "nonsense", str(tmp_path / "missing.pub")):
        with pytest.raises(TrustError):
            TrustSet.parse([bad])
    assert not TrustSet.parse("") and not TrustSet.parse(None)


# ------------------------------------------------------------------ signatures


async def test_every_version_and_latest_are_signed(signed_board, keys):
    board_dir, _ = signed_board
    board = LocalBoard(board_dir)
    kid = SigningKey.load(keys["trainer"]).id
    ts = TrustSet.parse([f"{keys['trainer']}.pub"])
    for v in range(4):
        m = await read_manifest(board, RUN, v, ts)
        assert m.signed_by == kid and m.signature
    latest = await read_latest(board, RUN, ts)
    assert latest is not None and latest.version == 3 and latest.signed_by == kid
    # rotation: a set holding the old and a new key accepts it; one without the key does not
    both = TrustSet.parse([f"{keys['rotated']}.pub", f"{keys['trainer']}.pub"])
    assert (await read_manifest(board, RUN, 2, both)).version == 2
    other = TrustSet.parse([f"{keys['rotated']}.pub"])
    with pytest.raises(RefusedVersionError,
                       match=rf"{RUN} v2 is signed by key {kid}, which is not"):
        await read_manifest(board, RUN, 2, other)


def _signed(keys, name: str) -> SigningKey:
    return SigningKey.load(keys[name])


def test_signature_covers_every_field_and_is_bound_to_its_kind(signed_board, keys):
    board_dir, _ = signed_board
    m = asyncio.run(read_manifest(LocalBoard(board_dir), RUN, 2))
    ts = TrustSet.parse([f"{keys['trainer']}.pub"])
    assert ts.check(m, "manifest", "v2") == m.signed_by
    edits = {
        "parent": 0, "kind": "snapshot", "view": "fp16", "created": now(), "digest": "0" * 16,
        "changed_elements": 1, "total_elements": 1, "metadata": {"x": "y"},
        "objects": [m.objects[0].model_copy(update={"sha256": "f" * 64})],
        "tensors": [m.tensors[0].model_copy(update={"fingerprint": "0" * 16}), *m.tensors[1:]],
        "signed_by": _signed(keys, "attacker").id,
    }
    for field, value in edits.items():
        edited = m.model_copy(update={field: value})
        with pytest.raises(UntrustedVersionError):
            ts.check(edited, "manifest", "v2")
    # a manifest's signature does not sign a `latest`, and the other way round
    latest = Latest(run=RUN, version=2, kind="patch", updated=now(), signed_by=m.signed_by,
                    signature=m.signature)
    with pytest.raises(UntrustedVersionError, match="does not match"):
        ts.check(latest, "latest", "latest")
    signed_latest = _signed(keys, "trainer").sign(latest, "latest")
    assert ts.check(signed_latest, "latest", "latest")
    with pytest.raises(UntrustedVersionError, match="does not match"):
        ts.check(m.model_copy(update={"signature": signed_latest.signature}), "manifest", "v2")
    # a stored manifest re-serialised in another key order / indentation still verifies
    raw = json.loads(m.model_dump_json())
    again = Manifest.model_validate_json(json.dumps(dict(reversed(list(raw.items())))))
    assert ts.check(again, "manifest", "v2")


def _forge_next(board_dir: Path, views, tmp: Path, signer: SigningKey | None,
                *, edit_after_signing: bool = False) -> Manifest:
    """A consistent forgery of v4: a patch from v3 to an attacker's state, with a manifest whose
    fingerprints, digest, size and SHA-256 all match it (what fingerprints alone cannot catch);
    `signer`: signed by that key (None: unsigned). Written with a `latest` pointing at it."""
    good = Manifest.model_validate_json((board_dir / manifest_key(RUN, 3)).read_text())
    evil = {k: t.clone() for k, t in views[3].items()}
    for t in evil.values():
        t.view(-1)[:7] = torch.tensor(1000.0, dtype=torch.bfloat16)
    p = tmp / "forged.stp"
    diff(views[3], evil, run=RUN, base_version=3, target_version=4, view="bf16").write(p)
    fps = fpr.state_fingerprints(evil)
    rows = [(t.name, t.dtype, tuple(t.shape), fps[t.name]) for t in good.tensors]
    m = good.model_copy(update={
        "version": 4, "parent": 3, "created": now(), "digest": fpr.digest(rows),
        "objects": [object_ref(p, "patch", "patch.stp")], "signed_by": None, "signature": None,
        "tensors": [t.model_copy(update={"fingerprint": fpr.fmt(fps[t.name])})
                    for t in good.tensors]})
    latest = Latest(run=RUN, version=4, kind="patch", updated=now())
    if signer is not None:
        m, latest = signer.sign(m, "manifest"), signer.sign(latest, "latest")
    if edit_after_signing:
        m = m.model_copy(update={"created": now() + "x"})
    vdir = board_dir / RUN / "versions" / "000004"
    vdir.mkdir(parents=True, exist_ok=True)
    shutil.copy(p, vdir / "patch.stp")
    (vdir / "manifest.json").write_text(m.model_dump_json(indent=1))
    (board_dir / RUN / "latest").write_text(latest.model_dump_json())
    return m


@pytest.mark.parametrize("attack", ["unsigned", "untrusted_key", "edited_after_signing"])
async def test_follower_refuses_forgeries_and_keeps_its_version(signed_board, keys, tmp_path,
                                                                attack):
    board_dir = _copy(signed_board[0], tmp_path)
    views = signed_board[1]
    trusted = _signed(keys, "trainer")
    ts = TrustSet.parse([f"{keys['trainer']}.pub"])
    replica = MemoryReplica()
    changes: list[dict] = []
    f = Follower(str(board_dir), RUN, replica, cache_dir=tmp_path / "cache", trust=ts)
    f.served.listen(lambda: changes.append(dict(f.served.refused)))
    assert await f.sync() == 3 and _equal(replica.tensors, views[3])
    signer = {"unsigned": None, "untrusted_key": _signed(keys, "attacker"),
              "edited_after_signing": trusted}[attack]
    _forge_next(board_dir, views, tmp_path, signer, edit_after_signing=attack.startswith("e"))
    # without a trust set the consistent forgery is applied: fingerprints cannot tell
    naive = MemoryReplica()
    async with Follower(str(board_dir), RUN, naive, cache_dir=tmp_path / "naive") as nf:
        if attack != "edited_after_signing":  # (an edited one is still well-formed)
            assert await nf.sync() == 4
            assert (naive.tensors["layers.0.weight"].view(-1)[:7] == 1000).all()
    with pytest.raises(RefusedVersionError) as e:
        await f.sync()
    reason = str(e.value)
    want = {"unsigned": "unsigned", "untrusted_key": f"key {_signed(keys, 'attacker').id}",
            "edited_after_signing": "does not match"}[attack]
    assert want in reason and "v4" in reason, reason
    assert f.version == 3 and _equal(replica.tensors, views[3])  # nothing applied
    st = f.status()
    assert st["refused"]["version"] == 4 and want in st["refused"]["reason"]
    assert st["trusted_keys"] == ts.ids
    assert dict(f.served.refused) == {4: reason}  # recorded once, where the gate reads it
    assert [c for c in changes if c] == [{4: reason}]
    assert not (tmp_path / "cache" / RUN / "000004").exists()  # nothing fetched either
    await f.stop()


async def test_forged_latest_pointer_moves_nothing(signed_board, keys, tmp_path):
    board_dir = _copy(signed_board[0], tmp_path)
    ts = TrustSet.parse([f"{keys['trainer']}.pub"])
    replica = MemoryReplica()
    f = Follower(str(board_dir), RUN, replica, cache_dir=tmp_path / "cache", trust=ts)
    assert await f.sync() == 3
    forged = Latest(run=RUN, version=10**15, kind="patch", updated=now())
    (board_dir / RUN / "latest").write_text(forged.model_dump_json())
    with pytest.raises(RefusedVersionError, match="latest .* unsigned"):
        await f.sync()
    assert f.version == 3 and f.latest == 3
    # replaying an older signed `latest` moves nothing either: latest only moves forward
    old = _signed(keys, "trainer").sign(Latest(run=RUN, version=1, kind="patch", updated=now()),
                                        "latest")
    (board_dir / RUN / "latest").write_text(old.model_dump_json())
    assert await f.sync() == 3 and f.latest == 3
    await f.stop()


async def test_refused_version_replaced_by_a_signed_one_is_followed(signed_board, keys, tmp_path):
    board_dir = _copy(signed_board[0], tmp_path)
    views = signed_board[1]
    ts = TrustSet.parse([f"{keys['trainer']}.pub"])
    replica = MemoryReplica()
    f = Follower(str(board_dir), RUN, replica, cache_dir=tmp_path / "cache", trust=ts)
    assert await f.sync() == 3
    _forge_next(board_dir, views, tmp_path, None)
    with pytest.raises(RefusedVersionError):
        await f.sync()
    assert 4 in f.served.refused
    # the operator re-publishes v4 signed (here: the same bytes, signed by the trainer's key)
    m = Manifest.model_validate_json((board_dir / RUN / "versions/000004/manifest.json")
                                     .read_text())
    signer = _signed(keys, "trainer")
    (board_dir / RUN / "versions/000004/manifest.json").write_text(
        signer.sign(m, "manifest").model_dump_json())
    (board_dir / RUN / "latest").write_text(signer.sign(
        Latest(run=RUN, version=4, kind="patch", updated=now()), "latest").model_dump_json())
    assert await f.sync() == 4
    assert 4 not in f.served.refused and f.status()["refused"] is None
    await f.stop()


async def test_unsigned_board_without_trust_set_works_as_before(tmp_path):
    masters = _model(1)
    with Publisher(str(tmp_path / "board"), RUN, "bf16") as pub:
        for step in range(2):
            pub.publish(step, masters).result()
            masters = _step(masters, step)
    board = LocalBoard(tmp_path / "board")
    m = await read_manifest(board, RUN, 1)
    assert m.signed_by is None and m.signature is None
    replica = MemoryReplica()
    async with Follower(str(tmp_path / "board"), RUN, replica, cache_dir=tmp_path / "c") as f:
        assert await f.sync() == 1
    with pytest.raises(RefusedVersionError, match="unsigned"):
        await read_manifest(board, RUN, 1, TrustSet.parse([PublicKey(b"\x01" * 32).text]))


# ------------------------------------------------------------------ pull / versions CLI


def test_pull_with_trust_refuses_before_writing_anything(signed_board, keys, tmp_path):
    board_dir, views = signed_board
    ok = stitch("pull", board_dir, "--run", RUN, "-o", tmp_path / "ok", "--cache-dir",
                tmp_path / "c", "--trust", f"{keys['rotated']}.pub",
                "--trust", f"{keys['trainer']}.pub", "--json")
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["version"] == 3
    pulled = Manifest.model_validate_json((tmp_path / "ok" / "stitch-manifest.json").read_text())
    assert pulled.signed_by == _signed(keys, "trainer").id  # the engine can prove it later
    bad = stitch("pull", board_dir, "--run", RUN, "--version", "2", "-o", tmp_path / "bad",
                 "--cache-dir", tmp_path / "c2", "--trust", f"{keys['attacker']}.pub")
    kid = _signed(keys, "trainer").id
    assert bad.returncode == 1
    assert f"signed by key {kid}, which is not trusted" in bad.stderr, bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "bad").exists() and not (tmp_path / "c2").exists()
    env = stitch("pull", board_dir, "--run", RUN, "-o", tmp_path / "env", "--cache-dir",
                 tmp_path / "c3", env={"STITCH_TRUST": str(keys["attacker"]) + ".pub"})
    assert env.returncode == 1 and not (tmp_path / "env").exists()


def test_versions_json_names_the_signing_key(signed_board, keys):
    board_dir, _ = signed_board
    kid = _signed(keys, "trainer").id
    r = stitch("versions", board_dir, "--run", RUN, "--json")
    rows = json.loads(r.stdout)["versions"]
    assert [x["signed_by"] for x in rows] == [kid] * 4
    r = stitch("versions", board_dir, "--run", RUN, "--json", "--trust", f"{keys['attacker']}.pub")
    assert all("not trusted" in x["trusted"] for x in json.loads(r.stdout)["versions"])
    r = stitch("versions", board_dir, "--run", RUN, "--trust", f"{keys['trainer']}.pub")
    assert r.returncode == 0 and r.stdout.count(f"{kid} ok") == 4


def test_publish_cli_signs_with_the_key(tmp_path, keys):
    from safetensors.torch import save_file

    save_file(_model(2), tmp_path / "m.safetensors")
    r = stitch("publish", tmp_path / "board", tmp_path / "m.safetensors", "--run", RUN,
               "--sign", keys["trainer"], "--json", "--cache-dir", tmp_path / "c")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["signed_by"] == _signed(keys, "trainer").id
    ts = TrustSet.parse([f"{keys['trainer']}.pub"])
    board = LocalBoard(tmp_path / "board")
    assert asyncio.run(read_latest(board, RUN, ts)).signed_by == _signed(keys, "trainer").id
    missing = stitch("publish", tmp_path / "board", tmp_path / "m.safetensors", "--run", RUN,
                     "--sign", tmp_path / "nope", "--cache-dir", tmp_path / "c")
    assert missing.returncode == 1 and "cannot read signing key" in missing.stderr


async def test_misplaced_signed_manifest_is_refused(signed_board, keys, tmp_path):
    """A genuinely signed manifest copied to another version's place is foreign, not v3."""
    board_dir = _copy(signed_board[0], tmp_path)
    src = board_dir / RUN / "versions" / "000002" / "manifest.json"
    (board_dir / manifest_key(RUN, 3)).write_text(src.read_text())
    with pytest.raises(VersionError, match="describes"):
        await read_manifest(LocalBoard(board_dir), RUN, 3,
                            TrustSet.parse([f"{keys['trainer']}.pub"]))
