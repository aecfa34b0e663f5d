"""Attacks on a region's HTTP relay, with real parts: nginx (`NginxRelay`) in front of a real
`stitch board serve` origin (counting what it is asked), real published versions, `stitch pull`
as a child process. A relay's corrupted copy must not stop its region (the follower gets the
object elsewhere and the relay is made to replace it), no client header may defeat the
one-fetch-per-region cache beyond one refresh per object per minute, an origin under a path
prefix works, and the mutable span index is never served stale."""

from __future__ import annotations

import asyncio
import hashlib
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from stitch_core.versions.board.fallback import FallbackBoard
from stitch_core.versions.board.http import HttpBoard
from stitch_core.versions.follower import Follower
from stitch_core.versions.memory_replica import MemoryReplica
from stitch_core.versions.relay import NginxRelay, RelayConfigError, find_nginx
from stitch_core.versions.trust import new_key
from stitch_dev.board_origin import Counting, start_origin, stop_origin
from stitch_dev.ports import free_port
from stitch_trainer.publisher import Publisher
from tests.test_relay import get, make_model

RUN = "relay"


def _publish(board: Path, versions: int, key: Path | None = None) -> None:
    """v0 (snapshot) + `versions` patches of a small model, signed with `key` if given."""
    params = make_model()
    g = torch.Generator().manual_seed(1)
    with Publisher(str(board), RUN, "bf16", signing_key=key) as pub:
        for step in range(versions + 1):
            if step:
                params = {k: v + torch.randn(v.shape, generator=g) * 1e-2
                          for k, v in params.items()}
            pub.publish(step, {k: v.detach() for k, v in params.items()}).result(30)


def _objects(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*")
                  if p.is_file() and "/versions/" in p.relative_to(root).as_posix())


def _cache_file(r: NginxRelay, key: str) -> Path:
    """nginx's cache file for `/key` (its header names the cache key)."""
    want = f"\nKEY: /{key}\n".encode()
    for p in (r.dir / "cache").rglob("*"):
        if p.is_file() and want in p.read_bytes()[:4096]:
            return p
    raise AssertionError(f"{key} is not in the relay's cache")


def _flip_last_byte(p: Path) -> None:
    data = bytearray(p.read_bytes())
    data[-1] ^= 0x01  # the body is the end of nginx's cache file
    p.write_bytes(bytes(data))


def _stitch(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "stitch_core.cli", *args], capture_output=True,
                          text=True, timeout=120)


def test_corrupt_relay_copy_region_pulls_and_relay_is_refreshed(origin, relay, tmp_path):
    """One byte flipped in the relay's cached copies of the snapshot's weights and of a patch:
    `stitch pull "relay,origin" --trust` succeeds bit-exact, each bad copy is replaced through
    the relay (one refresh fetch from the origin per object, none by the follower itself), and
    the next read through the relay is the good copy, from its cache."""
    key = tmp_path / "k"
    new_key(key)
    _publish(origin.root, 2, key)
    objects = _objects(origin.root)
    for k in objects:  # the region has read everything once: all cached
        assert get(f"{relay.url}/{k}")[0] == 200
    bad = [next(k for k in objects if k.endswith(".safetensors")),
           f"{RUN}/versions/000002/patch.stp"]
    for k in bad:
        _flip_last_byte(_cache_file(relay, k))
        status, h, body = get(f"{relay.url}/{k}")
        assert h["X-Stitch-Relay-Cache"] == "HIT" and body != (origin.root / k).read_bytes()
    r = _stitch("pull", f"{relay.url},{origin.url}", "--run", RUN, "-o", str(tmp_path / "out"),
                "--cache-dir", str(tmp_path / "cache"), "--trust", f"{key}.pub")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "bad copy" in r.stderr
    for k in objects:
        if k.endswith(("manifest.json", "latest")):
            continue
        got = tmp_path / "cache" / RUN / k.split("/")[2] / k.split("/")[3]
        if got.exists():  # every object the pull fetched is the origin's, bit for bit
            assert got.read_bytes() == (origin.root / k).read_bytes(), k
    for k in bad:
        assert origin.gets[("GET", f"/{k}")] == 2, origin.gets  # the fill, then the refresh
        status, h, body = get(f"{relay.url}/{k}")
        assert h["X-Stitch-Relay-Cache"] == "HIT" and body == (origin.root / k).read_bytes()
    fetches = relay.upstream_fetches(until=lambda f: f.get("BYPASS") == len(bad))
    assert fetches.get("BYPASS") == len(bad)


def test_refused_refresh_falls_back_to_the_origin(origin, relay, tmp_path):
    """The refresh of an object was used up a moment ago (at most one a minute): a follower
    that gets a bad copy from the relay gets the object from the origin; nothing stalls."""
    _publish(origin.root, 1)
    k = f"{RUN}/versions/000001/patch.stp"
    want = (origin.root / k).read_bytes()
    assert get(f"{relay.url}/{k}", {"X-Stitch-Refresh": "1"})[2] == want  # the allowance
    _flip_last_byte(_cache_file(relay, k))

    async def main():
        fb = FallbackBoard([HttpBoard(relay.url, attempts=2), HttpBoard(origin.url)])
        dest = tmp_path / "patch.stp"
        await fb.get_verified(k, dest, len(want), hashlib.sha256(want).hexdigest())
        await fb.close()
        return dest.read_bytes(), fb

    got, fb = asyncio.run(main())
    assert got == want and fb.bad_copies == [1, 0] and fb.refreshed == [0, 0]
    assert fb.served == [0, 1]  # from the origin
    assert get(f"{relay.url}/{k}")[2] != want  # the relay keeps its bad copy for now


