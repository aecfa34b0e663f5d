"""A stock engine server made a Stitch follower by the plugin (TP=1, CPU), end to end: the
scenarios both engines pass alike (each engine's own ones: test_server_vllm.py,
test_server_sglang.py, on the same follower).

Real parts: nats-server, a board directory, a tiny Qwen2 built locally and trained with AdamW by
transformers in this process, the Publisher, `stitch pull`, and the engine's own server
(`python -m vllm.entrypoints.openai.api_server` with `--worker-extension-cls` and
`--middleware`; `python -m sglang.launch_server` with only the installed `sglang.srt.plugins`
entry point and STITCH_* variables, plus the stand-in `sgl_kernel`, tests/sglang/stub). One
follower for the session (conftest `follower`); fresh engines (from `stitch pull` of the same
versions) start in the comparison test.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest

from stitch_core.format import fingerprint as fpr
from stitch_core.serve import protocol
from stitch_core.versions.board import LocalBoard
from stitch_core.versions.materialize import pull
from stitch_core.versions.store import read_manifest
from stitch_dev.engines import PROMPTS
from stitch_dev.server import wait_rejected

from ..engine_common import Stamp, forge_next_version


def test_follows_ten_adamw_versions_bit_exact_with_fresh_engines(engine, follower):
    server, trainer, root, run = (follower[k] for k in ("server", "trainer", "root", "run"))
    seen = {}
    for _ in range(10):
        v = trainer.publish()
        # the protocol itself waits for the engine: exactly v, up to 120 s
        r = server.complete(PROMPTS[0], {"X-Stitch-Version": str(v), "X-Stitch-Wait": "120"})
        assert r.status_code == 200, r.text
        assert r.headers["X-Stitch-Version-Start"] == r.headers["X-Stitch-Version-End"] == str(v)
        engine.check_completion(r.json(), v)  # the engine's own field (SGLang's) agrees
        if v in engine.compare:
            seen[v] = server.outputs(v)
    st = server.wait_applied(10, timeout=60)
    assert st["version"] == 10 and st["state"] == "serving" and st["lag"] == 0
    assert st["fingerprint_check"]["ok"] is True and st["ranks"] == 1
    assert st["fallback_tensors"] == [] and st["engine"] == engine.name
    assert st["patch_bytes_total"] > 0 and st["last_apply"]["changed"] > 0
    la = st["last_apply"]
    if set(st["derived_copies"]) & {"onednn", "amx"}:
        # vLLM packed its CPU linear layers: every copy the apply changed was built ahead of the
        # pause and only installed in it (stitch_core.engine.prebuild), and the outputs below
        # still equal fresh engines'
        assert la["prebuilt"] == la["derived_ahead"] == la["derived_rebuilt"] > 0, la
    m10 = asyncio.run(read_manifest(LocalBoard(root / "board"), run, 10))
    assert m10.fingerprints == fpr.state_fingerprints(trainer.view())
    # a full recomputation on the ranks agrees with the manifest of v10
    check = server.http.post("/stitch/verify").json()
    assert check["ok"] is True and check["tensors"] > 0
    dirs = []
    for v in engine.compare:
        d = root / f"pulled-{v}"
        asyncio.run(pull(LocalBoard(root / "board"), run, v, d, root / "cache", quiet=True))
        dirs.append(d)
    fresh = engine.fresh_outputs(dirs, root)
    for v, d in zip(engine.compare, dirs, strict=True):
        assert seen[v] == fresh[str(d)], f"v{v}: following engine != fresh engine"
    assert seen[engine.compare[0]] != seen[engine.compare[-1]]  # the versions really differ


def at_least_v1(follower) -> int:
    """The follower's version, one published first if it is v0 (a test run alone: it needs an
    older version to refuse)."""
    server, trainer = follower["server"], follower["trainer"]
    v = server.status()["version"]
    if v == 0:
        v = trainer.publish()
        server.wait_version(v, timeout=120)
    return v


def test_protocol_pinned_min_wait_and_409(follower):
    server, trainer, run = follower["server"], follower["trainer"], follower["run"]
    v = at_least_v1(follower)
    r = server.complete("Hello", {"X-Stitch-Version": str(v)})
    assert r.status_code == 200
    assert r.json()["stitch"] == Stamp(run, v)
    # an older exact version: engines never go back
    r = server.complete("Hello", {"X-Stitch-Version": str(v - 1)})
    assert r.status_code == 409 and int(r.headers["Retry-After"]) >= 1
    err = r.json()["error"]
    assert err["type"] == "stitch_version_not_ready" and err["reason"] == "passed"
    assert err["serving"] == v and err["wanted"] == v - 1 and err["latest"] == v
    # a newer one, no wait: 409 at once
    r = server.complete("Hello", {"X-Stitch-Min-Version": str(v + 1)})
    assert r.status_code == 409 and r.json()["error"]["wanted"] == v + 1
    # a newer one with a wait: published meanwhile, caught up, served at that version
    t = threading.Timer(1.0, trainer.publish)
    t.start()
    r = server.complete("Hello", {"X-Stitch-Min-Version": str(v + 1), "X-Stitch-Wait": "60"})
    t.join()
    assert r.status_code == 200, r.text
    assert r.json()["stitch"]["version_start"] == r.json()["stitch"]["version_end"] == v + 1
    # a wait that runs out
    t0 = time.monotonic()
    r = server.complete("Hello", {"X-Stitch-Min-Version": str(v + 5), "X-Stitch-Wait": "1.5"})
    assert r.status_code == 409 and 1.4 < time.monotonic() - t0 < 30
    # bad headers
    assert server.complete("Hello", {"X-Stitch-Version": "x"}).status_code == 400
    # chat, streamed: the last JSON chunk carries the versions
    body = {"model": server.model, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4, "stream": True, "temperature": 0}
    with server.http.stream("POST", "/v1/chat/completions", json=body,
                            headers={"X-Stitch-Min-Version": str(v + 1)}) as resp:
        assert resp.status_code == 200
        assert resp.headers["X-Stitch-Version-Start"] == str(v + 1)
        events = [ln[6:] for ln in resp.iter_lines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["stitch"]["version_end"] == v + 1
    metrics = server.http.get("/metrics").text
    assert f'stitch_version{{run="{run}"}} {float(v + 1)}' in metrics, metrics[-3000:]
    for name in ("stitch_lag_versions", "stitch_apply_seconds", "stitch_patch_bytes_total",
                 "stitch_not_ready_total"):
        assert name in metrics, name
    # health, as /stitch/status says it (reported every second)
    deadline = time.monotonic() + 10
    while f'stitch_follower_health{{run="{run}"}} 0.0' not in metrics and \
            time.monotonic() < deadline:
        time.sleep(0.5)
        metrics = server.http.get("/metrics").text
    assert f'stitch_follower_health{{run="{run}"}} 0.0' in metrics, metrics[-3000:]
    assert f'stitch_serving{{run="{run}"}} 1.0' in metrics
    assert f'stitch_nats_connected{{run="{run}"}} 1.0' in metrics


def _stream(server, path: str, body: dict, headers: dict) -> tuple[int, dict, list[str]]:
    """One SSE request read to its end: (status, headers, the `data:` payloads)."""
    with httpx.Client(base_url=server.url, timeout=300, headers=server.http.headers) as c, \
            c.stream("POST", path, json=body, headers=headers) as resp:
        events = [ln[6:] for ln in resp.iter_lines() if ln.startswith("data: ")]
        return resp.status_code, dict(resp.headers), events


def test_requests_running_across_an_apply(engine, follower):
    """Immediate mode: an unpinned request reports start != end (and where the engine keeps its
    own per-token version spans, SGLang, they show where the change happened); an exact pin is
    cut off. The apply lands mid-generation by construction: the engine's steps are held from
    both streams' first tokens until the apply (sent again if one ended before the hold)."""
    server, trainer = follower["server"], follower["trainer"]
    v = server.status()["version"]
    n = 1200  # tokens at v, then at v + 1: the apply lands while the steps are held
    trainer.train()  # before the streams start: only the publish and the apply race them
    pinned = {"model": server.model, "prompt": "Once upon a time", "max_tokens": n,
              "temperature": 0, "ignore_eos": True, "stream": True}
    runs = {"free": (*engine.long_stream(server, n), {}),
            "pinned": ("/v1/completions", pinned, {"X-Stitch-Version": str(v)})}
    published: list[int] = []

    def publish() -> int:
        published.append(trainer.publish(train=False))
        return published[-1]

    try:
        out, v1 = server.all_across_an_apply(
            {k: (lambda r=r: _stream(server, *r)) for k, r in runs.items()}, publish)
    finally:  # the trainer never stays ahead of the board (the later tests forge on top of it)
        if not published:
            server.wait_version(publish(), timeout=120)
    assert v1 == v + 1
    code, headers, ev = out["free"]
    assert code == 200 and ev[-1] == "[DONE]"
    stitch = json.loads(ev[-2])["stitch"]
    assert stitch["version_start"] == v and stitch["version_end"] == v + 1, stitch
    spans = engine.stream_spans(ev)  # the engine's own record (SGLang's weight_versions)
    if spans is not None:
        assert [s["version"] for s in spans] == [str(v), str(v + 1)], spans
        assert spans[0]["start"] == 0 and spans[0]["end"] == spans[1]["start"] > 0
        assert spans[1]["end"] == n
    code, headers, ev = out["pinned"]
    assert code == 200 and ev[-1] == "[DONE]"  # headers went out before the apply
    err = json.loads(ev[-2])["error"]  # cut as the apply began: no token of v + 1 sent
    assert err["type"] == "stitch_version_not_ready" and err["wanted"] == v, err
    assert err["reason"] in ("version_changed", "applying"), err


