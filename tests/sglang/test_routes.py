"""Every route of SGLang that generates is version-controlled, and only past SGLang's own API-key
check.

* SGLang's real app (imported in this process, no engine): the routes Stitch finds in its route
  table (admin endpoints and the tokenizer / parser / session ones left alone), and the order of
  SGLang's real `--api-key` middleware and admission;
* a real SGLang server (`--api-key`) whose loaded weights carry no Stitch version (a plain
  checkpoint, STITCH_RUN set, no board): it holds no verified policy version, so every generating
  route answers 409 not_ready in its own API's error shape (SGLang's warm-up is withheld
  meanwhile), while the routes that generate nothing still answer; `/stitch/verify` takes the key
  and is rate-limited.

The served side runs on the following engine of test_server.py.
"""

from __future__ import annotations

import os
import time

import httpx
import pytest

if os.environ.get("STITCH_REQUIRE_SGLANG") != "1":
    pytest.importorskip("sglang", reason="run in the SGLang venv (scripts/dev.py test)")

import stitch_core.node as node  # noqa: E402
from stitch_core.serve import protocol, route_table  # noqa: E402
from stitch_core.serve.gate import VersionGate  # noqa: E402
from stitch_dev.server import wait_started  # noqa: E402
from stitch_dev.tinymodel import build_tiny_model  # noqa: E402
from stitch_sglang import server as sg  # noqa: E402

from .engines import Server  # noqa: E402

RUN = "sg-routes"
KEY = "sg-routes-key"
# what SGLang 0.5.23 generates (or pools) on
GENERATING = {"/generate", "/encode", "/classify", "/v1/completions", "/v1/chat/completions",
              "/v1/embeddings", "/v1/classify", "/v1/audio/transcriptions", "/v1/score",
              "/v1/decisions", "/v1/responses", "/v1/rerank", "/api/chat", "/api/generate",
              "/v1/messages", "/v1/systemone", "/invocations", "/vertex_generate"}


def test_routes_found_in_sglangs_route_table():
    from sglang.srt.entrypoints.http_server import app

    table = {getattr(r, "path", None) for r in route_table.walk(app)}
    assert {"/update_weights_from_disk", "/flush_cache", "/pause_generation", "/tokenize",
            "/open_session", "/v1/messages/count_tokens", "/scale_elastic_ep"} <= table
    found = {r.path: r for r in route_table.discover(app, sg.classify, sg.FALLBACK)}
    assert set(found) == GENERATING | {"/v1/realtime"}
    assert found["/v1/realtime"].control == "refuse"  # a WebSocket
    assert found["/generate"].methods == {"POST", "PUT"}
    assert found["/v1/responses"].dialect == "responses"
    assert found["/v1/messages"].dialect == "anthropic"
    # salted where SGLang's request model takes a cache_salt (/v1/decisions forbids extras)
    assert {p for p, r in found.items() if r.salt} == {
        "/generate", "/v1/completions", "/v1/chat/completions", "/v1/responses",
        "/invocations"}


def _app_with(api_key: str | None, admin_key: str | None):
    """SGLang's routes in a fresh app, with Stitch's middleware added as the plugin adds it and
    then SGLang's key middleware as `_setup_and_run_http_server` adds it."""
    from fastapi import FastAPI
    from sglang.srt.entrypoints.http_server import app as sglang_app
    from sglang.srt.utils.auth import add_api_key_middleware

    app = FastAPI()
    app.router.routes.extend(sglang_app.router.routes)
    app.add_middleware(sg.StitchMiddleware)
    add_api_key_middleware(app, api_key=api_key, admin_api_key=admin_key)
    stack = app.build_middleware_stack()
    mw = stack
    while not isinstance(mw, sg.StitchMiddleware):
        mw = mw.app
    return app, stack, mw


