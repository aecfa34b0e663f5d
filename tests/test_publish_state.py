"""`stitch publish`'s local state (`stitch_trainer.publish_state`): the view it last published,
the base of its next patch when it is exactly the board's `latest`, rebuilt from the board
otherwise; a damaged state is never trusted, a crash never leaves one that looks valid, and a
damaged old object on the board does not stop a publish that has a valid state.

Real files, a real LocalBoard directory, the real `stitch` command in-process (`main`), and
real process deaths (`os._exit`) for the crash points."""

from __future__ import annotations

import asyncio
import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import stitch_core.versions.materialize as materialize
from stitch_core.cli.main import main
from stitch_core.format import codec
from stitch_core.format.codec import CodecError
from stitch_core.versions.board import BoardError, LocalBoard
from stitch_core.versions.store import read_manifest
from stitch_trainer import publish_state
from stitch_trainer.publish_state import Loaded, NotInPlaceError, advance, begin, load, state_dir

RUN = "ps"
NAMES = [f"model.layers.{i}.mlp.up_proj.weight" for i in range(3)] + ["model.norm.weight"]


def masters(step: int) -> dict[str, torch.Tensor]:
    """fp32 masters after `step` small steps: each step changes a few % of the bf16 elements."""
    g = torch.Generator().manual_seed(0)
    out = {n: torch.randn(64, 96, generator=g) * 0.02 for n in NAMES[:-1]}
    out["model.norm.weight"] = torch.ones(96)
    for _ in range(step):
        for n in NAMES[:-1]:
            out[n] += torch.randn(out[n].shape, generator=g) * 5e-5
    return out


def view(step: int) -> dict[str, torch.Tensor]:
    return {k: v.bfloat16() for k, v in masters(step).items()}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and torch.equal(a[k].view(torch.int16), b[k].view(torch.int16))
        for k in a)


@pytest.fixture
def env(tmp_path, monkeypatch):
    """board, cache, a `publish(step, cache=...)` running the real command in-process, and the
    number of times it materialised a base from the board (`pull`)."""
    pulls: list[int] = []
    real_pull = materialize.pull

    async def counting_pull(board, run, version, *a, **kw):
        pulls.append(version)
        return await real_pull(board, run, version, *a, **kw)

    monkeypatch.setattr(materialize, "pull", counting_pull)

    class Env:
        board = tmp_path / "board"
        cache = tmp_path / "cache"
        pulled = pulls

        def publish(self, step: int, cache: Path | None = None, board: Path | None = None,
                    ok: bool = True, capsys=None) -> tuple[int, dict | None, str]:
            src = tmp_path / f"m{step}.safetensors"
            save_file(masters(step), src)
            rc = main(["publish", str(board or self.board), str(src), "--run", RUN,
                       "--cache-dir", str(cache or self.cache), "--json", "--step", str(step)])
            out = capsys.readouterr() if capsys else None
            if ok:
                assert rc == 0, out.err if out else rc
            body = json.loads(out.out) if out and rc == 0 else None
            return rc, body, out.err if out else ""

        def board_view(self, board: Path | None = None) -> dict[str, torch.Tensor]:
            """The board's latest, materialised by a fresh `pull` (its own cache)."""
            out = tmp_path / f"check-{len(list(tmp_path.glob('check-*')))}"
            asyncio.run(real_pull(LocalBoard(board or self.board), RUN, None, out,
                                  tmp_path / "check-cache"))
            got = {}
            for f in sorted(out.glob("*.safetensors")):
                got.update(load_file(f))
            return got

        def manifest(self, version: int, board: Path | None = None):
            return asyncio.run(read_manifest(LocalBoard(board or self.board), RUN, version))

    return Env()


def state_doc(cache: Path) -> dict:
    return json.loads((state_dir(cache, RUN) / "state.json").read_text())


def view_file(cache: Path) -> Path:
    return state_dir(cache, RUN) / state_doc(cache)["file"]