@pytest.mark.follower_late(1)
def test_forged_version_is_refused_and_serving_continues(engine, follower):
    """A version whose patch does not produce its manifest's fingerprints is refused; the engine
    keeps serving the last good version and recovers once the board holds a good one. Run after
    the follower's other tests (conftest `follower_late`): the repaired version is one the
    trainer's own state never held, so the trainer publishes no further version after it."""
    server, trainer, root, run = (follower[k] for k in ("server", "trainer", "root", "run"))
    v = server.status()["version"]
    forged = forge_next_version(trainer, root / "board", run, v, root / "forged")
    forged.publish_bad()
    st = wait_rejected(server.status)
    assert "rejected" in st["follower"]["last_error"], st
    assert st["version"] == v and st["latest"] == v + 1 and st["state"] == "catching_up"
    engine.plain(server, v)  # still serving v, and says so
    r = server.complete("Hello", {"X-Stitch-Min-Version": str(v + 1)})
    assert r.status_code == 409
    assert server.http.post("/stitch/verify").json()["ok"] is True  # untouched
    forged.repair()  # an operator re-uploads the right objects
    st = server.wait_version(v + 1, timeout=60)
    assert st["fingerprint_check"]["ok"] is True
    assert server.http.post("/stitch/verify").json()["ok"] is True


