"""Routes under version control: found in an app's route table, each answered in its own dialect
(OpenAI, Responses, Anthropic, NDJSON streams), refused while not ready where they cannot be
stamped, admitted only past the engine's authentication; `/stitch/verify`'s key, one-at-a-time
and rate limit."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Annotated

import httpx
import pytest
from pydantic import BaseModel

import stitch_core.node as node
from stitch_core.node import FollowerMiddleware, bearer_check, check_guard, instance_guard
from stitch_core.serve import protocol, route_table
from stitch_core.serve.asgi import StitchASGI
from stitch_core.serve.gate import VersionGate
from stitch_core.serve.route_table import WEBSOCKET, Route, RouteInfo, RouteTable

from .test_protocol import RUN, FakeOpenAI, apply, assert_not_ready, hdrs


def client_for(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://engine")


def scripted(chunks: list[bytes], media: bytes = b"text/event-stream",
             hold: asyncio.Event | None = None, after: int = 1):
    """An app answering with `chunks` (waiting on `hold` after the first `after` of them)."""
    received: list[bytes] = []

    async def app(scope, receive, send):
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        received.append(body)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", media)]})
        for i, c in enumerate(chunks):
            if hold is not None and i == after:
                await hold.wait()
            await send({"type": "http.response.body", "body": c, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    app.received = received  # type: ignore[attr-defined]
    return app


def named_events(text: str) -> list[tuple[str | None, object]]:
    out = []
    for ev in text.replace("\r\n", "\n").split("\n\n"):
        lines = ev.splitlines()
        name = next((ln[7:] for ln in lines if ln.startswith("event: ")), None)
        data = "\n".join(ln[6:] for ln in lines if ln.startswith("data: "))
        if data:
            out.append((name, data if data == "[DONE]" else json.loads(data)))
    return out


# ----- the route table -----


def test_table_matches_methods_templates_and_first_route_wins():
    t = RouteTable([Route("/generate", frozenset({"POST", "PUT"}), salt=False),
                    Route("/generate", frozenset({"POST"}), dialect="anthropic"),
                    Route("/v1/x/{id}/run"), Route("/files/{p:path}", frozenset({"PUT"})),
                    Route("/v1/realtime", frozenset({WEBSOCKET}), control="refuse")])
    assert t.find("POST", "/generate").salt is False and t.find("PUT", "/generate") is not None
    assert t.find("GET", "/generate") is None
    assert t.find("POST", "/v1/x/abc/run").path == "/v1/x/{id}/run"
    assert t.find("POST", "/v1/x/a/b/run") is None and t.find("POST", "/v1/x/abc/run2") is None
    assert t.find("PUT", "/files/a/b/c") is not None
    assert t.find(WEBSOCKET, "/v1/realtime").control == "refuse"
    assert t.find("POST", "/v1/realtime") is None


class ChatRequest(BaseModel):
    messages: list = []
    cache_salt: str | None = None


class AnthropicMessagesRequest(BaseModel):
    messages: list = []


class ResponsesRequest(BaseModel):
    input: str = ""
    cache_salt: str | None = None


@dataclass
class NativeReq:
    text: str = ""
    cache_salt: str | None = None


@dataclass
class _Info:
    annotation: object


@dataclass
class _Field:
    field_info: _Info


class FakeRoute:
    """Duck-typed like a Starlette / FastAPI route."""

    def __init__(self, path, methods, endpoint, body=None):
        self.path, self.methods, self.endpoint = path, methods, endpoint
        self.body_field = _Field(_Info(body)) if body is not None else None


class FakeWebSocketRoute:
    def __init__(self, path, endpoint):
        self.path, self.endpoint = path, endpoint


class Mount:
    def __init__(self, path, routes):
        self.path, self.routes = path, routes


def _ep(name, module="engine.api", admin=False):
    def f():
        pass
    f.__name__, f.__module__ = name, module
    if admin:
        f._admin = True
    return f


def fake_app():
    included = type("_IncludedRouter", (), {})()
    included.original_router = type("R", (), {"routes": [
        FakeRoute("/scale", {"POST"}, _ep("scale", admin=True)),
        FakeRoute("/score", {"POST"}, _ep("create_score"))]})()
    included.include_context = type("C", (), {"prefix": "/pool"})()
    table = [
        FakeRoute("/health", {"GET"}, _ep("health")),
        FakeRoute("/v1/chat/completions", {"POST"}, _ep("create_chat"), ChatRequest),
        FakeRoute("/v1/chat/completions/render", {"POST"}, _ep("render_chat"), ChatRequest),
        FakeRoute("/v1/messages", {"POST"}, _ep("create_messages"), AnthropicMessagesRequest),
        FakeRoute("/v1/messages/count_tokens", {"POST"}, _ep("count_tokens")),
        FakeRoute("/v1/responses", {"POST"}, _ep("create_responses"),
                  ResponsesRequest | None),
        FakeRoute("/v1/responses/{response_id}", {"GET"}, _ep("retrieve_responses")),
        FakeRoute("/v1/responses/{response_id}/cancel", {"POST"}, _ep("cancel_responses")),
        FakeRoute("/generate", {"POST", "PUT"}, _ep("generate_request"),
                  Annotated[NativeReq, "body"]),
        FakeRoute("/tokenize", {"POST"}, _ep("tokenize")),
        FakeRoute("/flush_cache", {"GET", "POST"}, _ep("flush_cache", admin=True)),
        FakeRoute("/pause", {"POST"}, _ep("pause", "engine.admin")),
        FakeRoute("/v1/brand_new_api", {"POST"}, _ep("something_new")),
        FakeWebSocketRoute("/v1/realtime", _ep("realtime")),
        Mount("/sub", [FakeRoute("/gen", {"POST"}, _ep("gen"))]),
        included,
    ]
    return type("App", (), {"router": type("Router", (), {"routes": table})()})()


def test_discover_classifies_the_route_table_and_adds_the_fallback():
    def control(info: RouteInfo) -> bool:
        return getattr(info.endpoint, "_admin", False) or info.module == "engine.admin"

    found = route_table.discover(fake_app(), lambda i: route_table.generating(i, control),
                            [Route("/v1/completions"), Route("/generate", salt=False)])
    got = {r.path: (sorted(r.methods), r.dialect, r.salt, r.control) for r in found}
    assert got == {
        "/v1/chat/completions": (["POST"], "openai", True, "full"),
        "/v1/messages": (["POST"], "anthropic", False, "full"),
        "/v1/responses": (["POST"], "responses", True, "full"),
        "/generate": (["POST", "PUT"], "openai", True, "full"),  # the table's, not the fallback's
        "/v1/brand_new_api": (["POST"], "openai", False, "full"),  # unknown: fails closed
        "/v1/realtime": ([WEBSOCKET], "openai", False, "refuse"),
        "/sub/gen": (["POST"], "openai", False, "full"),
        "/pool/score": (["POST"], "openai", False, "full"),
        "/v1/completions": (["POST"], "openai", True, "full"),  # fallback
    }
    # an unreadable table: the fallback only
    broken = type("App", (), {"routes": property(lambda self: 1 / 0)})()
    assert [r.path for r in route_table.discover(broken, lambda i: None, [Route("/x")])] == ["/x"]


# ----- dialects -----


RESPONSES_STREAM = [
    b'event: response.created\ndata: {"type": "response.created", "sequence_number": 0}\n\n',
    b'event: response.output_text.delta\ndata: {"type": "response.output_text.delta", '
    b'"sequence_number": 1, "delta": "hi"}\n\n',
    b'event: response.completed\ndata: {"type": "response.completed", "sequence_number": 2}\n\n',
]
ANTHROPIC_STREAM = [
    b'event: message_start\ndata: {"type": "message_start", "message": {"id": "m1"}}\n\n',
    b'event: content_block_delta\ndata: {"type": "content_block_delta", "index": 0}\n\n',
    b'event: message_stop\ndata: {"type": "message_stop"}\n\n',
]


async def test_responses_stream_ends_with_a_typed_stitch_event_and_json_gets_the_field():
    gate = VersionGate(RUN)
    gate.set_version(5)
    app = scripted(RESPONSES_STREAM)
    mw = StitchASGI(app, gate, routes=[Route("/v1/responses", dialect="responses")])
    resp = await client_for(mw).post("/v1/responses", json={"input": "x", "stream": True})
    assert resp.status_code == 200 and resp.headers["x-stitch-version-start"] == "5"
    evs = named_events(resp.text)
    assert [n for n, _ in evs] == ["response.created", "response.output_text.delta",
                                   "response.completed", "response.stitch"]
    assert evs[-1][1] == {"type": "response.stitch", "sequence_number": 3,
                          "stitch": {"run": RUN, "version_start": 5, "version_end": 5}}
    assert json.loads(app.received[0])["cache_salt"] == f"stitch:{RUN}:v5"
    # not ready: an OpenAI-shaped 409
    gate2 = VersionGate(RUN)
    resp = await client_for(StitchASGI(app, gate2, routes=[
        Route("/v1/responses", dialect="responses")])).post("/v1/responses", json={})
    assert_not_ready(resp, reason="not_ready", serving=None, wanted=None, latest=None)


async def test_background_responses_are_refused():
    gate = VersionGate(RUN)
    gate.set_version(1)
    app = FakeOpenAI()
    mw = StitchASGI(app, gate, routes=[Route("/v1/responses", dialect="responses", salt=False)])
    resp = await client_for(mw).post("/v1/responses", json={"background": True})
    assert resp.status_code == 400 and resp.json()["error"]["type"] == "stitch_bad_request"
    assert "background" in resp.json()["error"]["message"] and app.received == []
    resp = await client_for(mw).post("/v1/responses", json={"background": False})
    assert resp.status_code == 200 and "cache_salt" not in app.received[0]
    assert gate.in_flight == 0


async def test_responses_stream_cut_mid_way_ends_with_an_error_event():
    gate = VersionGate(RUN)
    gate.set_version(1)
    hold = asyncio.Event()
    mw = StitchASGI(scripted(RESPONSES_STREAM, hold=hold, after=2), gate,
                    routes=[Route("/v1/responses", dialect="responses")])
    client = client_for(mw)
    task = asyncio.ensure_future(client.post("/v1/responses", json={}, headers=hdrs(exact=1)))
    while gate.in_flight == 0:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)
    await apply(gate, 2)
    hold.set()
    resp = await task
    evs = named_events(resp.text)
    name, err = evs[-1]
    assert name == "error" and err["type"] == "error"
    assert err["code"] == "stitch_version_not_ready" and err["sequence_number"] == 2
    assert protocol.parse_not_ready(err).reason == "version_changed"
    assert "[DONE]" not in resp.text and "response.completed" not in resp.text


async def test_anthropic_errors_and_named_stitch_event():
    gate = VersionGate(RUN)
    route = Route("/v1/messages", dialect="anthropic")
    app = scripted(ANTHROPIC_STREAM)
    client = client_for(StitchASGI(app, gate, routes=[route]))
    resp = await client.post("/v1/messages", json={"stream": True}, headers=hdrs(exact=7))
    assert resp.status_code == 409 and resp.json()["type"] == "error"
    assert protocol.parse_not_ready(resp.json()).reason == "not_ready"
    resp = await client.post("/v1/messages", json={}, headers={"X-Stitch-Version": "x" * 5000})
    assert resp.status_code == 400 and resp.json()["type"] == "error"
    gate.set_version(3)
    resp = await client.post("/v1/messages", json={"stream": True}, headers=hdrs(exact=3))
    evs = named_events(resp.text)
    assert [n for n, _ in evs] == ["message_start", "content_block_delta", "message_stop",
                                   "stitch"]
    assert evs[-1][1] == {"type": "stitch",
                          "stitch": {"run": RUN, "version_start": 3, "version_end": 3}}


async def test_anthropic_stream_cut_is_an_anthropic_error_event():
    gate = VersionGate(RUN)
    gate.set_version(1)
    hold = asyncio.Event()
    mw = StitchASGI(scripted(ANTHROPIC_STREAM, hold=hold, after=1), gate,
                    routes=[Route("/v1/messages", dialect="anthropic")])
    task = asyncio.ensure_future(client_for(mw).post("/v1/messages", json={},
                                                     headers=hdrs(exact=1)))
    while gate.in_flight == 0:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)
    await apply(gate, 2)
    hold.set()
    evs = named_events((await task).text)
    assert evs[0][0] == "message_start"
    assert evs[-1][0] == "error" and evs[-1][1]["type"] == "error"
    assert protocol.parse_not_ready(evs[-1][1]).reason == "version_changed"


async def test_ndjson_stream_stamps_the_done_line():
    gate = VersionGate(RUN)
    gate.set_version(2)
    lines = [b'{"model": "m", "response": "a", "done": false}\n{"model": "m", ',
             b'"response": "b", "done": false}\n', b'{"model": "m", "done": true}\n']
    mw = StitchASGI(scripted(lines, b"application/x-ndjson"), gate, paths=("/api/generate",))
    resp = await client_for(mw).post("/api/generate", json={})
    assert resp.headers["x-stitch-version-start"] == "2"
    objs = [json.loads(ln) for ln in resp.text.splitlines()]
    assert [o.get("response") for o in objs] == ["a", "b", None]
    assert objs[-1]["done"] is True
    assert objs[-1]["stitch"] == {"run": RUN, "version_start": 2, "version_end": 2}
    # no done line (and no final newline): a stitch line at the end
    mw = StitchASGI(scripted([b'{"a": 1}\n{"a": 2}'], b"application/x-ndjson"), gate,
                    paths=("/api/generate",))
    objs = [json.loads(ln) for ln in (await client_for(mw).post("/api/generate", json={}))
            .text.splitlines()]
    assert objs == [{"a": 1}, {"a": 2}, {"stitch": {"run": RUN, "version_start": 2,
                                                    "version_end": 2}}]


async def test_ndjson_stream_cut_ends_with_an_error_line():
    gate = VersionGate(RUN)
    gate.set_version(1)
    hold = asyncio.Event()
    lines = [b'{"response": "a", "done": false}\n', b'{"response": "b", "done": true}\n']
    mw = StitchASGI(scripted(lines, b"application/x-ndjson", hold=hold), gate,
                    paths=("/api/generate",))
    task = asyncio.ensure_future(client_for(mw).post("/api/generate", json={},
                                                     headers=hdrs(exact=1)))
    while gate.in_flight == 0:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)
    await apply(gate, 2)
    hold.set()
    objs = [json.loads(ln) for ln in (await task).text.splitlines()]
    assert objs[0] == {"response": "a", "done": False}
    assert protocol.parse_not_ready(objs[-1]).reason == "version_changed" and len(objs) == 2


# ----- routes that cannot be stamped -----


async def test_refuse_only_route_is_409_until_ready_then_untouched():
    gate = VersionGate(RUN)
    app = FakeOpenAI()
    mw = StitchASGI(app, gate, paths=(), routes=[Route("/v1/raw", control="refuse")])
    client = client_for(mw)
    assert_not_ready(await client.post("/v1/raw", json={}), reason="not_ready", serving=None,
                     wanted=None, latest=None)
    gate.set_version(4)
    resp = await client.post("/v1/raw", json={"a": 1})
    assert resp.status_code == 200 and "stitch" not in resp.json()
    assert app.received == [{"a": 1}]  # not salted
    resp = await client.post("/v1/raw", json={}, headers=hdrs(minimum=1))
    assert resp.status_code == 400 and "cannot be stamped" in resp.json()["error"]["message"]
    assert gate.in_flight == 0


async def _ws(mw, extensions=None):
    sent: list[dict] = []
    inner: list[str] = []

    async def app(scope, receive, send):
        inner.append(scope["type"])

    mw.app = app

    async def receive():
        return {"type": "websocket.connect"}

    async def send(msg):
        sent.append(msg)

    scope = {"type": "websocket", "path": "/v1/realtime", "headers": []}
    if extensions is not None:
        scope["extensions"] = extensions
    await mw(scope, receive, send)
    return sent, inner


async def test_websocket_route_refused_while_not_ready():
    gate = VersionGate(RUN)
    mw = StitchASGI(FakeOpenAI(), gate, routes=[
        Route("/v1/realtime", frozenset({WEBSOCKET}), control="refuse")])
    sent, inner = await _ws(mw)
    assert inner == [] and sent[0]["type"] == "websocket.close" and sent[0]["code"] == 1013
    sent, inner = await _ws(mw, {"websocket.http.response": {}})
    assert sent[0]["type"] == "websocket.http.response.start" and sent[0]["status"] == 409
    assert protocol.parse_not_ready(json.loads(sent[1]["body"])).reason == "not_ready"
    gate.set_version(1)
    sent, inner = await _ws(mw)
    assert inner == ["websocket"] and sent == []


# ----- authentication before admission -----


async def test_guard_runs_before_admission():
    gate = VersionGate(RUN)
    app = FakeOpenAI()
    mw = StitchASGI(app, gate)
    mw.set_guard(check_guard(bearer_check(["k1", "k2"])))
    client = client_for(mw)
    # no key: 401 at once, even with a wait (the gate never sees it)
    resp = await client.post("/v1/completions", json={}, headers=hdrs(minimum=3, wait=30))
    assert resp.status_code == 401 and resp.json() == {"error": "Unauthorized"}
    assert gate.not_ready_count == 0
    resp = await client.post("/v1/completions", json={},
                             headers={"Authorization": "Bearer k3", **hdrs(exact=1)})
    assert resp.status_code == 401
    resp = await client.post("/v1/completions", json={}, headers={"Authorization": "Bearer k2"})
    assert_not_ready(resp, reason="not_ready", serving=None, wanted=None, latest=None)
    gate.set_version(1)
    resp = await client.post("/v1/completions", json={}, headers={"Authorization": "bearer k1"})
    assert resp.status_code == 200 and resp.json()["stitch"]["version_start"] == 1
    # off the controlled routes the guard is not Stitch's business
    assert (await client.get("/v1/models")).status_code == 200
    assert (await client.get("/stitch/status")).status_code == 200


class EngineAuth:
    """Like vLLM's AuthenticationMiddleware: guards /v1 paths with a key."""

    def __init__(self, app, key):
        self.app, self.key = app, key

    async def __call__(self, scope, receive, send):
        auth = dict(scope.get("headers", [])).get(b"authorization", b"")
        if scope["path"].startswith("/v1") and auth != b"Bearer " + self.key:
            await FakeOpenAI._json(send, 401, {"error": "engine says no"})
            return
        await self.app(scope, receive, send)