def test_the_state_is_used_and_nothing_is_pulled(env, capsys):
    for step in range(4):
        _, body, err = env.publish(step, capsys=capsys)
        assert body["version"] == step and body["kind"] == ("snapshot" if step == 0 else "patch")
        assert "rebuilding" not in err, err
        assert state_doc(env.cache)["version"] == step
    assert env.pulled == []  # no base was materialised from the board
    assert same(env.board_view(), view(3))  # and the chain of patches made from it is right
    d = state_dir(env.cache, RUN)
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    files = [p for p in d.iterdir() if p.name != ".lock"]
    assert sorted(p.name for p in files) == sorted(["state.json", view_file(env.cache).name])
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in files)
    assert same(load_file(view_file(env.cache)), view(3))
    assert not list((env.cache / RUN).glob("pulled-*"))


def test_the_state_advances_in_place(env, capsys):
    """A publish from the state writes the changed elements into the same view file (no second
    copy of the view), which then is exactly the new version."""
    env.publish(0, capsys=capsys)
    f = view_file(env.cache)
    inode = f.stat().st_ino
    for step in (1, 2):
        _, body, err = env.publish(step, capsys=capsys)
        assert body["kind"] == "patch" and "rebuilding" not in err and "local state" not in err
        assert view_file(env.cache) == f and f.stat().st_ino == inode  # the same file
        assert state_doc(env.cache)["version"] == step
        assert same(load_file(f), view(step))
        assert isinstance(load(env.cache, RUN, env.manifest(step)), Loaded)
    assert env.pulled == []


def test_a_new_tensor_writes_the_whole_state_anew(env, capsys, tmp_path):
    """A patch that adds a tensor cannot be applied to the state's file: the whole view is
    written to a new file, and the next publish uses it."""
    env.publish(0, capsys=capsys)
    first = view_file(env.cache)
    src = tmp_path / "grown.safetensors"
    save_file(masters(1) | {"lm_head.bias": torch.zeros(8)}, src)
    assert main(["publish", str(env.board), str(src), "--run", RUN, "--cache-dir",
                 str(env.cache), "--json"]) == 0
    capsys.readouterr()
    assert view_file(env.cache) != first and not first.exists()
    assert set(load_file(view_file(env.cache))) == set(NAMES) | {"lm_head.bias"}
    assert isinstance(load(env.cache, RUN, env.manifest(1)), Loaded)
    save_file(masters(2) | {"lm_head.bias": torch.ones(8)}, src)
    assert main(["publish", str(env.board), str(src), "--run", RUN, "--cache-dir",
                 str(env.cache)]) == 0
    assert "rebuilding" not in capsys.readouterr().err and env.pulled == []


def _patch(board: Path, version: int) -> bytes:
    return (board / RUN / "versions" / f"{version:06d}" / "patch.stp").read_bytes()


def test_advance_refuses_a_patch_that_is_not_the_boards_version(env, capsys, tmp_path,
                                                                monkeypatch):
    """`advance` writes nothing for a patch whose result the manifest does not list, nor for a
    damaged one, and undoes what it wrote when the apply fails half-way: the state then still
    holds its version, still proven."""
    for step in range(3):
        env.publish(step, capsys=capsys, cache=tmp_path / "other")
    m1, m2 = env.manifest(1), env.manifest(2)
    assert begin(env.cache, RUN, view(1)).commit(m1) is None  # this cache holds the board's v1
    base = load(env.cache, RUN, m1)
    assert isinstance(base, Loaded)
    patch = _patch(env.board, 2)
    assert "does not make v1" in advance(env.cache, RUN, base, patch, m1)
    bad = bytearray(patch)
    bad[100] ^= 0x5A
    assert "checksum" in advance(env.cache, RUN, base, bytes(bad), m2)
    real, calls = codec.apply_cpu, []

    def fails_third(*a, **kw):  # the third tensor's decode fails: two were written
        calls.append(1)
        if len(calls) == 3:
            raise CodecError("corrupt entropy-coded stream")
        return real(*a, **kw)

    monkeypatch.setattr(codec, "apply_cpu", fails_third)
    why = advance(env.cache, RUN, base, patch, m2)
    assert why and "corrupt patch data" in why and len(calls) == 3, why
    assert state_doc(env.cache)["version"] == 1
    assert isinstance(load(env.cache, RUN, m1), Loaded)  # undone: still v1, still proven

    def fails_oddly(*a, **kw):  # not a patch error (a kernel's or the host's): said, not raised
        raise RuntimeError("out of something")

    monkeypatch.setattr(codec, "apply_cpu", fails_oddly)
    why = advance(env.cache, RUN, base, patch, m2)
    assert why and "RuntimeError: out of something" in why, why
    assert state_doc(env.cache)["version"] == 1
    assert isinstance(load(env.cache, RUN, m1), Loaded)
    monkeypatch.setattr(codec, "apply_cpu", real)
    assert advance(env.cache, RUN, load(env.cache, RUN, m1), patch, m2) is None
    assert same(load(env.cache, RUN, m2).view, view(2))


