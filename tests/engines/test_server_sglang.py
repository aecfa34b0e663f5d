"""SGLang's own scenarios on the session follower (conftest `follower`), after test_server.py's:
its native /generate under the protocol (SGLang's weight_version is the Stitch version; PUT,
batches), and its generating routes (Responses, Anthropic Messages, Ollama, SageMaker)."""

from __future__ import annotations

import json
import threading

import httpx

from ..engine_common import Stamp, sse_events
from .test_routes_sglang import bodies
from .test_server import at_least_v1, pinned_and_stamped, verify_takes_the_key


def test_native_generate_pinned_min_wait_and_409(follower):
    """test_server.py's protocol checks on the native /generate: the same field, and SGLang's
    weight_version (and per-token weight_versions) is the Stitch version."""
    server, trainer, run = follower["server"], follower["trainer"], follower["run"]
    v = at_least_v1(follower)
    r = server.generate("Hello", {"X-Stitch-Version": str(v)})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["stitch"] == Stamp(run, v)
    assert body["meta_info"]["weight_version"] == str(v)
    # an older exact version: engines never go back (POST and PUT /generate)
    for resp in (server.generate("Hello", {"X-Stitch-Version": str(v - 1)}),
                 server.http.put("/generate", json={"text": "Hello"},
                                 headers={"X-Stitch-Version": str(v - 1)})):
        assert resp.status_code == 409 and int(resp.headers["Retry-After"]) >= 1
        err = resp.json()["error"]
        assert err["type"] == "stitch_version_not_ready" and err["reason"] == "passed"
        assert err["serving"] == v and err["wanted"] == v - 1 and err["latest"] == v
    # a newer one with a wait: published meanwhile, caught up, served at that version
    t = threading.Timer(1.0, trainer.publish)
    t.start()
    r = server.generate("Hello", {"X-Stitch-Min-Version": str(v + 1), "X-Stitch-Wait": "60"})
    t.join()
    assert r.status_code == 200, r.text
    assert r.json()["stitch"]["version_start"] == r.json()["stitch"]["version_end"] == v + 1
    assert r.json()["meta_info"]["weight_versions"] == [
        {"version": str(v + 1), "start": 0, "end": r.json()["meta_info"]["completion_tokens"]}]
    # bad headers
    assert server.generate("Hello", {"X-Stitch-Wait": "-1"}).status_code == 400
    # a native batch: a JSON list answer carries the headers (no object to put the field in)
    r = server.generate(["Hello", "world"], {"X-Stitch-Version": str(v + 1)},
                        cache_salt=["a", "b"])
    assert r.status_code == 200, r.text
    assert len(r.json()) == 2 and r.headers["X-Stitch-Version-End"] == str(v + 1)
    assert all(o["meta_info"]["weight_version"] == str(v + 1) for o in r.json())


def test_every_generating_route_is_pinned_and_stamped(follower):
    """The Responses, Anthropic Messages and Ollama APIs and SageMaker's /invocations: 409
    pinned to a version the engine does not hold (in each API's error shape), stamped when served
    (headers and the JSON field; a stream's last event, or an NDJSON stream's done line, in its
    dialect); SGLang's key check first."""
    server, run = follower["server"], follower["run"]
    v = server.status()["version"]
    stamp = Stamp(run, v)
    b = bodies(server.model)
    anon = httpx.Client(base_url=server.url, timeout=120)
    for path in ("/v1/responses", "/v1/messages", "/invocations", "/api/generate", "/api/chat"):
        # without the key: SGLang's 401, before Stitch
        pinned_and_stamped(server, anon, path, {**b[path], "stream": False}, v, stamp, 401)
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
    verify_takes_the_key(server, anon)
    anon.close()