async def test_engine_auth_instance_below_is_run_in_front_of_admission():
    gate = VersionGate(RUN)
    engine = EngineAuth(FakeOpenAI(), b"s3cret")

    class MW(FollowerMiddleware):
        def setup_auth(self, app):
            auth = self.below(lambda m: isinstance(m, EngineAuth))
            self.set_guard(instance_guard(auth))

    mw = MW(engine, routes=[Route("/generate")])
    mw._gate = gate
    mw.configure(None)
    client = client_for(mw)
    resp = await client.post("/v1/completions", json={}, headers=hdrs(minimum=1, wait=30))
    assert resp.status_code == 401 and resp.json() == {"error": "engine says no"}
    assert gate.not_ready_count == 0
    # the engine guards /v1 only: /generate is admitted without a key, as the engine would
    assert (await client.post("/generate", json={})).status_code == 409
    gate.set_version(1)
    resp = await client.post("/v1/completions", json={}, headers={"Authorization": "Bearer s3cret"})
    assert resp.status_code == 200 and resp.json()["stitch"]["version_end"] == 1
    assert engine.key == b"s3cret" and engine.app is not mw  # the engine's own stack untouched


# ----- /stitch/verify -----


class SlowFollower:
    def __init__(self):
        self.calls = 0
        self.release = asyncio.Event()

    async def verify(self):
        self.calls += 1
        await self.release.wait()
        return {"ok": True, "tensors": 3}