def test_advance_needs_the_same_tensors(env, capsys):
    env.publish(0, capsys=capsys)
    env.publish(1, capsys=capsys)
    base = load(env.cache, RUN, env.manifest(1))
    fewer = Loaded(base.version, {k: v for k, v in base.view.items() if k != NAMES[0]},
                   base.fingerprints, base.file)
    with pytest.raises(NotInPlaceError):
        advance(env.cache, RUN, fewer, _patch(env.board, 1), env.manifest(1))


def test_a_stale_state_is_rebuilt_from_the_board(env, capsys, tmp_path):
    env.publish(0, capsys=capsys)
    env.publish(1, capsys=capsys)
    other = tmp_path / "other-cache"  # another host publishes v2: this cache's state is stale
    _, _, err = env.publish(2, cache=other, capsys=capsys)
    assert "rebuilding ps v1 from the board (local state: no local state)" in err, err
    assert env.pulled == [1]
    _, body, err = env.publish(3, capsys=capsys)
    assert "it holds v1, the board's latest is v2" in err, err
    assert env.pulled == [1, 2] and body["version"] == 3 and body["kind"] == "patch"
    assert same(env.board_view(), view(3))
    assert state_doc(env.cache)["version"] == 3  # written again, now current
    env.publish(4, capsys=capsys)
    assert env.pulled == [1, 2]


def _flip(p: Path, at: int) -> None:
    b = bytearray(p.read_bytes())
    b[at] ^= 0x40
    p.write_bytes(bytes(b))