def test_no_header_defeats_the_cache_beyond_one_refresh_per_object(origin, relay, tmp_path):
    """`X-Stitch-Bypass` (the old debugging header) no longer reaches the origin; 20 requests
    with `X-Stitch-Refresh` cause one origin fetch (the rest are 429); a relay with a refresh
    token ignores the header without it."""
    _publish(origin.root, 1)
    k = f"/{RUN}/versions/000001/patch.stp"
    assert get(relay.url + k)[0] == 200
    for _ in range(10):
        status, h, _ = get(relay.url + k, {"X-Stitch-Bypass": "1"})
        assert status == 200 and h["X-Stitch-Relay-Cache"] == "HIT"
    assert origin.gets[("GET", k)] == 1
    codes = Counter(get(relay.url + k, {"X-Stitch-Refresh": "1"})[0] for _ in range(20))
    assert codes == {200: 1, 429: 19} and origin.gets[("GET", k)] == 2
    other = f"/{RUN}/versions/000001/manifest.json"  # the limit is per object
    assert get(relay.url + other, {"X-Stitch-Refresh": "yes"})[0] == 200
    assert origin.gets[("GET", other)] == 1
    want = {"MISS": 1, "HIT": 10, "BYPASS": 2, "-": 19}
    assert relay.upstream_fetches(until=lambda f: f == want) == want
    token = "0123456789abcdef0123456789abcdef"
    with NginxRelay(origin.url, free_port(), tmp_path / "tok", refresh_token=token) as r2:
        assert get(r2.url + k)[0] == 200 and origin.gets[("GET", k)] == 3
        for value in ("1", token.upper()[:-1] + "0", "x" * 40):
            status, h, _ = get(r2.url + k, {"X-Stitch-Refresh": value})
            assert status == 200 and h["X-Stitch-Relay-Cache"] == "HIT", value
        status, h, _ = get(r2.url + k, {"X-Stitch-Refresh": token})
        assert status == 200 and h["X-Stitch-Relay-Cache"] == "BYPASS"
        assert origin.gets[("GET", k)] == 4
    with pytest.raises(RelayConfigError):
        NginxRelay(origin.url, 1, tmp_path / "bad", refresh_token="short")


class Prefixed(Counting):
    """The board under /boards (as behind a shared web server); anything else is a 404."""

    def _serve(self, body: bool) -> None:
        if not self.path.startswith("/boards/"):
            return self._status(404)
        self.path = self.path[len("/boards"):]
        super()._serve(body)


def test_origin_under_a_path_prefix(tmp_path):
    """`--origin http://host:port/boards`: the relay rewrites to the prefix (nginx refuses a URI
    in proxy_pass inside a regex location); objects are cached, `latest` passed through, and a
    follower told `relay,origin/boards` follows the run through the relay only."""
    root = tmp_path / "board"
    root.mkdir()
    _publish(root, 2)
    srv = start_origin(root, Prefixed)
    base = f"{srv.url}/boards"
    find_nginx()
    try:
        with NginxRelay(base, free_port(), tmp_path / "relay") as r:
            k = f"{RUN}/versions/000001/patch.stp"
            status, _, body = get(f"{r.url}/{k}")
            assert status == 200 and body == (root / k).read_bytes()
            status, h, _ = get(f"{r.url}/{k}")
            assert h["X-Stitch-Relay-Cache"] == "HIT" and srv.gets[("GET", f"/{k}")] == 1

            async def follow():
                f = Follower(f"{r.url},{base}", RUN, MemoryReplica(), cache_dir=tmp_path / "c",
                             cache_max_bytes=None)
                try:
                    await f.catch_up(2)
                    return f.version, list(f.board.served)
                finally:
                    await f.stop()

            version, served = asyncio.run(follow())
            assert version == 2 and served[0] > 0 and served[1] == 0, served
    finally:
        stop_origin(srv)


def test_span_index_through_the_relay_is_never_stale(origin, relay):
    """`spans.json` is rewritten in place by the squasher: the relay passes it through (a
    rewrite at the origin is seen at once), while span documents are cached like any object."""
    d = origin.root / RUN / "versions" / "000005"
    d.mkdir(parents=True)
    idx = d / "spans.json"
    idx.write_text('{"run": "relay", "version": 5, "bases": [2]}')
    (d / "span-000002.json").write_text("{}")
    k = f"/{RUN}/versions/000005/spans.json"
    assert get(relay.url + k)[2] == idx.read_bytes()
    idx.unlink()
    idx.write_text('{"run": "relay", "version": 5, "bases": [2, 3]}')
    status, h, body = get(relay.url + k)
    assert body == idx.read_bytes() and h.get("X-Stitch-Relay-Cache", "") == ""
    assert origin.gets[("GET", k)] == 2
    doc = f"/{RUN}/versions/000005/span-000002.json"
    get(relay.url + doc)
    assert get(relay.url + doc)[1]["X-Stitch-Relay-Cache"] == "HIT"
