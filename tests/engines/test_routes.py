"""Every route of the engine that generates is version-controlled, and only past the engine's own
API-key check: a real server (`--api-key`) whose loaded weights carry no Stitch version (a plain
checkpoint, STITCH_RUN set, no board) holds no verified policy version, so every generating
route answers 409 not_ready in its own API's error shape, while the routes that generate nothing
still answer; `/stitch/verify` takes the key and is rate-limited.

What generates, and a body for each, are the engine's own (test_routes_vllm.py,
test_routes_sglang.py, with the checks of its route table and middleware stack that need no
server). The served side (stamps on every generating route, streams in each dialect) runs on the
follower (test_server*.py).
"""

from __future__ import annotations

import importlib
import time

import httpx
import pytest

from stitch_core.serve import protocol
from stitch_dev.server import wait_started
from stitch_dev.tinymodel import build_tiny_model

RUN = "routes"
KEY = "routes-key"


@pytest.fixture(scope="module")
def routes(engine):
    """The engine's own route data (test_routes_<engine>.py)."""
    return importlib.import_module(f"{__package__}.test_routes_{engine.name}")


@pytest.fixture(scope="module")
def never(engine, routes, tmp_path_factory):
    """A server that holds no verified policy version: a plain checkpoint has none."""
    root = tmp_path_factory.mktemp(f"{engine.name}-routes")
    model_dir = build_tiny_model(root / "model", arch="qwen2", max_position_embeddings=512)
    server = engine.start(model_dir, root / "server.log", api_key=KEY, run=RUN,
                          **routes.NEVER_KW)
    try:
        st = wait_started(server)
        assert st["state"] == "not_ready" and st["version"] is None, st
        yield server
    finally:
        server.stop()


def test_not_ready_engine_refuses_every_generating_route(never, routes):
    routes.not_ready_extras(never)
    st = never.http.get("/stitch/status")
    assert st.status_code == 503
    assert {r["path"] for r in st.json()["routes"]} >= routes.GENERATING
    for path, body in routes.bodies(never.model).items():
        for headers in ({}, {"X-Stitch-Version": "7"}):
            stream = {"stream": True} if path in routes.STREAMED else {}
            r = never.http.post(path, json={**body, **stream}, headers=headers)
            assert r.status_code == 409, (path, r.status_code, r.text)
            assert int(r.headers["Retry-After"]) >= 1 and r.headers["X-Stitch-Run"] == RUN
            err = protocol.parse_not_ready(r.json())
            assert err.reason == "not_ready" and err.serving is None, (path, r.text)
            assert err.wanted == (7 if headers else None)
            assert (r.json().get("type") == "error") == (path == "/v1/messages")
    # what generates nothing is not Stitch's to refuse
    routes.tokenized(never.http.post("/tokenize", json={"model": never.model, "prompt": "hi"},
                                     headers={"X-Stitch-Version": "7"}))
    assert never.http.get("/v1/models").status_code == 200
    # the engine's key check first: without the key, 401 before any admission
    anon = httpx.Client(base_url=never.url, timeout=60)
    before = never.status()["not_ready_total"]
    r = anon.post(routes.KEYED, json=routes.bodies(never.model)[routes.KEYED],
                  headers={"X-Stitch-Version": "7", "X-Stitch-Wait": "30"})
    assert r.status_code == 401 and never.status()["not_ready_total"] == before
    anon.close()


def test_verify_needs_the_key_and_is_rate_limited(never, routes):
    anon = httpx.Client(base_url=never.url, timeout=60)
    r = anon.post("/stitch/verify")
    assert r.status_code == 401 and r.json() == {"error": "Unauthorized"}
    r = anon.post("/stitch/verify", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
    # read-only: open on vLLM (503: no version); SGLang's key middleware guards every path
    assert anon.get("/stitch/status").status_code == routes.STATUS_ANON
    anon.close()
    deadline = time.monotonic() + 300  # the start-up check done (no version: plain files)
    while (never.status().get("fingerprint_check") or {}).get("ok") is not True:
        assert time.monotonic() < deadline, never.status()
        time.sleep(0.5)
    r = never.http.post("/stitch/verify")  # past the key: the ranks' weights are checked
    # (the files' own fingerprints: every tensor a rank holds is proven, none is missing)
    assert r.status_code == 200 and r.json()["ok"] is True and r.json()["tensors"] > 0, r.text
    r = never.http.post("/stitch/verify")
    assert r.status_code == 429 and r.json()["error"]["type"] == "stitch_rate_limited"
    assert 1 <= int(r.headers["Retry-After"]) <= 10