def _hostile_header(p: Path) -> None:
    """The view file's first shape made `Infinity` (valid JSON to Python's parser), the file's
    size kept (the data's tail cut by what the header grew)."""
    raw = p.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    head, k = re.subn(r'"shape":\[\d+', '"shape":[Infinity', raw[8:8 + n].decode(), count=1)
    assert k == 1
    new = head.encode().ljust(-(-len(head) // 8) * 8)
    out = len(new).to_bytes(8, "little") + new + raw[8 + n:]
    p.write_bytes(out[:len(raw)])
    assert p.stat().st_size == len(raw)


DAMAGES = {
    "view bit flipped": lambda c: _flip(view_file(c), view_file(c).stat().st_size - 7),
    "view truncated": lambda c: os.truncate(view_file(c), view_file(c).stat().st_size // 2),
    "view missing": lambda c: view_file(c).unlink(),
    "view replaced, size kept": lambda c: save_file(view(0), view_file(c)),
    "view header hostile": lambda c: _hostile_header(view_file(c)),
    "state.json truncated": lambda c: os.truncate(state_dir(c, RUN) / "state.json", 50),
    "state.json garbage": lambda c: (state_dir(c, RUN) / "state.json").write_bytes(
        os.urandom(300)),
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_state_is_rebuilt_not_trusted(env, capsys, damage):
    for step in range(3):
        env.publish(step, capsys=capsys)
    size = view_file(env.cache).stat().st_size
    DAMAGES[damage](env.cache)
    if damage == "view replaced, size kept":  # a valid file, other bits: only fingerprints see it
        assert view_file(env.cache).stat().st_size == size
    m2 = env.manifest(2)
    assert isinstance(load(env.cache, RUN, m2), str)
    _, body, err = env.publish(3, capsys=capsys)
    assert "rebuilding ps v2 from the board (local state:" in err, err
    assert env.pulled == [2] and body["kind"] == "patch" and body["version"] == 3
    assert same(env.board_view(), view(3))  # the patch was made against the board's v2
    assert env.manifest(3).parent == 2
    assert isinstance(load(env.cache, RUN, env.manifest(3)), Loaded)  # a good state again


def test_a_state_of_another_board_is_not_the_base(env, capsys, tmp_path):
    """Same run name, same version number, other bits (another board): the fingerprints differ
    from this board's manifest, so the state is not used."""
    env.publish(0, capsys=capsys)
    env.publish(1, capsys=capsys)  # this cache: v1 of board A
    board_b = tmp_path / "board-b"
    env.publish(5, board=board_b, cache=tmp_path / "cache-b", capsys=capsys)  # v0 of B
    env.publish(7, board=board_b, cache=tmp_path / "cache-b", capsys=capsys)  # v1 of B
    assert env.pulled == []
    _, body, err = env.publish(8, board=board_b, capsys=capsys)  # B, with A's state
    assert "fingerprints differ from the board's manifest" in err, err
    assert env.pulled == [1] and body["version"] == 2
    assert same(env.board_view(board_b), view(8))


def test_forged_fingerprints_in_the_state_are_not_trusted(env, capsys):
    for step in range(2):
        env.publish(step, capsys=capsys)
    p = state_dir(env.cache, RUN) / "state.json"
    doc = json.loads(p.read_text())
    doc["fingerprints"][NAMES[0]] = "0123456789abcdef"
    p.write_text(json.dumps(doc))
    _, _, err = env.publish(2, capsys=capsys)
    assert "fingerprints differ from the board's manifest" in err and env.pulled == [1]
    assert same(env.board_view(), view(2))


def test_a_damaged_old_object_does_not_stop_a_publish_with_a_valid_state(env, capsys):
    for step in range(3):  # v0 snapshot, v1 and v2 patches
        env.publish(step, capsys=capsys)
    vdir = env.board / RUN / "versions"
    _flip(vdir / "000000" / "model.safetensors", 4000)  # the snapshot every rebuild starts at
    _flip(vdir / "000001" / "patch.stp", 200)  # and an earlier patch of the chain
    _, body, err = env.publish(3, capsys=capsys)
    assert body["version"] == 3 and body["kind"] == "patch" and "rebuilding" not in err
    assert env.pulled == []  # nothing of v0..v2 was read: only v2's manifest
    # without the local state, the base must be rebuilt through the damaged objects: a clear
    # error, nothing published
    publish_state_dir = state_dir(env.cache, RUN)
    for p in publish_state_dir.iterdir():
        p.unlink()
    publish_state_dir.rmdir()
    rc, _, err = env.publish(4, ok=False, capsys=capsys)
    assert rc == 1
    lines = err.strip().splitlines()
    assert lines[0].startswith("stitch publish: rebuilding ps v3 from the board"), err
    assert lines[-1].startswith("stitch: error: ") and "checksum mismatch" in lines[-1], err
    latest = json.loads((env.board / RUN / "latest").read_text())
    assert latest["version"] == 3


# ---------------------------------------------------------------- crashes while writing


CHILD = r"""
import os, sys, json
from pathlib import Path
from safetensors.torch import load_file
from stitch_core.versions.manifest import Manifest
import stitch_trainer.publish_state as ps

cache, view_path, manifest_path, point = sys.argv[1:5]
m = Manifest.model_validate_json(Path(manifest_path).read_text())
real_save, real_replace = ps.save_file, os.replace

def dying_save(tensors, path, *a, **kw):  # dies half-way through writing the view file
    real_save(tensors, path, *a, **kw)
    os.truncate(path, os.path.getsize(path) // 2)
    os._exit(9)

def dying_replace(src, dst):
    if point == "view-rename" or (point == "state-rename" and str(dst).endswith("state.json")):
        os._exit(9)
    return real_replace(src, dst)

if point == "view-write":
    ps.save_file = dying_save
else:
    ps.os.replace = dying_replace
pending = ps.begin(Path(cache), m.run, load_file(view_path))
print(pending.commit(m))
os._exit(0)
"""


@pytest.mark.parametrize("point", ["view-write", "view-rename", "state-rename"])
def test_a_crash_mid_write_leaves_no_valid_looking_state(env, capsys, tmp_path, point):
    env.publish(0, capsys=capsys)
    env.publish(1, capsys=capsys)
    m1 = env.manifest(1)
    # what a publish of v2 hands the state once v2 is on the board: its view and manifest
    other = tmp_path / "c2"
    env.publish(2, cache=other, capsys=capsys)
    m2 = env.manifest(2)
    (tmp_path / "m2.json").write_text(m2.model_dump_json())
    before = state_doc(env.cache)
    r = subprocess.run([sys.executable, "-c", CHILD, str(env.cache), str(view_file(other)),
                        str(tmp_path / "m2.json"), point], capture_output=True, text=True,
                       cwd=Path(__file__).resolve().parents[1])
    assert r.returncode == 9, r.stderr  # died at the point, for real
    assert state_doc(env.cache) == before  # the commit point was never passed
    got = load(env.cache, RUN, m2)
    assert isinstance(got, str) and "it holds v1" in got  # nothing claims v2
    old = load(env.cache, RUN, m1)  # the previous state is intact, and still proven
    assert isinstance(old, Loaded) and same(old.view, view(1))
    leftovers = [p.name for p in state_dir(env.cache, RUN).iterdir()
                 if p.name not in ("state.json", ".lock", before["file"])]
    assert leftovers, "the dead writer left its files"  # and the next commit removes them
    pending = begin(env.cache, RUN, load_file(view_file(other)))
    assert pending.commit(m2) is None
    names = sorted(p.name for p in state_dir(env.cache, RUN).iterdir())
    assert names == sorted([".lock", "state.json", state_doc(env.cache)["file"]])
    assert isinstance(load(env.cache, RUN, m2), Loaded)


def test_a_failed_publish_commits_no_state(env, capsys, monkeypatch):
    env.publish(0, capsys=capsys)
    before = state_doc(env.cache)

    async def refuse(*a, **kw):
        raise BoardError("the board refused the upload")

    monkeypatch.setattr("stitch_trainer.publisher.write_version", refuse)
    rc, _, err = env.publish(1, ok=False, capsys=capsys)
    assert rc == 1 and "the board refused the upload" in err, err
    assert state_doc(env.cache) == before  # v1 is not on the board: the state stays at v0
    assert [p.name for p in state_dir(env.cache, RUN).glob("view-*")] == [before["file"]]
    got = publish_state.load(env.cache, RUN, env.manifest(0))
    assert isinstance(got, Loaded) and same(got.view, view(0))


ADVANCE_CHILD = r"""
import os, sys
from pathlib import Path
from stitch_core.format import codec
from stitch_core.versions.manifest import Manifest
import stitch_trainer.publish_state as ps

cache, patch, m1, m2 = sys.argv[1:5]
m1, m2 = (Manifest.model_validate_json(Path(p).read_text()) for p in (m1, m2))
real, calls = codec.apply_cpu, []

def dies_third(*a, **kw):  # killed while decoding the third tensor: two are written
    calls.append(1)
    if len(calls) == 3:
        os._exit(9)
    return real(*a, **kw)

codec.apply_cpu = dies_third
base = ps.load(Path(cache), m1.run, m1)
assert isinstance(base, ps.Loaded), base
ps.advance(Path(cache), m1.run, base, Path(patch).read_bytes(), m2)
os._exit(0)
"""


def test_a_crash_mid_advance_leaves_a_state_that_is_not_trusted(env, capsys, tmp_path):
    """Killed while the state's file is half-advanced: `state.json` still names the old version,
    whose fingerprints the file no longer has, so the next publish rebuilds from the board."""
    env.publish(0, capsys=capsys)
    env.publish(1, capsys=capsys)
    env.publish(2, cache=tmp_path / "other", capsys=capsys)  # v2's patch, made elsewhere
    for v in (1, 2):
        (tmp_path / f"m{v}.json").write_text(env.manifest(v).model_dump_json())
    r = subprocess.run([sys.executable, "-c", ADVANCE_CHILD, str(env.cache),
                        str(env.board / RUN / "versions" / "000002" / "patch.stp"),
                        str(tmp_path / "m1.json"), str(tmp_path / "m2.json")],
                       capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
    assert r.returncode == 9, r.stderr  # died half-way, for real
    assert state_doc(env.cache)["version"] == 1
    got = load(env.cache, RUN, env.manifest(1))
    assert isinstance(got, str) and "damaged" in got, got  # the file is no longer v1
    assert isinstance(load(env.cache, RUN, env.manifest(2)), str)  # nor claimed as v2
    _, body, err = env.publish(3, capsys=capsys)
    assert "rebuilding ps v2 from the board" in err and env.pulled == [1, 2], err
    assert body["version"] == 3 and same(env.board_view(), view(3))
    assert isinstance(load(env.cache, RUN, env.manifest(3)), Loaded)


def test_a_base_that_fails_its_proof_uploads_nothing(env, capsys):
    """`Publisher.resume_from(..., proof=)`: a base still being proven when the patch is made;
    a failed proof stops that version before any object reaches the board."""
    from stitch_trainer.publisher import BaseProofError, Publisher

    env.publish(0, capsys=capsys)
    before = sorted(p.relative_to(env.board) for p in env.board.rglob("*"))

    def fails() -> None:
        raise publish_state.StateUnusableError("its view file is damaged (test)")

    with Publisher(str(env.board), RUN) as pub:
        pub.resume_from(0, view(0), {t.name: int(t.fingerprint, 16)
                                     for t in env.manifest(0).tensors}, proof=fails)
        info = pub.publish(1, masters(1))
        with pytest.raises(BaseProofError, match="v1 not published: its base v0 did not prove"):
            info.result()
    assert sorted(p.relative_to(env.board) for p in env.board.rglob("*")) == before


def test_two_publishes_sharing_a_cache_never_publish_a_wrong_version(env, capsys, tmp_path):
    """Two `stitch publish` processes of one run, one cache, one board, at once: whichever
    interleaving happens, every version on the board is exactly a checkpoint that was published,
    and the cache's state is the board's latest or is rebuilt, never a wrong base."""
    env.publish(0, capsys=capsys)
    env.publish(1, capsys=capsys)
    srcs = []
    for step in (2, 3):
        src = tmp_path / f"m{step}.safetensors"
        save_file(masters(step), src)
        srcs.append(src)
    procs = [subprocess.Popen([sys.executable, "-m", "stitch_core.cli", "publish", str(env.board),
                               str(src), "--run", RUN, "--cache-dir", str(env.cache), "--json"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              cwd=Path(__file__).resolve().parents[1]) for src in srcs]
    outs = [p.communicate(timeout=120) for p in procs]
    done = {json.loads(o)["version"]: step for (o, _), p, step in zip(outs, procs, (2, 3),
                                                                      strict=True)
            if p.returncode == 0}
    assert done, outs  # at least one landed; a loser failed on the board's compare-and-set
    for (o, e), p in zip(outs, procs, strict=True):
        assert p.returncode == 0 or "stitch: error:" in e, (o, e)
    for version, step in done.items():
        assert version in (2, 3)
        got = {}
        out = tmp_path / f"v{version}"
        asyncio.run(materialize.pull(LocalBoard(env.board), RUN, version, out,
                                     tmp_path / "check-cache"))
        for f in sorted(out.glob("*.safetensors")):
            got.update(load_file(f))
        assert same(got, view(step))
    latest = max(done)
    _, body, _ = env.publish(4, capsys=capsys)  # and the cache goes on from the board's latest
    assert body["version"] == latest + 1 and body["parent"] == latest
    assert same(env.board_view(), view(4))
    assert isinstance(load(env.cache, RUN, env.manifest(latest + 1)), Loaded)