async def test_sglangs_key_check_runs_before_admission(monkeypatch):
    gate = VersionGate(RUN)
    monkeypatch.setattr(node, "_REFUSING", gate)
    monkeypatch.setattr(sg, "api_keys", lambda tm=None: (KEY, None))
    app, stack, mw = _app_with(KEY, None)
    mw.configure(app)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=stack),
                                 base_url="http://sglang") as c:
        t0 = time.monotonic()
        r = await c.post("/generate", json={}, headers={"X-Stitch-Min-Version": "1",
                                                       "X-Stitch-Wait": "30"})
        assert r.status_code == 401 and r.json() == {"error": "Unauthorized"}  # SGLang's own
        assert time.monotonic() - t0 < 5 and gate.not_ready_count == 0
        r = await c.put("/generate", json={}, headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 409 and protocol.parse_not_ready(r.json()).reason == "not_ready"
        assert (await c.post("/stitch/verify")).status_code == 401
        r = await c.post("/stitch/verify", headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 503 and r.json()["error"] == "not started"


async def test_admin_key_only_still_guards_verify(monkeypatch):
    """With only --admin-api-key SGLang leaves ordinary routes open; /stitch/verify takes it."""
    monkeypatch.setattr(node, "_REFUSING", VersionGate(RUN))
    monkeypatch.setattr(sg, "api_keys", lambda tm=None: (None, "adm"))
    app, stack, mw = _app_with(None, "adm")
    mw.configure(app)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=stack),
                                 base_url="http://sglang") as c:
        assert (await c.post("/generate", json={})).status_code == 409
        assert (await c.post("/stitch/verify")).status_code == 401
        r = await c.post("/stitch/verify", headers={"Authorization": "Bearer adm"})
        assert r.status_code == 503


@pytest.fixture(scope="module")
def never(tmp_path_factory):
    """A server that holds no verified policy version: a plain checkpoint has none."""
    root = tmp_path_factory.mktemp("sglang-routes")
    model_dir = build_tiny_model(root / "model", arch="qwen2", max_position_embeddings=512)
    server = Server(model_dir, root / "server.log", api_key=KEY, run=RUN)
    try:
        st = wait_started(server)
        assert st["state"] == "not_ready" and st["version"] is None, st
        yield server
    finally:
        server.stop()


def bodies(model: str) -> dict[str, dict]:
    chat = [{"role": "user", "content": "hi"}]
    return {
        "/generate": {"text": "hi", "sampling_params": {"max_new_tokens": 3}},
        "/v1/completions": {"model": model, "prompt": "hi", "max_tokens": 3},
        "/v1/chat/completions": {"model": model, "messages": chat, "max_tokens": 3},
        "/v1/responses": {"model": model, "input": "hi", "max_output_tokens": 3},
        "/v1/messages": {"model": model, "messages": chat, "max_tokens": 3},
        "/api/generate": {"model": model, "prompt": "hi", "options": {"num_predict": 3}},
        "/api/chat": {"model": model, "messages": chat, "options": {"num_predict": 3}},
        "/invocations": {"model": model, "messages": chat, "max_tokens": 3},
        "/encode": {"text": "hi"},
        "/v1/embeddings": {"model": model, "input": "hi"},
    }


def test_not_ready_engine_refuses_every_generating_route(never):
    assert never.http.get("/health").status_code == 503  # SGLang's warm-up is withheld
    st = never.http.get("/stitch/status")
    assert st.status_code == 503
    assert {r["path"] for r in st.json()["routes"]} >= GENERATING
    for path, body in bodies(never.model).items():
        for headers in ({}, {"X-Stitch-Version": "7"}):
            r = never.http.post(path, json=body, headers=headers)
            assert r.status_code == 409, (path, r.status_code, r.text)
            assert int(r.headers["Retry-After"]) >= 1 and r.headers["X-Stitch-Run"] == RUN
            err = protocol.parse_not_ready(r.json())
            assert err.reason == "not_ready" and err.serving is None, (path, r.text)
            assert err.wanted == (7 if headers else None)
            assert (r.json().get("type") == "error") == (path == "/v1/messages")
    r = never.http.put("/generate", json=bodies(never.model)["/generate"])
    assert r.status_code == 409
    # what generates nothing is not Stitch's to refuse
    r = never.http.post("/tokenize", json={"model": never.model, "prompt": "hi"},
                        headers={"X-Stitch-Version": "7"})
    assert r.status_code == 200, r.text
    assert never.http.get("/v1/models").status_code == 200
    # SGLang's key check first: without the key, 401 before any admission
    anon = httpx.Client(base_url=never.url, timeout=60)
    before = never.status()["not_ready_total"]
    r = anon.post("/generate", json=bodies(never.model)["/generate"],
                  headers={"X-Stitch-Version": "7", "X-Stitch-Wait": "30"})
    assert r.status_code == 401 and never.status()["not_ready_total"] == before
    anon.close()


def test_verify_needs_the_key_and_is_rate_limited(never):
    anon = httpx.Client(base_url=never.url, timeout=60)
    r = anon.post("/stitch/verify")
    assert r.status_code == 401 and r.json() == {"error": "Unauthorized"}
    assert anon.post("/stitch/verify", headers={"Authorization": "Bearer no"}).status_code == 401
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