@pytest.fixture
def follower(monkeypatch):
    f = SlowFollower()
    monkeypatch.setattr(node, "_CURRENT", f)
    return f


class KeyedMW(FollowerMiddleware):
    def setup_auth(self, app):
        self.control_check = bearer_check(["adm"])


async def test_verify_needs_the_key_runs_one_at_a_time_and_is_rate_limited(follower, monkeypatch):
    monkeypatch.setenv("STITCH_VERIFY_COOLDOWN", "0.3")
    mw = KeyedMW(FakeOpenAI())
    mw.configure(None)
    client = client_for(mw)
    resp = await client.post("/stitch/verify")
    assert resp.status_code == 401 and resp.json() == {"error": "Unauthorized"}
    assert resp.headers["www-authenticate"] == "Bearer"
    resp = await client.post("/stitch/verify", headers={"Authorization": "Bearer nope"})
    assert resp.status_code == 401 and follower.calls == 0
    key = {"Authorization": "Bearer adm"}
    first = asyncio.ensure_future(client.post("/stitch/verify", headers=key))
    while follower.calls == 0:
        await asyncio.sleep(0.01)
    busy = await client.post("/stitch/verify", headers=key)
    assert busy.status_code == 429 and busy.json()["error"]["type"] == "stitch_busy"
    assert int(busy.headers["retry-after"]) >= 1
    follower.release.set()
    assert (await first).status_code == 200 and (await first).json()["ok"] is True
    limited = await client.post("/stitch/verify", headers=key)
    assert limited.status_code == 429 and limited.json()["error"]["type"] == "stitch_rate_limited"
    assert limited.headers["retry-after"] == "1" and follower.calls == 1
    await asyncio.sleep(0.35)
    assert (await client.post("/stitch/verify", headers=key)).status_code == 200
    assert follower.calls == 2


