"""Durability of a publish: a real publisher process SIGKILLed at every stage of a publish (on a
local and a NATS board) leaves no partial version visible; local boards fsync files and
directories before `latest` moves; `stitch up` runs JetStream with `sync_interval: always`."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest
import torch

from stitch_core.cli.main import main as stitch
from stitch_core.failpoints import ENV as FAILPOINT_ENV
from stitch_core.format import fingerprint as fpr
from stitch_core.versions.board import LocalBoard, open_board
from stitch_core.versions.follower import Follower
from stitch_core.versions.manifest import latest_key, manifest_key, version_dir
from stitch_core.versions.memory_replica import MemoryReplica
from stitch_core.versions.natsserver import NatsServer, dev_server
from stitch_trainer.publisher import Publisher
from tests.publish_crash_child import MAX_SHARD_BYTES, weights

RUN = "crash"
CHILD = Path(__file__).with_name("publish_crash_child.py")
ROOT = Path(__file__).resolve().parent.parent
# v1's objects in upload order (write_version: the manifest's order): the patch, index, shards
OBJECTS = ["patch.stp", "model.safetensors.index.json", "model-00001-of-00002.safetensors",
           "model-00002-of-00002.safetensors"]
# stage -> (objects of v1 on the board, its manifest there, `latest` moved to it)
STAGES = {
    "mid-object": ([], False, False),
    "after-object": (OBJECTS[:1], False, False),
    "after-objects": (OBJECTS, False, False),
    "after-manifest": (OBJECTS, True, False),
    "after-latest": (OBJECTS, True, True),
}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k].view(torch.int16), b[k].view(torch.int16)) for k in a)


def _publisher(url: str) -> Publisher:
    return Publisher(url, RUN, "bf16", snapshot_every=1, max_shard_bytes=MAX_SHARD_BYTES)


def _publish_v0(url: str) -> None:
    with _publisher(url) as pub:
        assert pub.publish(0, weights(0)).result(60).version == 0


def _restart(url: str, latest: int):
    """A new publisher on the run: resumes from `latest` and publishes weights(2)."""
    with _publisher(url) as pub:
        assert pub.published == latest
        base = weights(latest)
        pub.resume_from(latest, base, fpr.state_fingerprints(base))
        return pub.publish(2, weights(2)).result(60)


def _stitch_versions(url: str, capsys) -> dict:
    capsys.readouterr()
    assert stitch(["versions", url, "--run", RUN, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.fixture(params=["local", "nats"])
def board_url(request, tmp_path) -> str:
    if request.param == "local":
        return str(tmp_path / "board")
    server = request.getfixturevalue("nats_server")
    return f"{server.url}/crash{uuid.uuid4().hex[:8]}"


async def _nats_messages(board) -> int:
    nc = await board.connection()
    return (await nc.jetstream().stream_info(f"OBJ_{board.bucket}")).state.messages


@pytest.mark.parametrize("stage", list(STAGES))
async def test_publisher_killed_at_any_stage_leaves_no_partial_version(board_url, stage, tmp_path,
                                                                       capsys):
    want_objects, want_manifest, landed = STAGES[stage]
    await asyncio.to_thread(_publish_v0, board_url)
    board = open_board(board_url)
    local = isinstance(board, LocalBoard)
    replica = MemoryReplica()
    follower = Follower(board_url, RUN, replica, cache_dir=tmp_path / "cache")
    assert await follower.sync() == 0 and _equal(replica.tensors, weights(0))
    stored_before = None if local else await _nats_messages(board)

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get(
        "PYTHONPATH", "")])}
    env.pop(FAILPOINT_ENV, None)
    if stage != "mid-object":
        env[FAILPOINT_ENV] = f"publish:{stage}"
    proc = await asyncio.to_thread(
        subprocess.run, [sys.executable, str(CHILD), board_url, RUN, stage], env=env, cwd=ROOT,
        capture_output=True, text=True, timeout=180)
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr

    # what the board holds of v1: exactly what the stage had stored, and `latest` not past it
    vdir = version_dir(RUN, 1)
    assert [o for o in OBJECTS if await board.exists(f"{vdir}/{o}")] == want_objects
    assert await board.exists(manifest_key(RUN, 1)) == want_manifest
    latest = (await board.read_latest(RUN)).version
    assert latest == (1 if landed else 0)
    assert await board.list_versions(RUN) == ([0, 1] if want_manifest else [0])
    if stage == "mid-object":  # the kill did interrupt an object being stored
        if local:
            partial = list((board.root / vdir).glob(".patch.stp.*.tmp"))
            assert partial and partial[0].stat().st_size > 0
        else:
            assert await _nats_messages(board) > stored_before  # chunks, no metadata
    listed = await asyncio.to_thread(_stitch_versions, board_url, capsys)
    assert listed["latest"] == latest
    assert [r["version"] for r in listed["versions"]] == ([0, 1] if want_manifest else [0])

    # followers serve the last complete version, bit for bit, and never saw another
    assert await follower.sync() == latest and _equal(replica.tensors, weights(latest))
    assert follower.applied == ([0, 1] if landed else [0])
    fresh = MemoryReplica()
    newcomer = Follower(board_url, RUN, fresh, cache_dir=tmp_path / "cache2")
    assert await newcomer.sync() == latest and _equal(fresh.tensors, weights(latest))
    await newcomer.stop()

    # a restarted publisher resumes the run, skipping a number the dead one left objects in
    m = await asyncio.to_thread(_restart, board_url, latest)
    assert m.version == (1 if not want_objects else 2) and m.parent == latest
    assert (await board.read_latest(RUN)).version == m.version
    assert await follower.sync() == m.version and _equal(replica.tensors, weights(2))
    assert follower.applied[-1] == m.version and len(follower.applied) == (3 if landed else 2)
    await follower.stop()
    await board.close()


def test_restart_skips_a_sharded_snapshot_killed_after_its_first_object(tmp_path):
    """The first version of a publisher is a snapshot (no patch); killed after its first object,
    the number is still seen as taken by the next publisher, which then does not collide."""
    url = str(tmp_path / "board")
    _publish_v0(url)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get(
        "PYTHONPATH", "")]), FAILPOINT_ENV: "publish:after-object"}
    proc = subprocess.run([sys.executable, str(CHILD), url, RUN, "after-object", "fresh"],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    vdir = Path(url) / version_dir(RUN, 1)
    assert sorted(p.name for p in vdir.iterdir()) == ["model.safetensors.index.json"]
    with _publisher(url) as pub:  # not resumed either: a snapshot, from its first object on
        m = pub.publish(2, weights(2)).result(60)
    assert m.version == 2 and m.parent == 0 and m.kind == "snapshot" and m.patch is None


def test_failpoints_are_off_without_the_variable(tmp_path, monkeypatch):
    monkeypatch.delenv(FAILPOINT_ENV, raising=False)
    _publish_v0(str(tmp_path / "board"))  # passes every failpoint, still alive
    monkeypatch.setenv(FAILPOINT_ENV, "publish:no-such-point")
    assert _restart(str(tmp_path / "board"), 0).version == 1


# -- fsync order on a local board ----------------------------------------------------------------

def test_local_board_fsyncs_files_and_directories_before_latest_moves(tmp_path, monkeypatch):
    events: list[tuple[str, str]] = []
    real_fsync, real_link, real_replace = os.fsync, os.link, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def link(src, dst, *a, **k):
        real_link(src, dst, *a, **k)
        events.append(("link", str(dst)))

    def replace(src, dst, *a, **k):
        real_replace(src, dst, *a, **k)
        events.append(("replace", str(dst)))

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "link", link)
    monkeypatch.setattr(os, "replace", replace)
    root = (tmp_path / "b").resolve()
    with _publisher(str(root)) as pub:
        ms = [pub.publish(0, weights(0)).result(60)]
        first = len(events)
        ms.append(pub.publish(1, weights(1)).result(60))
    mine = [e for e in events if e[1].startswith(str(tmp_path.resolve()))]
    run = root / RUN

    def at(kind: str, path: Path | str, start: int = 0) -> int:
        return next(i for i, e in enumerate(mine) if i >= start and e == (kind, str(path)))

    # v0 created the board, the run, versions/ and 000000: each entry fsynced in its parent
    for d in (root, run, run / "versions", run / "versions" / "000000"):
        assert at("fsync", d.parent) < at("link", run / "versions" / "000000" / "manifest.json")
    for m in ms:
        vdir = root / version_dir(RUN, m.version)
        moved = at("replace", root / latest_key(RUN), first if m.version else 0)
        for name in [o.path for o in m.objects] + ["manifest.json"]:
            linked = at("link", vdir / name)
            data = max(i for i, (k, p) in enumerate(mine[:linked])
                       if k == "fsync" and Path(p).parent == vdir and
                       Path(p).name.startswith(f".{name}."))
            assert data < linked < at("fsync", vdir, linked) < moved, name
        latest_data = max(i for i, (k, p) in enumerate(mine[:moved])
                          if k == "fsync" and Path(p).name.startswith(".latest."))
        assert at("fsync", run, moved) == moved + 1 and latest_data < moved
    assert mine[-1] == ("fsync", str(run))  # the last thing a publish does to the disk


# -- `stitch up`: JetStream fsyncs before it acknowledges -----------------------------------------

def _varz_jetstream(server: NatsServer) -> dict:
    m = re.search(r"Starting http monitor on \S+:(\d+)", server.output())
    assert m, server.output()
    with urllib.request.urlopen(f"http://127.0.0.1:{m.group(1)}/varz", timeout=5) as r:
        return json.load(r)["jetstream"]["config"]


def test_stitch_up_server_syncs_always(tmp_path):
    with dev_server(tmp_path / "dev", port=0, extra_args=["-m", "-1"]) as server:
        assert _varz_jetstream(server).get("sync_always") is True
    with NatsServer(tmp_path / "plain", port=0, extra_args=["-m", "-1"]) as server:
        assert not _varz_jetstream(server).get("sync_always")  # the server's default


def test_stitch_up_uses_the_sync_always_config(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "stitch_core.cli", "up", "--dir",
                             str(tmp_path), "--port", "0"], stdout=subprocess.PIPE, text=True,
                            cwd=ROOT, start_new_session=True)
    try:
        seen = []
        assert proc.stdout is not None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and (line := proc.stdout.readline()):
            seen.append(line)
            if line.startswith("Ctrl-C"):
                break
        assert any("sync_interval always" in x for x in seen), seen
        conf = (tmp_path / ".nats" / "stitch-up.conf").resolve()
        assert re.search(r"jetstream\s*\{\s*sync_interval:\s*always\s*\}", conf.read_text())
        log = (tmp_path / ".nats" / "nats-server.log").read_text()
        assert f"Using configuration file: {conf}" in log
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0


# -- R3: a board on a 3-node JetStream cluster, buckets made with 3 replicas beforehand ----------

R3_NODE = """\
server_name: {name}
jetstream {{ sync_interval: always }}
cluster {{ name: stitch-r3, listen: 127.0.0.1:{route}, routes: [{routes}] }}
"""


async def _retry(what, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while True:
        try:
            return await what()
        except Exception:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.5)


async def test_board_on_r3_buckets_survives_a_node(tmp_path):
    from nats.js import api

    from stitch_core.versions.board.nats import NatsBoard
    from stitch_core.versions.nats_conn import connect
    from stitch_dev.ports import free_port

    routes = [free_port() for _ in range(3)]
    servers = []
    for i, route in enumerate(routes):
        conf = tmp_path / f"n{i}.conf"
        conf.write_text(R3_NODE.format(name=f"n{i}", route=route, routes=", ".join(
            f"nats://127.0.0.1:{r}" for r in routes)))
        servers.append(NatsServer(tmp_path / f"n{i}", port=free_port(), config=conf))
    try:
        for s in servers:
            s.start()
        nc = await connect(servers[0].url)
        js = nc.jetstream()
        # what docs/versions.md#durability says to run before the first publish
        await _retry(lambda: js.create_object_store("stitch", storage=api.StorageType.FILE,
                                                    replicas=3))
        await _retry(lambda: js.create_key_value(bucket="stitch_latest", history=16,
                                                 storage=api.StorageType.FILE, replicas=3))
        url = f"{servers[1].url}/stitch"
        await asyncio.to_thread(_publish_v0, url)
        await asyncio.to_thread(_restart, url, 0)  # v1: weights(2)
        for stream in ("OBJ_stitch", "KV_stitch_latest"):  # the board used them as they are
            assert (await js.stream_info(stream)).config.num_replicas == 3
        await nc.close()
        servers[0].proc.kill()  # a node lost (power) with its page cache: the others have it all
        replica = MemoryReplica()
        board = NatsBoard(f"{servers[2].url}/stitch", timeout=2)  # retried while re-electing
        f = Follower(board, RUN, replica, cache_dir=tmp_path / "c")
        assert await _retry(f.sync) == 1 and _equal(replica.tensors, weights(2))
        await f.stop()
        await board.close()
    finally:
        for s in servers:
            s.stop()
