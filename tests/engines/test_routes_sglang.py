"""SGLang's routes: every route of SGLang that generates is version-controlled, and only past
SGLang's own API-key check. SGLang's real app (imported in this process, no engine): the routes
Stitch finds in its route table (admin endpoints and the tokenizer / parser / session ones left
alone), and the order of SGLang's real `--api-key` middleware and admission. The data of
test_routes.py for SGLang (a real server holding no version, `--api-key`; SGLang's warm-up is
withheld meanwhile): what generates, a body for each route. The served side runs on the follower
(test_server_sglang.py).
"""

from __future__ import annotations

import time

import httpx

import stitch_core.node as node
from stitch_core.serve import protocol, route_table
from stitch_core.serve.gate import VersionGate
from stitch_sglang import server as sg

from .test_routes import KEY, RUN

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

# test_routes.py's server: its flags, the paths its not-ready check streams, the path of its
# key check
NEVER_KW: dict = {}
STREAMED = ()
# /stitch/status without the key: SGLang's key middleware guards all but /health, /ready, /metrics
STATUS_ANON = 401
KEYED = "/generate"


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


def not_ready_extras(never) -> None:
    assert never.http.get("/health").status_code == 503  # SGLang's warm-up is withheld
    r = never.http.put("/generate", json=bodies(never.model)["/generate"])
    assert r.status_code == 409


def tokenized(r) -> None:
    assert r.status_code == 200, r.text
