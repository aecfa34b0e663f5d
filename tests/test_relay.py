"""Regional relays with real parts: nginx (`stitch_core.versions.relay.NginxRelay`) in front of
a real `stitch board serve` server (its handler counting what it is asked), real Publishers and
Followers. nginx must be installed (`scripts/dev.py` setup installs it on Debian as root): these
tests fail, never skip, without it.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from stitch_core.versions.board import open_board
from stitch_core.versions.board.fallback import FallbackBoard
from stitch_core.versions.board.http import HttpBoard
from stitch_core.versions.follower import Follower
from stitch_core.versions.memory_replica import MemoryReplica
from stitch_core.versions.relay import find_nginx, nginx_config
from stitch_dev.ports import free_port

RUN = "relay"


def get(url: str, headers: dict | None = None) -> tuple[int, dict, bytes]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def make_model(n: int = 4, d: int = 128, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    return {f"model.layers.{i}.weight": torch.nn.Parameter(torch.randn(d, d, generator=g) * 0.02)
            for i in range(n)}


def publish_versions(board_dir: Path, versions: int, *, start=None):
    """A real Publisher: v0 (snapshot) + `versions` AdamW patches; returns the publisher and a
    `step()` that publishes one more version."""
    import torch

    from stitch_trainer.publisher import Publisher

    params = make_model()
    opt = torch.optim.AdamW(list(params.values()), lr=1e-4)
    g = torch.Generator().manual_seed(1)
    pub = Publisher(str(board_dir), RUN, "bf16")
    state = {"step": 0}

    def step():
        if state["step"] > 0:
            for p in params.values():
                p.grad = torch.randn(p.shape, generator=g) * 1e-2
            opt.step()
        info = pub.publish(state["step"], {k: v.detach() for k, v in params.items()})
        state["step"] += 1
        return info.result(30)

    for _ in range(versions + 1):
        step()
    return pub, step


def test_nginx_config_caches_only_version_objects():
    conf = nginx_config("http://origin.example:8000/boards", 8080, "/tmp/x")
    assert "proxy_cache_lock on;" in conf
    assert "map $upstream_status $stitch_no_store { 200 0; default 1; }" in conf
    # the prefix by a rewrite (nginx refuses a URI in proxy_pass inside a regex location)
    assert "rewrite ^ /boards$uri break;" in conf and "proxy_pass http://stitch_origin;" in conf
    assert conf.count("proxy_cache stitch;") == 1 and conf.count("proxy_cache off;") == 2
    assert "bypass $http_" not in conf  # no client header bypasses the cache, but the refresh
    assert "proxy_cache_bypass $stitch_refresh;" in conf


def test_headers_strong_etag_304_and_404_not_cacheable(origin, relay):
    root = origin.root
    d = root / RUN / "versions" / "000001"
    d.mkdir(parents=True)
    data = b"patch bytes " * 1000
    (d / "patch.stp").write_bytes(data)
    sha = hashlib.sha256(data).hexdigest()
    # the manifest lists the object: its ETag is the listed digest (no hashing needed)
    listed = {"objects": [{"path": "patch.stp", "size": len(data), "sha256": "a" * 64}]}
    (d / "manifest.json").write_text(json.dumps(listed))
    status, h, body = get(f"{origin.url}/{RUN}/versions/000001/patch.stp")
    assert status == 200 and h["ETag"] == f'"sha256:{"a" * 64}"'
    assert "immutable" in h["Cache-Control"]
    (d / "manifest.json").write_text('{"objects": []}')  # not listed: the content's own digest
    (d / "other.bin").write_bytes(data)
    status, h, _ = get(f"{origin.url}/{RUN}/versions/000001/other.bin")
    assert h["ETag"] == f'"sha256:{sha}"'
    status, h, _ = get(f"{origin.url}/{RUN}/versions/000001/manifest.json")
    assert "immutable" in h["Cache-Control"]  # written once, never changed
    status, h, body = get(f"{origin.url}/{RUN}/versions/000001/other.bin",
                          {"If-None-Match": f'"sha256:{sha}"'})
    assert status == 304 and body == b""
    # a 404 is never stored, at the origin's word or the relay's: the key can appear later
    missing = f"/{RUN}/versions/000002/manifest.json"
    status, h, _ = get(origin.url + missing)
    assert status == 404 and h["Cache-Control"] == "no-store"
    assert get(relay.url + missing)[0] == 404
    (root / RUN / "versions" / "000002").mkdir()
    (root / RUN / "versions" / "000002" / "manifest.json").write_text("{}")
    status, h, body = get(relay.url + missing)
    assert status == 200 and body == b"{}"


def test_relay_one_upstream_fetch_per_object(origin, relay, tmp_path):
    """16 concurrent downloads of each of a run's objects through the relay: the origin serves
    each object once (proxy_cache_lock collapses the misses); Range reads come from the cache."""
    pub, _ = publish_versions(origin.root, 2)
    pub.close()
    keys = sorted(str(p.relative_to(origin.root)) for p in origin.root.rglob("*")
                  if p.is_file() and "/versions/" in str(p))
    assert any(k.endswith("patch.stp") for k in keys) and len(keys) >= 5

    async def main():
        boards = [HttpBoard(relay.url) for _ in range(16)]
        try:
            for key in keys:
                want = (origin.root / key).read_bytes()
                dests = [tmp_path / "dl" / f"{i}" / Path(key).name for i in range(16)]
                for dst in dests:
                    dst.parent.mkdir(parents=True, exist_ok=True)
                await asyncio.gather(*(b.get_file(key, dst, size=len(want))
                                       for b, dst in zip(boards, dests, strict=True)))
                assert all(dst.read_bytes() == want for dst in dests)
        finally:
            for b in boards:
                await b.close()

    asyncio.run(main())
    for key in keys:
        assert origin.gets[("GET", f"/{key}")] == 1, (key, origin.gets)
    status, h, body = get(f"{relay.url}/{keys[0]}", {"Range": "bytes=2-5"})
    assert status == 206 and body == (origin.root / keys[0]).read_bytes()[2:6]
    assert h["X-Stitch-Relay-Cache"] == "HIT" and origin.gets[("GET", f"/{keys[0]}")] == 1


def test_cold_range_request_fetches_whole_object_once(origin, relay):
    d = origin.root / RUN / "versions" / "000007"
    d.mkdir(parents=True)
    data = bytes(range(256)) * 400
    (d / "model.safetensors").write_bytes(data)
    key = f"/{RUN}/versions/000007/model.safetensors"
    status, _, body = get(relay.url + key, {"Range": "bytes=100-199"})
    assert status == 206 and body == data[100:200]
    status, h, body = get(relay.url + key)
    assert status == 200 and body == data and h["X-Stitch-Relay-Cache"] == "HIT"
    assert origin.gets[("GET", key)] == 1


def test_followers_through_relay_latest_fresh(origin, relay, tmp_path):
    """8 followers told `relay,origin` follow 3 more versions: `latest` through the relay is
    never stale (each version is seen by its first poll after the move), every object crossed
    to the origin once."""
    pub, step = publish_versions(origin.root, 0)

    async def main():
        followers = [Follower(f"{relay.url},{origin.url}", RUN, MemoryReplica(),
                              cache_dir=tmp_path / "c" / str(i), reconcile_interval=0.2,
                              cache_max_bytes=None) for i in range(8)]
        assert all(isinstance(f.board, FallbackBoard) for f in followers)
        for f in followers:
            await f.start()
        try:
            for f in followers:
                assert await f.wait_for(0, 20)
            for _ in range(3):
                m = await asyncio.to_thread(step)
                t0 = time.monotonic()
                for f in followers:
                    assert await f.wait_for(m.version, 10), f.status()
                assert time.monotonic() - t0 < 5  # polled at 0.2 s: latest is not cached
            assert all(f.applied == [0, 1, 2, 3] for f in followers)
            # every read went to the relay, none fell back
            assert all(f.board.served[1] == 0 and f.board.served[0] > 0 for f in followers)
        finally:
            for f in followers:
                await f.stop()

    try:
        asyncio.run(main())
    finally:
        pub.close()
    objects = [k for (meth, k), n in origin.gets.items() if meth == "GET" and "/versions/" in k]
    assert objects and all(origin.gets[("GET", k)] == 1 for k in objects), origin.gets
    assert origin.gets[("GET", f"/{RUN}/latest")] > 8  # latest: passed through every time


def test_relay_down_followers_fall_back_to_origin(origin, relay, tmp_path):
    pub, step = publish_versions(origin.root, 1)
    relay.stop()  # the region's relay is gone (and a second one was never there)
    dead = f"http://127.0.0.1:{free_port()}"

    async def main():
        f = Follower(f"{relay.url},{dead},{origin.url}", RUN, MemoryReplica(),
                     cache_dir=tmp_path / "c", reconcile_interval=0.2, cache_max_bytes=None)
        await f.start()
        try:
            t0 = time.monotonic()
            assert await f.wait_for(1, 20), f.status()
            first = time.monotonic() - t0
            m = await asyncio.to_thread(step)
            assert await f.wait_for(m.version, 10), f.status()
            assert f.board.served[0] == f.board.served[1] == 0 and f.board.served[2] > 0
            return first
        finally:
            await f.stop()

    try:
        first = asyncio.run(main())
    finally:
        pub.close()
    assert first < 10  # dead relays are skipped after one failed connect each (cooldown)


def test_fallback_board_refuses_writes_and_falls_back_on_not_found(origin, tmp_path):
    other = tmp_path / "empty"
    other.mkdir()
    (origin.root / RUN / "versions" / "000001").mkdir(parents=True)
    (origin.root / RUN / "versions" / "000001" / "patch.stp").write_bytes(b"x")

    async def main():
        b = open_board(f"{other},{origin.url}")  # a replica that lacks the object, then origin
        assert isinstance(b, FallbackBoard) and b.readonly
        assert await b.get(f"{RUN}/versions/000001/patch.stp") == b"x"
        assert await b.exists(f"{RUN}/versions/000001/patch.stp")
        assert not await b.exists(f"{RUN}/versions/000009/patch.stp")
        from stitch_core.versions.board import NotFoundError, ReadOnlyBoardError

        with pytest.raises(NotFoundError):
            await b.get(f"{RUN}/versions/000009/patch.stp")
        with pytest.raises(ReadOnlyBoardError):
            await b.put(f"{RUN}/versions/000001/x", b"y")
        await b.close()

    asyncio.run(main())


def test_nats_leafnode_mirrors_objects_fetched_in_region(tmp_path):
    """A region nats-server, leafnode of the origin's, with JetStream mirrors of the board's
    object store and `latest` KV (relay.mirror_board): 4 followers of the region read every
    object and `latest` from the region (never the origin), and the leaf connection carries
    about one copy of the objects, not four (the hub's /leafz byte counters)."""
    import json as _json

    from stitch_core.versions.natsserver import NatsServer
    from stitch_core.versions.relay import hub_config, mirror_board, region_config

    leaf_port, mon = free_port(), free_port()
    (tmp_path / "hub.conf").write_text(hub_config(leaf_port))
    hub = NatsServer(tmp_path / "hub", config=tmp_path / "hub.conf",
                     extra_args=["-m", str(mon)]).start()
    (tmp_path / "eu.conf").write_text(region_config(f"nats-leaf://127.0.0.1:{leaf_port}",
                                                    domain="eu"))
    eu = NatsServer(tmp_path / "eu", config=tmp_path / "eu.conf").start()

    def leaf_out() -> int:
        with urllib.request.urlopen(f"http://127.0.0.1:{mon}/leafz", timeout=5) as r:
            leafs = _json.loads(r.read())["leafs"]
        return sum(x["out_bytes"] for x in leafs)

    try:
        deadline = time.monotonic() + 10
        while "Leafnode connection created" not in hub.output(1 << 20):
            assert time.monotonic() < deadline, hub.output()
            time.sleep(0.05)
        import torch

        from stitch_trainer.publisher import Publisher

        params = make_model()
        opt = torch.optim.AdamW(list(params.values()), lr=1e-4)
        pub = Publisher(f"{hub.url}/stitch", RUN, "bf16")
        pub.publish(0, {k: v.detach() for k, v in params.items()}).result(30)
        assert asyncio.run(mirror_board(eu.url, "stitch", origin_domain="hub")) == \
            ["OBJ_stitch", "KV_stitch_latest"]
        before = leaf_out()

        async def main():
            fs = [Follower(f"{eu.url}/stitch,{hub.url}/stitch", RUN, MemoryReplica(),
                           cache_dir=tmp_path / "c" / str(i), reconcile_interval=0.2,
                           cache_max_bytes=None) for i in range(4)]
            for f in fs:
                await f.start()
            try:
                for f in fs:
                    assert await f.wait_for(0, 20), f.status()
                for s in range(1, 4):
                    for p in params.values():
                        p.grad = torch.randn(p.shape) * 1e-2
                    opt.step()
                    m = await asyncio.to_thread(
                        lambda s=s: pub.publish(s, {k: v.detach() for k, v in params.items()})
                        .result(30))
                    for f in fs:
                        assert await f.wait_for(m.version, 15), f.status()
                return [f.board.served for f in fs], sum(f.patch_bytes_total for f in fs)
            finally:
                for f in fs:
                    await f.stop()

        served, fetched = asyncio.run(main())
        pub.close()
        crossed = leaf_out() - before
        print(f"leaf out_bytes {crossed:,}; patches fetched by the 4 followers "
              f"{fetched:,}; reads answered by (region, origin): {served}")
        # every read answered in the region: the mirrors had caught up before the followers
        # started, and each version's objects reach them before its `latest` does (or a
        # follower falls back to the origin for that read: allowed, rare, counted here)
        assert all(s[0] > 0 for s in served), served
        assert sum(s[1] for s in served) <= 2, served
        # about one copy of the patches (+ manifests, `latest`, protocol) crossed the leaf
        # connection after the mirrors had caught up, not one per follower
        assert fetched > 50_000 and crossed < 1.5 * fetched / 4 + 20_000, (crossed, fetched)
    finally:
        eu.stop()
        hub.stop()


def test_relay_module_entry_point(origin, tmp_path):
    """`python -m stitch_core.versions.relay http` (what `stitch relay http` runs) serves the
    board through nginx until SIGTERM."""
    import subprocess
    import sys

    find_nginx()
    (origin.root / RUN).mkdir()
    (origin.root / RUN / "latest").write_text("{}")
    port = free_port()
    p = subprocess.Popen([sys.executable, "-m", "stitch_core.versions.relay", "http", "--origin",
                          origin.url, "--port", str(port), "--dir", str(tmp_path / "r")],
                         stdout=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        assert "HTTP relay of" in p.stdout.readline()
        status, h, body = get(f"http://127.0.0.1:{port}/{RUN}/latest")
        assert status == 200 and body == b"{}" and h["Cache-Control"] == "no-cache"
    finally:
        p.terminate()
        assert p.wait(10) == 0


def test_fallback_waits_for_a_replica_behind_the_origin(tmp_path):
    """A first board holding its own `latest` (a mirror) that is behind the origin's: the read
    waits for it to catch up (so objects come from it), else returns the origin's."""
    from stitch_core.versions.board.local import LocalBoard
    from stitch_core.versions.manifest import Latest

    near, far = tmp_path / "near", tmp_path / "far"

    def at(v: int) -> Latest:
        return Latest(run=RUN, version=v, kind="patch", updated="t")

    async def main():
        n, f = LocalBoard(str(near)), LocalBoard(str(far))
        await n.move_latest(RUN, None, at(1))
        await f.move_latest(RUN, None, at(2))
        b = open_board(f"{near},{far}")
        assert b.check_latest
        b.latest_wait = 0.3
        t0 = time.monotonic()
        assert (await b.read_latest(RUN)).version == 2  # never caught up: the origin's word
        assert 0.25 < time.monotonic() - t0 < 2 and b.behind == 1

        async def catch_up():
            await asyncio.sleep(0.1)
            await n.move_latest(RUN, 1, at(2))

        b.latest_wait = 5
        task = asyncio.ensure_future(catch_up())
        got = await b.read_latest(RUN)
        await task
        assert got.version == 2 and b.behind == 2
        assert not open_board(f"http://127.0.0.1:1,{far}").check_latest  # HTTP relays pass it

    asyncio.run(main())


def test_nats_relay_entry_point_mirrors_the_board(tmp_path):
    """`python -m stitch_core.versions.relay hub-config` for the origin, `... nats --leaf-of`
    for the region: the region's server comes up as a leafnode, makes the board's mirrors once
    the origin has the board, and a NatsBoard on it reads the origin's versions."""
    import subprocess
    import sys

    from stitch_core.versions.board.nats import NatsBoard
    from stitch_core.versions.natsserver import NatsServer

    leaf_port = free_port()
    conf = subprocess.run([sys.executable, "-m", "stitch_core.versions.relay", "hub-config",
                           "--leaf-port", str(leaf_port)], check=True, capture_output=True,
                          text=True, cwd=tmp_path).stdout
    assert "domain: hub" in conf and f"port: {leaf_port}" in conf
    (tmp_path / "hub.conf").write_text(conf)
    hub = NatsServer(tmp_path / "hub", config=tmp_path / "hub.conf").start()
    port = free_port()
    p = subprocess.Popen([sys.executable, "-m", "stitch_core.versions.relay", "nats",
                          "--leaf-of", f"nats-leaf://127.0.0.1:{leaf_port}", "--domain", "eu",
                          "--port", str(port), "--dir", str(tmp_path / "eu")],
                         stdout=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        assert "NATS relay (leafnode of" in p.stdout.readline()
        from stitch_trainer.publisher import Publisher

        pub = Publisher(f"{hub.url}/stitch", RUN, "bf16")
        pub.publish(0, {k: v.detach() for k, v in make_model(n=1).items()}).result(30)
        pub.close()
        deadline = time.monotonic() + 30
        while "mirroring OBJ_stitch, KV_stitch_latest" not in (line := p.stdout.readline()):
            assert time.monotonic() < deadline and line, line

        async def read():
            b = NatsBoard(f"nats://127.0.0.1:{port}/stitch")
            try:
                return await b.read_latest(RUN)
            finally:
                await b.close()

        assert asyncio.run(read()).version == 0
    finally:
        p.terminate()
        assert p.wait(15) == 0
        hub.stop()
