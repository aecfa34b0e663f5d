"""StitchASGI mechanics: what passes through untouched, SSE edge cases, gate providers, lifespan."""

from __future__ import annotations

import asyncio
import json

import httpx

from stitch_core.serve.asgi import StitchASGI, salt_body
from stitch_core.serve.gate import VersionGate
from stitch_core.serve.stamping import sse_data

from .test_protocol import RUN, FakeOpenAI, apply, assert_not_ready, events, hdrs, make


def client_for(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://engine")


def sse_app(chunks: list[bytes], *, hold: asyncio.Event | None = None,
            arrived: asyncio.Event | None = None):
    """An app streaming `chunks` as they are (after waiting on `hold` before its first byte)."""

    async def app(scope, receive, send):
        while (await receive()).get("more_body"):
            pass
        if arrived is not None:
            arrived.set()
        if hold is not None:
            await hold.wait()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream"),
                                (b"content-length", b"999")]})
        for c in chunks:
            await send({"type": "http.response.body", "body": c, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    return app


async def test_other_paths_and_methods_pass_through_untouched():
    app, gate, client = make()
    gate.set_version(3)
    for resp in (await client.get("/v1/models"), await client.get("/v1/completions")):
        assert resp.status_code == 200
        assert resp.json() == {"object": "list", "data": [{"id": "fake"}]}
        assert not any(k.startswith("x-stitch") for k in resp.headers)
    # pins are not checked off the configured paths
    resp = await client.post("/v1/embeddings", json={}, headers=hdrs(exact=1))
    assert resp.status_code == 200 and "stitch" not in resp.json()
    assert "cache_salt" not in app.received[0]


async def test_configurable_paths():
    app, gate, client = make(paths=("/generate",))
    gate.set_version(3)
    resp = await client.post("/v1/completions", json={})
    assert "stitch" not in resp.json() and "x-stitch-run" not in resp.headers
    resp = await client.post("/generate", json={})
    assert resp.json()["stitch"]["version_start"] == 3


async def test_app_errors_keep_their_body_but_carry_version_headers():
    app, gate, client = make()
    gate.set_version(3)
    resp = await client.post("/v1/completions", json={"fail": True})
    assert resp.status_code == 400
    assert resp.json() == {"error": {"message": "invalid request"}}
    assert resp.headers["x-stitch-version-start"] == resp.headers["x-stitch-version-end"] == "3"
    # a body that is not JSON reaches the app unchanged (no salt)
    resp = await client.post("/v1/completions", content=b"{not json",
                             headers={"content-type": "application/json"})
    assert resp.status_code == 400 and resp.json()["raw"] == "{not json"
    assert resp.headers["x-stitch-run"] == RUN


async def test_gate_provider_none_passes_through_and_status_is_503():
    holder: dict = {"gate": None}
    app = FakeOpenAI()
    client = client_for(StitchASGI(app, lambda: holder["gate"]))
    resp = await client.post("/v1/completions", json={"prompt": "x"}, headers=hdrs(exact=9))
    assert resp.status_code == 200 and "stitch" not in resp.json()
    assert "cache_salt" not in app.received[0]
    status = await client.get("/stitch/status")
    assert status.status_code == 503 and status.json()["state"] == "not_ready"

    gate = VersionGate(RUN)
    gate.set_version(2)
    holder["gate"] = gate
    resp = await client.post("/v1/completions", json={}, headers=hdrs(exact=9))
    assert_not_ready(resp, reason="behind", serving=2, wanted=9, latest=2)
    assert (await client.get("/stitch/status")).json()["version"] == 2


async def test_status_path_is_configurable_and_only_answers_get():
    app, gate, client = make(status_path="/admin/stitch")
    gate.set_version(1)
    assert (await client.get("/admin/stitch")).json()["state"] == "serving"
    assert (await client.get("/stitch/status")).json()["object"] == "list"  # the app's answer
    assert (await client.post("/admin/stitch", json={})).status_code == 200  # passed to the app
    assert "cache_salt" not in app.received[-1]


async def test_stream_without_done_still_gets_the_stitch_chunk_last():
    gate = VersionGate(RUN)
    gate.set_version(4)
    body = b'data: {"id": "x", "model": "m", "choices": [{"text": "a"}]}\r\n\r\n'
    resp = await client_for(StitchASGI(sse_app([body]), gate)).post("/v1/completions", json={})
    assert "content-length" not in resp.headers  # the stream is rewritten
    assert resp.text.startswith(body.decode())
    evs = events(resp.text.replace("\r\n", "\n"))
    assert len(evs) == 2 and evs[-1]["stitch"]["version_end"] == 4
    assert evs[-1]["id"] == "x" and evs[-1]["model"] == "m" and evs[-1]["choices"] == []


async def test_stream_with_events_split_and_crlf_delimiters():
    gate = VersionGate(RUN)
    gate.set_version(4)
    whole = (b'data: {"id": "x", "choices": [{"text": "a"}]}\r\n\r\n'
             b'data: {"id": "y", "choices": [{"text": "b"}]}\r\n\r\ndata: [DONE]\r\n\r\n')
    chunks = [whole[i:i + 7] for i in range(0, len(whole), 7)]
    resp = await client_for(StitchASGI(sse_app(chunks), gate)).post("/v1/completions", json={})
    evs = events(resp.text.replace("\r\n", "\n"))
    assert [e["choices"] for e in evs[:-1]] == [[{"text": "a"}], [{"text": "b"}], []]
    assert evs[-2]["id"] == "y" and evs[-2]["stitch"]["version_start"] == 4
    assert evs[-1] == "[DONE]"


async def test_pinned_stream_whose_version_moved_before_its_first_byte_is_a_plain_409():
    gate = VersionGate(RUN)
    gate.set_version(1)
    hold, arrived = asyncio.Event(), asyncio.Event()
    mw = StitchASGI(sse_app([b"data: {}\n\n", b"data: [DONE]\n\n"], hold=hold, arrived=arrived),
                    gate)
    task = asyncio.ensure_future(client_for(mw).post("/v1/completions", json={},
                                                     headers=hdrs(exact=1)))
    await arrived.wait()
    await apply(gate, 2)
    hold.set()
    resp = await task
    assert_not_ready(resp, reason="version_changed", serving=2, wanted=1, latest=2)
    assert resp.headers["x-stitch-version-end"] == "2"


async def test_lifespan_and_websocket_scopes_pass_through_and_lifespan_is_overridable():
    seen = []

    class Hooked(StitchASGI):
        async def lifespan(self, scope, receive, send):
            seen.append("lifespan")
            await super().lifespan(scope, receive, send)

    inner = FakeOpenAI()
    mw = Hooked(inner, VersionGate(RUN))
    incoming = [{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}]
    sent = []

    async def receive():
        return incoming.pop(0)

    async def send(msg):
        sent.append(msg["type"])

    await mw({"type": "lifespan", "asgi": {"version": "3.0"}}, receive, send)
    assert seen == ["lifespan"]
    assert sent == ["lifespan.startup.complete", "lifespan.shutdown.complete"]

    ws_seen = []

    async def ws_app(scope, receive, send):
        ws_seen.append(scope["type"])

    await StitchASGI(ws_app, VersionGate(RUN))({"type": "websocket", "path": "/v1/completions"},
                                               receive, send)
    assert ws_seen == ["websocket"]


def test_helpers():
    assert sse_data(b"event: x\ndata: a\ndata:b\n\n") == "a\nb"
    assert sse_data(b": comment\n\n") is None
    out = json.loads(salt_body(b'{"prompt": "\xc3\xa9", "cache_salt": null}', "r", 2))
    assert out == {"prompt": "\u00e9", "cache_salt": "stitch:r:v2"}
    assert salt_body(b"[1, 2]", "r", 2) is None
    assert salt_body(b'{"cache_salt": 5}', "r", 2) is None  # left for the app to reject


async def test_an_oversized_request_body_is_a_413_before_the_app_sees_it():
    """The middleware buffers a version-controlled body to salt it: at most `max_body` bytes."""
    gate = VersionGate(RUN)
    gate.set_version(1)
    app = FakeOpenAI()
    client = client_for(StitchASGI(app, gate, max_body=1000))
    r = await client.post("/v1/completions", json={"prompt": "x" * 2000})
    assert r.status_code == 413 and "over 1,000 bytes" in r.json()["error"]["message"]
    assert not app.received  # never reached the engine
    r = await client.post("/v1/completions", json={"prompt": "x" * 100})
    assert r.status_code == 200 and app.received