async def test_verify_open_without_keys_and_refused_when_keys_cannot_be_read(follower):
    follower.release.set()
    mw = FollowerMiddleware(FakeOpenAI())
    mw.configure(None)
    assert (await client_for(mw).post("/stitch/verify")).status_code == 200

    class Broken(FollowerMiddleware):
        def setup_auth(self, app):
            raise RuntimeError("no config")

    mw = Broken(FakeOpenAI())
    mw.configure(None)
    assert (await client_for(mw).post("/stitch/verify")).status_code == 401


async def test_status_lists_the_controlled_routes():
    gate = VersionGate(RUN)
    gate.set_version(1)
    mw = StitchASGI(FakeOpenAI(), gate, routes=[Route("/v1/messages", dialect="anthropic")])
    st = (await client_for(mw).get("/stitch/status")).json()
    assert {"path": "/v1/messages", "methods": ["POST"], "control": "full",
            "dialect": "anthropic", "salt": True} in st["routes"]
    assert any(r["path"] == "/v1/completions" for r in st["routes"])


async def test_root_path_is_stripped_before_matching():
    gate = VersionGate(RUN)
    gate.set_version(1)
    app = FakeOpenAI()
    mw = StitchASGI(app, gate)

    async def server(scope, receive, send):
        scope = {**scope, "root_path": "/api", "path": "/api" + scope["path"]}
        await mw(scope, receive, send)

    resp = await client_for(server).post("/v1/completions", json={})
    assert resp.json()["stitch"]["version_start"] == 1
