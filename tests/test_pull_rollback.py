"""`stitch pull` never rolls a pulled directory back by accident (the `stitch` CLI as a
subprocess, a real signed board written by a Publisher, no mocks).

The attack: a stale relay (or a board restored from an old copy) serves a `latest` from an
earlier moment, v1, signed by the trainer's real key. A directory that holds v3 must not be
replaced by v1 through `latest`, with `--force`, with `--trust`, or over HTTP; naming
`--version 1` is the way to go back on purpose.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from stitch_core.versions.board.serve import serve
from stitch_core.versions.manifest import PULLED_MANIFEST, Manifest, latest_key
from stitch_core.versions.trust import new_key
from stitch_trainer.publisher import Publisher

RUN = "roll"
REPO = Path(__file__).resolve().parents[1]


def stitch(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "stitch_core.cli", *map(str, args)],
                          capture_output=True, text=True, cwd=REPO, env=dict(os.environ))


@pytest.fixture(scope="module")
def boards(tmp_path_factory) -> dict[str, Path]:
    """`fresh`: v0..v3 signed, latest v3; `stale`: the same objects with the signed `latest`
    it had right after v1 (what a relay that stopped refreshing serves); `key`: the .pub."""
    top = tmp_path_factory.mktemp("rollback")
    key = top / "trainer"
    new_key(key)
    fresh = top / "fresh"
    g = torch.Generator().manual_seed(0)
    masters = {f"layers.{i}.weight": torch.randn(32, 64, generator=g) * 0.02 for i in range(2)}
    with Publisher(str(fresh), RUN, "bf16", signing_key=key) as pub:
        for step in range(4):
            pub.publish(step, masters).result()
            if step == 1:
                old_latest = (fresh / latest_key(RUN)).read_bytes()
            masters = {k: v + torch.randn(v.shape, generator=g) * 3e-4 for k, v in masters.items()}
    stale = top / "stale"
    shutil.copytree(fresh, stale)
    (stale / latest_key(RUN)).write_bytes(old_latest)
    assert json.loads(old_latest)["version"] == 1 and json.loads(old_latest)["signature"]
    return {"fresh": fresh, "stale": stale, "key": Path(f"{key}.pub")}


def pulled(out: Path) -> int:
    return Manifest.model_validate_json((out / PULLED_MANIFEST).read_text()).version


def snapshot(out: Path) -> dict[str, tuple[int, int]]:
    return {p.name: (p.stat().st_mtime_ns, p.stat().st_size) for p in sorted(out.iterdir())}


@pytest.fixture
def at_v3(boards, tmp_path) -> Path:
    out = tmp_path / "model"
    r = stitch("pull", boards["fresh"], "--run", RUN, "-o", out, "--cache-dir", tmp_path / "c",
               "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["version"] == 3 and pulled(out) == 3
    return out


@pytest.mark.parametrize("trust", [False, True])
def test_pull_of_a_stale_latest_does_not_roll_back(boards, at_v3, tmp_path, trust):
    before = snapshot(at_v3)
    extra = ["--trust", boards["key"]] if trust else []
    for force in (["--force"], []):
        r = stitch("pull", boards["stale"], "--run", RUN, "-o", at_v3, "--cache-dir",
                   tmp_path / "c2", *force, *extra)
        assert r.returncode == 1, r.stdout + r.stderr
        line = r.stderr.strip()
        assert len(line.splitlines()) == 1
        assert f"holds {RUN} v3 and the board's latest is v1" in line, line
        assert "--version 1" in line
    assert snapshot(at_v3) == before and pulled(at_v3) == 3
    assert not (tmp_path / "c2").exists()  # refused before anything was fetched
    assert not [p for p in at_v3.parent.iterdir() if p.name.startswith(".model.tmp")]


def test_pull_of_a_stale_latest_over_http_does_not_roll_back(boards, at_v3, tmp_path):
    server = serve(boards["stale"], "127.0.0.1", 0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        before = snapshot(at_v3)
        r = stitch("pull", f"http://127.0.0.1:{server.server_port}", "--run", RUN, "-o", at_v3,
                   "--cache-dir", tmp_path / "c2", "--force", "--trust", boards["key"])
        assert r.returncode == 1 and "not rolling it back" in r.stderr, r.stderr
        assert snapshot(at_v3) == before
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def test_an_explicit_version_goes_back_and_latest_forward(boards, at_v3, tmp_path):
    r = stitch("pull", boards["stale"], "--run", RUN, "--version", "1", "-o", at_v3,
               "--cache-dir", tmp_path / "c", "--force", "--trust", boards["key"])
    assert r.returncode == 0, r.stderr
    assert pulled(at_v3) == 1
    r = stitch("pull", boards["stale"], "--run", RUN, "-o", at_v3, "--cache-dir",
               tmp_path / "c", "--force")  # latest v1 == what it holds: not a rollback
    assert r.returncode == 0, r.stderr
    r = stitch("pull", boards["fresh"], "--run", RUN, "-o", at_v3, "--cache-dir",
               tmp_path / "c", "--force")  # forward from v1 to v3
    assert r.returncode == 0, r.stderr
    assert pulled(at_v3) == 3


def test_another_run_in_the_directory_is_not_a_rollback(boards, at_v3, tmp_path):
    """The guard compares versions of one run only: a directory holding another run is
    replaced as before (with --force)."""
    m = json.loads((at_v3 / PULLED_MANIFEST).read_text())
    m["run"] = "other-run"
    m["version"] = 99
    (at_v3 / PULLED_MANIFEST).write_text(json.dumps(m))
    r = stitch("pull", boards["stale"], "--run", RUN, "-o", at_v3, "--cache-dir",
               tmp_path / "c", "--force")
    assert r.returncode == 0, r.stderr
    assert pulled(at_v3) == 1
