"""A stock SGLang server made a Stitch follower by the plugin (TP=1, CPU), end to end.

Real parts: nats-server, a board directory, a tiny Qwen2 built locally and trained with AdamW by
transformers in this process, the Publisher, `stitch pull`, and `python -m sglang.launch_server`
with only the installed `sglang.srt.plugins` entry point and STITCH_* variables (plus the
stand-in `sgl_kernel`, tests/sglang/stub). One follower for the whole module; fresh plain SGLang
engines (from `stitch pull` of the same versions) start in turn in the comparison test.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time

import httpx
import pytest

if os.environ.get("STITCH_REQUIRE_SGLANG") != "1":
    pytest.importorskip("sglang", reason="run in the SGLang venv (scripts/dev.py test)")

from stitch_core.format import fingerprint as fpr  # noqa: E402
from stitch_core.serve import protocol  # noqa: E402
from stitch_core.versions.board import LocalBoard  # noqa: E402
from stitch_core.versions.materialize import pull  # noqa: E402
from stitch_core.versions.store import read_manifest  # noqa: E402
from stitch_dev.server import wait_rejected  # noqa: E402
from stitch_dev.tinymodel import build_tiny_model  # noqa: E402
from stitch_dev.trainer import AdamWTrainer  # noqa: E402

from ..engine_common import forge_next_version, sse_events  # noqa: E402
from .engines import PROMPTS, Server, fresh_outputs  # noqa: E402
from .test_routes import bodies  # noqa: E402

RUN = "sg-e2e"
API_KEY = "sg-e2e-key"
COMPARE = [4, 10]  # each fresh engine costs a start-up (~1-2.5 min on 2 cores)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, nats_server):
    root = tmp_path_factory.mktemp("sglang-e2e")
    model_dir = build_tiny_model(root / "model", arch="qwen2", max_position_embeddings=2048)
    trainer = AdamWTrainer(model_dir, root / "board", nats_server.url, RUN)
    assert trainer.publish() == 0
    asyncio.run(pull(LocalBoard(root / "board"), RUN, 0, root / "v0", root / "cache",
                     quiet=True))
    # with an API key (SGLang checks it before Stitch admits); verifies not rate-limited here
    # (test_routes checks the limit)
    server = Server(root / "v0", root / "server.log", extra=["--enable-metrics"],
                    api_key=API_KEY, board=str(root / "board"), nats_url=nats_server.url,
                    run=RUN, cache_dir=str(root / "engine-cache"), reconcile_interval="1",
                    verify_cooldown="0")
    try:
        server.wait_version(0)
        # SGLang's own warm-up request (a /generate) was held until v0 was proven, then passed
        # the gate: /health turns 200 only after it succeeded
        server.wait_healthy(120)
        yield {"root": root, "trainer": trainer, "server": server}
    finally:
        server.stop()
        trainer.pub.close()


def test_follows_ten_adamw_versions_bit_exact_with_fresh_engines(stack):
    server, trainer, root = stack["server"], stack["trainer"], stack["root"]
    seen = {}
    for _ in range(10):
        v = trainer.publish()
        # the protocol itself waits for the engine: exactly v, up to 120 s
        r = server.complete(PROMPTS[0], {"X-Stitch-Version": str(v), "X-Stitch-Wait": "120"})
        assert r.status_code == 200, r.text
        assert r.headers["X-Stitch-Version-Start"] == r.headers["X-Stitch-Version-End"] == str(v)
        assert r.json()["metadata"]["weight_version"] == str(v)  # SGLang's own field agrees
        if v in COMPARE:
            seen[v] = server.outputs(v)
    st = server.status()
    assert st["version"] == 10 and st["state"] == "serving" and st["lag"] == 0
    assert st["fingerprint_check"]["ok"] is True and st["ranks"] == 1
    assert st["fallback_tensors"] == [] and st["engine"] == "sglang"
    assert st["patch_bytes_total"] > 0 and st["last_apply"]["changed"] > 0
    m10 = asyncio.run(read_manifest(LocalBoard(root / "board"), RUN, 10))
    assert m10.fingerprints == fpr.state_fingerprints(trainer.view())
    # a full recomputation on the ranks agrees with the manifest of v10
    check = server.http.post("/stitch/verify").json()
    assert check["ok"] is True and check["tensors"] > 0
    dirs = []
    for v in COMPARE:
        d = root / f"pulled-{v}"
        asyncio.run(pull(LocalBoard(root / "board"), RUN, v, d, root / "cache", quiet=True))
        dirs.append(d)
    fresh = fresh_outputs(dirs, root)
    for v, d in zip(COMPARE, dirs, strict=True):
        assert seen[v] == fresh[str(d)], f"v{v}: following engine != fresh engine"
    assert seen[COMPARE[0]] != seen[COMPARE[-1]]  # the versions really differ


def test_protocol_pinned_min_wait_and_409(stack):
    server, trainer = stack["server"], stack["trainer"]
    v = server.status()["version"]
    if v == 0:  # run alone: have an older version to refuse
        v = trainer.publish()
        server.wait_version(v, timeout=120)
    r = server.complete("Hello", {"X-Stitch-Version": str(v)})
    assert r.status_code == 200
    assert r.json()["stitch"] == {"run": RUN, "version_start": v, "version_end": v}
    # native /generate: the same field, and SGLang's weight_version is the Stitch version
    r = server.generate("Hello", {"X-Stitch-Version": str(v)})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["stitch"] == {"run": RUN, "version_start": v, "version_end": v}
    assert body["meta_info"]["weight_version"] == str(v)
    # an older exact version: engines never go back (POST and PUT /generate, OpenAI paths)
    for resp in (server.complete("Hello", {"X-Stitch-Version": str(v - 1)}),
                 server.generate("Hello", {"X-Stitch-Version": str(v - 1)}),
                 server.http.put("/generate", json={"text": "Hello"},
                                 headers={"X-Stitch-Version": str(v - 1)})):
        assert resp.status_code == 409 and int(resp.headers["Retry-After"]) >= 1
        err = resp.json()["error"]
        assert err["type"] == "stitch_version_not_ready" and err["reason"] == "passed"
        assert err["serving"] == v and err["wanted"] == v - 1 and err["latest"] == v
    # a newer one, no wait: 409 at once
    r = server.complete("Hello", {"X-Stitch-Min-Version": str(v + 1)})
    assert r.status_code == 409 and r.json()["error"]["wanted"] == v + 1
    # a newer one with a wait: published meanwhile, caught up, served at that version
    t = threading.Timer(1.0, trainer.publish)
    t.start()
    r = server.generate("Hello", {"X-Stitch-Min-Version": str(v + 1), "X-Stitch-Wait": "60"})
    t.join()
    assert r.status_code == 200, r.text
    assert r.json()["stitch"]["version_start"] == r.json()["stitch"]["version_end"] == v + 1
    assert r.json()["meta_info"]["weight_versions"] == [
        {"version": str(v + 1), "start": 0, "end": r.json()["meta_info"]["completion_tokens"]}]
    # a wait that runs out
    t0 = time.monotonic()
    r = server.complete("Hello", {"X-Stitch-Min-Version": str(v + 5), "X-Stitch-Wait": "1.5"})
    assert r.status_code == 409 and 1.4 < time.monotonic() - t0 < 30
    # bad headers
    assert server.complete("Hello", {"X-Stitch-Version": "x"}).status_code == 400
    assert server.generate("Hello", {"X-Stitch-Wait": "-1"}).status_code == 400
    # a native batch: a JSON list answer carries the headers (no object to put the field in)
    r = server.generate(["Hello", "world"], {"X-Stitch-Version": str(v + 1)},
                        cache_salt=["a", "b"])
    assert r.status_code == 200, r.text
    assert len(r.json()) == 2 and r.headers["X-Stitch-Version-End"] == str(v + 1)
    assert all(o["meta_info"]["weight_version"] == str(v + 1) for o in r.json())
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
    assert f'stitch_version{{run="{RUN}"}} {float(v + 1)}' in metrics, metrics[-3000:]
    for name in ("stitch_lag_versions", "stitch_apply_seconds", "stitch_patch_bytes_total",
                 "stitch_not_ready_total"):
        assert name in metrics, name
    # health, as /stitch/status says it (reported every second)
    deadline = time.monotonic() + 10
    while f'stitch_follower_health{{run="{RUN}"}} 0.0' not in metrics and \
            time.monotonic() < deadline:
        time.sleep(0.5)
        metrics = server.http.get("/metrics").text
    assert f'stitch_follower_health{{run="{RUN}"}} 0.0' in metrics, metrics[-3000:]
    assert f'stitch_serving{{run="{RUN}"}} 1.0' in metrics
    assert f'stitch_nats_connected{{run="{RUN}"}} 1.0' in metrics


def _stream(server, path, body, headers, out: dict, key: str, started: threading.Event):
    with httpx.Client(base_url=server.url, timeout=300, headers=server.http.headers) as c, \
            c.stream("POST", path, json=body, headers=headers) as resp:
        events = []
        for ln in resp.iter_lines():
            if ln.startswith("data: "):
                events.append(ln[6:])
                started.set()
        out[key] = (resp.status_code, dict(resp.headers), events)


def test_requests_running_across_an_apply(stack):
    """Immediate mode: an unpinned request reports start != end (and SGLang's own per-token
    version spans show where the change happened); an exact pin is cut off. The apply lands
    mid-generation by construction: the test holds the scheduler's steps from the streams' first
    tokens until the apply."""
    server, trainer = stack["server"], stack["trainer"]
    v = server.status()["version"]
    n = 1200  # tokens at v, then at v + 1: the apply lands while the steps are held
    trainer.train()  # before the streams start: only the publish and the apply race them
    pinned = {"model": server.model, "prompt": "Once upon a time", "max_tokens": n,
              "temperature": 0, "ignore_eos": True, "stream": True}
    native = {"text": "Once upon a time", "stream": True,
              "sampling_params": {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}}
    runs = {"free": ("/generate", native, {}),
            "pinned": ("/v1/completions", pinned, {"X-Stitch-Version": str(v)})}
    out: dict = {}
    events = {k: threading.Event() for k in runs}
    threads = [threading.Thread(target=_stream, args=(server, p, b, h, out, k, events[k]))
               for k, (p, b, h) in runs.items()]
    for t in threads:
        t.start()
    assert all(e.wait(120) for e in events.values())  # both generating at v
    # the scheduler's steps held from here until the apply: neither stream can end before it
    # (the plugin's own pause and continue around the apply let them go on, at v + 1)
    with server.hold_steps():
        assert not out, f"a stream ended before the hold: {list(out)}"
        assert trainer.publish(train=False) == v + 1
        server.wait_version(v + 1, timeout=120)
    for t in threads:
        t.join(300)
    code, headers, ev = out["free"]
    assert code == 200 and ev[-1] == "[DONE]"
    stitch = json.loads(ev[-2])["stitch"]
    assert stitch["version_start"] == v and stitch["version_end"] == v + 1, stitch
    spans = json.loads(ev[-3])["meta_info"]["weight_versions"]  # SGLang's own record
    assert [s["version"] for s in spans] == [str(v), str(v + 1)], spans
    assert spans[0]["start"] == 0 and spans[0]["end"] == spans[1]["start"] > 0
    assert spans[1]["end"] == n
    code, headers, ev = out["pinned"]
    assert code == 200 and ev[-1] == "[DONE]"  # headers went out before the apply
    err = json.loads(ev[-2])["error"]  # cut as the apply began: no token of v + 1 sent
    assert err["type"] == "stitch_version_not_ready" and err["wanted"] == v, err
    assert err["reason"] in ("version_changed", "applying"), err


def test_forged_version_is_refused_and_serving_continues(stack):
    """A version whose patch does not produce its manifest's fingerprints is refused; the engine
    keeps serving the last good version and recovers once the board holds a good one."""
    server, trainer, root = stack["server"], stack["trainer"], stack["root"]
    v = server.status()["version"]
    forged = forge_next_version(trainer, root / "board", RUN, v, root / "forged")
    forged.publish_bad()
    st = wait_rejected(server.status)
    assert "rejected" in st["follower"]["last_error"], st
    assert st["version"] == v and st["latest"] == v + 1 and st["state"] == "catching_up"
    r = server.generate("Hello")  # still serving v, and says so (SGLang's field too)
    assert r.status_code == 200 and r.json()["stitch"]["version_end"] == v
    assert r.json()["meta_info"]["weight_version"] == str(v)
    r = server.complete("Hello", {"X-Stitch-Min-Version": str(v + 1)})
    assert r.status_code == 409
    assert server.http.post("/stitch/verify").json()["ok"] is True  # untouched
    forged.repair()  # an operator re-uploads the right objects
    st = server.wait_version(v + 1, timeout=60)
    assert st["fingerprint_check"]["ok"] is True
    assert server.http.post("/stitch/verify").json()["ok"] is True


def test_every_generating_route_is_pinned_and_stamped(stack):
    """The Responses, Anthropic Messages and Ollama APIs and SageMaker's /invocations: 409
    pinned to a version the engine does not hold (in each API's error shape), stamped when served
    (headers and the JSON field; a stream's last event, or an NDJSON stream's done line, in its
    dialect); SGLang's key check first."""
    server = stack["server"]
    v = server.status()["version"]
    stamp = {"run": RUN, "version_start": v, "version_end": v}
    b = bodies(server.model)
    anon = httpx.Client(base_url=server.url, timeout=120)
    for path in ("/v1/responses", "/v1/messages", "/invocations", "/api/generate", "/api/chat"):
        body = {**b[path], "stream": False}
        r = server.http.post(path, json=body, headers={"X-Stitch-Version": str(v + 5)})
        assert r.status_code == 409, (path, r.text)
        err = protocol.parse_not_ready(r.json())
        assert err.reason == "behind" and err.serving == v and err.wanted == v + 5
        assert (r.json().get("type") == "error") == (path == "/v1/messages")
        r = server.http.post(path, json=body, headers={"X-Stitch-Version": str(v)})
        assert r.status_code == 200, (path, r.text)
        assert r.headers["X-Stitch-Version-Start"] == r.headers["X-Stitch-Version-End"] == str(v)
        assert r.json()["stitch"] == stamp, path
        assert anon.post(path, json=body).status_code == 401, path  # SGLang's, before Stitch
    # streams: the stamp is the last event, in each API's own shape
    r = server.http.post("/v1/responses", json={**b["/v1/responses"], "stream": True},
                         headers={"X-Stitch-Min-Version": str(v)})
    evs = sse_events(r.text)
    assert evs[-1][0] == "response.stitch", r.text[-600:]
    assert evs[-1][1]["stitch"] == stamp and evs[-1][1]["type"] == "response.stitch"
    assert evs[-2][0] in ("response.completed", "response.incomplete"), [n for n, _ in evs]
    assert evs[-1][1]["sequence_number"] == evs[-2][1]["sequence_number"] + 1
    r = server.http.post("/v1/messages", json={**b["/v1/messages"], "stream": True})
    evs = sse_events(r.text)
    assert evs[-1] == ("stitch", {"type": "stitch", "stitch": stamp}), r.text[-600:]
    assert "message_stop" in [n for n, _ in evs]
    r = server.http.post("/api/generate", json={**b["/api/generate"], "stream": True})
    assert r.headers["content-type"].startswith("application/x-ndjson")
    lines = [json.loads(ln) for ln in r.text.splitlines() if ln.strip()]
    assert lines[-1]["done"] is True and lines[-1]["stitch"] == stamp, lines[-2:]
    assert all("stitch" not in ln for ln in lines[:-1])
    # /stitch/verify takes the key
    assert anon.post("/stitch/verify").status_code == 401
    assert server.http.post("/stitch/verify").json()["ok"] is True
    anon.close()


def test_stitch_log_lines_are_in_the_engine_log(stack):
    """Stitch's INFO lines reach the server log, and an engine without STITCH_TRUST says once
    that it trusts the board."""
    log = stack["server"].tail(100000)
    assert log.count("STITCH_TRUST is not set: this engine trusts the board") == 1, log[-3000:]
    assert "verified on 1 rank(s)" in log, log[-3000:]