def pinned_and_stamped(server, anon: httpx.Client, path: str, body: dict, v: int, stamp: Stamp,
                       anon_status: int) -> None:
    """One generating route: 409 pinned to a version the engine does not hold (in the route's
    error shape), stamped when served (headers and the JSON field); `anon_status` without the
    key (the engine's own 401 where it guards the path)."""
    r = server.http.post(path, json=body, headers={"X-Stitch-Version": str(v + 5)})
    assert r.status_code == 409, (path, r.text)
    err = protocol.parse_not_ready(r.json())
    assert err.reason == "behind" and err.serving == v and err.wanted == v + 5
    assert (r.json().get("type") == "error") == (path == "/v1/messages")
    r = server.http.post(path, json=body, headers={"X-Stitch-Version": str(v)})
    assert r.status_code == 200, (path, r.text)
    assert r.headers["X-Stitch-Version-Start"] == r.headers["X-Stitch-Version-End"] == str(v)
    assert r.json()["stitch"] == stamp, path
    r = anon.post(path, json=body, headers={"X-Stitch-Version": str(v)})
    assert r.status_code == anon_status, (path, r.status_code)


def verify_takes_the_key(server, anon: httpx.Client) -> None:
    assert anon.post("/stitch/verify").status_code == 401
    assert server.http.post("/stitch/verify").json()["ok"] is True


def test_stitch_log_lines_are_in_the_engine_log(follower):
    """Stitch's INFO lines reach the server log, and an engine without STITCH_TRUST says once
    that it trusts the board."""
    log = follower["server"].tail(100000)
    assert log.count("STITCH_TRUST is not set: this engine trusts the board") == 1, log[-3000:]
    assert "verified on 1 rank(s)" in log, log[-3000:]
