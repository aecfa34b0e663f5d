"""The Stitch serving protocol end to end: real ASGI traffic (httpx) through StitchASGI around a
small fake OpenAI app, with a VersionGate driven the way an engine coordinator drives it."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from stitch_core.serve import protocol
from stitch_core.serve.asgi import StitchASGI
from stitch_core.serve.gate import NotReadyError, VersionGate
from stitch_core.serve.metrics import Metrics

RUN = "run-a"


class FakeOpenAI:
    """A minimal OpenAI-compatible ASGI app.

    Non-streaming: a JSON completion echoing the request body it received (``"echo"``).
    Streaming (``"stream": true``): three chunks, deliberately split across ASGI messages, then
    ``data: [DONE]``. A request with ``"hold": true`` waits on `self.hold` (after its first chunk
    when streaming); every request puts its parsed body on `self.arrivals` when it arrives.
    """

    def __init__(self) -> None:
        self.hold = asyncio.Event()
        self.arrivals: asyncio.Queue[dict] = asyncio.Queue()
        self.received: list[dict] = []
        self.content_lengths: list[int | None] = []
        self.stopped = 0  # sends that raised (the middleware cut the stream; ASGI spec 2.4)
        self.disconnected = 0  # streams ended because receive() said the client left
        self.finished = 0

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        if scope["method"] == "GET":
            await self._json(send, 200, {"object": "list", "data": [{"id": "fake"}]})
            return
        try:
            req = json.loads(body)
        except ValueError:
            await self._json(send, 400, {"error": {"message": "bad json"}, "raw": body.decode()})
            return
        cl = dict(scope["headers"]).get(b"content-length")
        self.content_lengths.append(int(cl) if cl is not None else None)
        self.received.append(req)
        self.arrivals.put_nowait(req)
        if req.get("fail"):
            await self._json(send, 400, {"error": {"message": "invalid request"}})
            return
        try:
            if req.get("stream"):
                await self._stream(req, receive, send)
                return
            if req.get("hold"):
                await self.hold.wait()
            await self._json(send, 200, {
                "id": "cmpl-1", "object": "text_completion", "created": 7, "model": "fake",
                "choices": [{"index": 0, "text": "hello", "finish_reason": "stop"}],
                "echo": req})
        except OSError:
            self.stopped += 1
            raise
        self.finished += 1

    @staticmethod
    async def _json(send, status, obj):
        data = json.dumps(obj).encode()
        await send({"type": "http.response.start", "status": status, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
        await send({"type": "http.response.body", "body": data, "more_body": False})

    async def _stream(self, req, receive, send):
        """Streams like Starlette under ASGI spec < 2.4: stops once receive() says disconnect."""
        listener = asyncio.ensure_future(receive())
        try:
            await self._chunks(req, send, listener)
        finally:
            listener.cancel()

    async def _chunks(self, req, send, listener):
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream; charset=utf-8")]})

        def chunk(text):
            return ("data: " + json.dumps({
                "id": "chat-1", "object": "chat.completion.chunk", "created": 7, "model": "fake",
                "choices": [{"index": 0, "delta": {"content": text}}]}) + "\n\n").encode()

        second = chunk("b")
        parts = [chunk("a"), None, second[:10], second[10:], chunk("c") + b"data: [DONE]\n\n", b""]
        for part in parts:
            if part is None:
                if req.get("hold"):
                    await self.hold.wait()
                continue
            await send({"type": "http.response.body", "body": part, "more_body": part != b""})
            await asyncio.sleep(0)
            if part != b"" and listener.done():
                assert listener.result()["type"] == "http.disconnect"
                self.disconnected += 1
                return
        self.finished += 1


def make(gate: VersionGate | None = None, *, spec: str | None = None, **kw):
    """Fake app, gate and an httpx client through StitchASGI (`spec`: the server's ASGI
    spec_version, as uvicorn sets it; httpx sets none, i.e. 2.0)."""
    app = FakeOpenAI()
    gate = gate if gate is not None else VersionGate(RUN)
    mw = StitchASGI(app, gate, **kw)

    async def server(scope, receive, send):
        if spec is not None:
            scope = {**scope, "asgi": {"version": "3.0", "spec_version": spec}}
        await mw(scope, receive, send)

    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=server), base_url="http://engine")
    return app, gate, client


def hdrs(exact=None, minimum=None, wait=None) -> dict:
    h = {}
    if exact is not None:
        h["X-Stitch-Version"] = str(exact)
    if minimum is not None:
        h["X-Stitch-Min-Version"] = str(minimum)
    if wait is not None:
        h["X-Stitch-Wait"] = str(wait)
    return h


def events(text: str) -> list:
    """SSE data payloads: parsed JSON objects, or the raw string ('[DONE]')."""
    out = []
    for ev in text.split("\n\n"):
        data = "\n".join(ln[6:] for ln in ev.splitlines() if ln.startswith("data: "))
        if data:
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def assert_not_ready(resp: httpx.Response, *, reason, serving, wanted, latest):
    assert resp.status_code == 409, resp.text
    err = resp.json()["error"]
    assert err["type"] == "stitch_version_not_ready"
    assert (err["serving"], err["wanted"], err["latest"], err["run"], err["reason"]) == (
        serving, wanted, latest, RUN, reason)
    assert err["message"]
    assert int(resp.headers["retry-after"]) >= 1
    assert protocol.parse_not_ready(resp.json()).reason == reason


def assert_versions(resp: httpx.Response, start: int, end: int):
    assert resp.headers["x-stitch-run"] == RUN
    assert int(resp.headers["x-stitch-version-start"]) == start
    assert int(resp.headers["x-stitch-version-end"]) == end


async def apply(gate: VersionGate, target: int, *, commit: bool = True,
                hold: asyncio.Event | None = None, entered: asyncio.Event | None = None):
    async with gate.applying(target) as h:
        if entered is not None:
            entered.set()
        if hold is not None:
            await hold.wait()
        if commit:
            h.commit(patch_bytes=1234)


# ----- served -----


async def test_served_non_streaming_marks_headers_and_body():
    app, gate, client = make()
    gate.set_version(3)
    resp = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4})
    assert resp.status_code == 200
    assert_versions(resp, 3, 3)
    body = resp.json()
    assert body["stitch"] == {"run": RUN, "version_start": 3, "version_end": 3}
    assert body["choices"][0]["text"] == "hello" and body["echo"]["prompt"] == "hi"
    assert int(resp.headers["content-length"]) == len(resp.content)
    info = protocol.parse_stitch(body)
    assert info is not None and info.single_version and info.version_end == 3
    assert gate.in_flight == 0


async def test_served_streaming_last_json_chunk_carries_stitch_then_done():
    app, gate, client = make()
    gate.set_version(5)
    resp = await client.post("/v1/chat/completions", json={"messages": [], "stream": True})
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/event-stream")
    assert_versions(resp, 5, 5)
    evs = events(resp.text)
    assert evs[-1] == "[DONE]"
    last = evs[-2]
    assert last["stitch"] == {"run": RUN, "version_start": 5, "version_end": 5}
    assert last["choices"] == []
    assert (last["id"], last["object"], last["created"], last["model"]) == (
        "chat-1", "chat.completion.chunk", 7, "fake")
    # the model's chunks are forwarded intact (one was split across two ASGI messages)
    assert "".join(e["choices"][0]["delta"]["content"] for e in evs[:-2]) == "abc"
    assert sum(1 for e in evs if isinstance(e, dict) and "stitch" in e) == 1
    assert app.finished == 1 and gate.in_flight == 0


@pytest.mark.parametrize("h", [hdrs(exact=4), hdrs(minimum=4), hdrs(minimum=2), hdrs()])
async def test_satisfied_pins_are_served(h):
    app, gate, client = make()
    gate.set_version(4)
    resp = await client.post("/v1/completions", json={"prompt": "x"}, headers=h)
    assert resp.status_code == 200
    assert_versions(resp, 4, 4)


# ----- refused -----


async def test_exact_older_is_refused_immediately_even_with_wait():
    app, gate, client = make()
    gate.set_version(5)
    gate.set_latest(6)
    t0 = time.monotonic()
    resp = await client.post("/v1/completions", json={"prompt": "x"},
                             headers=hdrs(exact=3, wait=5))
    assert time.monotonic() - t0 < 1.0
    assert_not_ready(resp, reason="passed", serving=5, wanted=3, latest=6)
    assert resp.headers["x-stitch-run"] == RUN
    assert app.received == []  # never reached the engine
    assert gate.not_ready_count == 1


async def test_min_newer_without_wait_is_refused():
    app, gate, client = make()
    gate.set_version(2)
    gate.set_latest(3)
    resp = await client.post("/v1/completions", json={"prompt": "x"}, headers=hdrs(minimum=3))
    assert_not_ready(resp, reason="behind", serving=2, wanted=3, latest=3)
    assert app.received == []


async def test_min_newer_with_wait_catches_up_and_serves_the_new_version():
    calls = []

    async def catch_up(v: int, timeout: float) -> bool:
        calls.append((v, timeout))
        await asyncio.sleep(0.2)
        gate.set_latest(4)
        await apply(gate, 4)
        return True

    app, gate, client = make(VersionGate(RUN, catch_up=catch_up))
    gate.set_version(2)
    t0 = time.monotonic()
    resp = await client.post("/v1/completions", json={"prompt": "x"},
                             headers=hdrs(minimum=4, wait=5))
    assert 0.15 < time.monotonic() - t0 < 2.0
    assert resp.status_code == 200, resp.text
    assert_versions(resp, 4, 4)
    assert resp.json()["stitch"]["version_start"] == 4
    assert len(calls) == 1 and calls[0][0] == 4 and 4.0 < calls[0][1] <= 5.0
    assert app.received[0]["cache_salt"] == f"stitch:{RUN}:v4"


async def test_exact_newer_with_wait_wakes_on_set_version_without_catch_up():
    app, gate, client = make()
    gate.set_version(1)

    async def later():
        await asyncio.sleep(0.1)
        gate.set_version(2)

    task = asyncio.ensure_future(later())
    resp = await client.post("/v1/completions", json={}, headers=hdrs(exact=2, wait=3))
    await task
    assert resp.status_code == 200
    assert_versions(resp, 2, 2)


async def test_wait_times_out_with_409():
    async def catch_up(v: int, timeout: float) -> bool:
        return False  # cannot get there

    app, gate, client = make(VersionGate(RUN, catch_up=catch_up))
    gate.set_version(2)
    gate.set_latest(9)
    t0 = time.monotonic()
    resp = await client.post("/v1/completions", json={}, headers=hdrs(minimum=9, wait=0.3))
    elapsed = time.monotonic() - t0
    assert 0.25 < elapsed < 1.5
    assert_not_ready(resp, reason="behind", serving=2, wanted=9, latest=9)


async def test_not_ready_refuses_even_unpinned_requests():
    app, gate, client = make()
    resp = await client.post("/v1/completions", json={})
    assert_not_ready(resp, reason="not_ready", serving=None, wanted=None, latest=None)
    status = await client.get("/stitch/status")
    assert status.status_code == 503 and status.json()["state"] == "not_ready"


async def test_unpinned_request_waits_for_a_first_version():
    app, gate, client = make()
    loop = asyncio.get_running_loop()
    loop.call_later(0.1, gate.set_version, 1)
    resp = await client.post("/v1/completions", json={}, headers=hdrs(wait=2))
    assert resp.status_code == 200
    assert_versions(resp, 1, 1)


@pytest.mark.parametrize("h", [
    {"X-Stitch-Version": "3", "X-Stitch-Min-Version": "3"},
    {"X-Stitch-Version": "abc"},
    {"X-Stitch-Version": "-1"},
    {"X-Stitch-Min-Version": "1.5"},
    {"X-Stitch-Version": ""},
    {"X-Stitch-Wait": "-1"},
    {"X-Stitch-Wait": "soon"},
    {"X-Stitch-Wait": "nan"},
])
async def test_bad_headers_are_400(h):
    app, gate, client = make()
    gate.set_version(3)
    resp = await client.post("/v1/completions", json={}, headers=h)
    assert resp.status_code == 400
    assert resp.json()["error"]["type"] == "stitch_bad_request"
    assert resp.json()["error"]["message"]
    assert app.received == []


# ----- prefix-cache salt -----


async def test_cache_salt_is_injected_and_combined_with_a_user_salt():
    app, gate, client = make()
    gate.set_version(7)
    await client.post("/v1/completions", json={"prompt": "p"})
    await client.post("/v1/chat/completions", json={"messages": [], "cache_salt": "user-1"})
    assert app.received[0]["cache_salt"] == f"stitch:{RUN}:v7"
    assert app.received[1]["cache_salt"] == f"user-1|stitch:{RUN}:v7"
    assert app.received[0]["prompt"] == "p"
    # the inner app saw a content-length matching the rewritten body
    for req, cl in zip(app.received, app.content_lengths, strict=True):
        assert cl == len(json.dumps(req, ensure_ascii=False).encode())


async def test_cache_salt_can_be_switched_off():
    app, gate, client = make(salt=False)
    gate.set_version(7)
    resp = await client.post("/v1/completions", json={"prompt": "p"})
    assert resp.status_code == 200
    assert "cache_salt" not in app.received[0]


# ----- applies: immediate mode -----


async def test_unpinned_request_across_an_apply_reports_start_before_end():
    app, gate, client = make()
    gate.set_version(3)
    task = asyncio.ensure_future(client.post("/v1/completions", json={"hold": True}))
    await app.arrivals.get()
    await apply(gate, 4)
    app.hold.set()
    resp = await task
    assert resp.status_code == 200
    assert_versions(resp, 3, 4)
    assert resp.json()["stitch"] == {"run": RUN, "version_start": 3, "version_end": 4}
    assert protocol.parse_stitch(resp.json()).single_version is False


async def test_min_pinned_streaming_across_an_apply_reports_start_before_end():
    app, gate, client = make()
    gate.set_version(3)
    task = asyncio.ensure_future(client.post(
        "/v1/chat/completions", json={"stream": True, "hold": True}, headers=hdrs(minimum=2)))
    await app.arrivals.get()
    await apply(gate, 4)
    app.hold.set()
    resp = await task
    assert_versions(resp, 3, 3)  # headers left before the apply
    evs = events(resp.text)
    assert evs[-1] == "[DONE]"
    assert evs[-2]["stitch"] == {"run": RUN, "version_start": 3, "version_end": 4}


async def test_request_completing_during_an_apply_reports_its_target_as_end():
    app, gate, client = make()
    gate.set_version(3)
    hold_apply, entered = asyncio.Event(), asyncio.Event()
    applier = asyncio.ensure_future(apply(gate, 4, hold=hold_apply, entered=entered))
    await entered.wait()
    assert gate.state == "applying"
    resp = await client.post("/v1/completions", json={})  # admitted mid-apply
    hold_apply.set()
    await applier
    assert_versions(resp, 3, 4)
    assert gate.version == 4


async def test_aborted_apply_leaves_the_version():
    app, gate, client = make()
    gate.set_version(3)
    with pytest.raises(RuntimeError):
        async with gate.applying(4):
            raise RuntimeError("engine failed to apply")
    assert gate.version == 3 and gate.state == "catching_up"  # 4 is known to exist
    await apply(gate, 4, commit=False)
    assert gate.version == 3
    resp = await client.post("/v1/completions", json={}, headers=hdrs(exact=3))
    assert_versions(resp, 3, 3)


async def test_exact_pinned_non_streaming_across_an_apply_gets_409_version_changed():
    app, gate, client = make()
    gate.set_version(3)
    task = asyncio.ensure_future(client.post("/v1/completions", json={"hold": True},
                                             headers=hdrs(exact=3)))
    await app.arrivals.get()
    await apply(gate, 4)
    app.hold.set()
    resp = await task
    assert_not_ready(resp, reason="version_changed", serving=4, wanted=3, latest=4)
    assert "choices" not in resp.json()  # the tokens were discarded
    assert gate.not_ready_count == 1 and gate.in_flight == 0


@pytest.mark.parametrize("spec", [None, "2.3", "2.4"])
async def test_exact_pinned_streaming_across_an_apply_gets_an_error_event(spec):
    app, gate, client = make(spec=spec)
    gate.set_version(3)
    task = asyncio.ensure_future(client.post(
        "/v1/chat/completions", json={"stream": True, "hold": True}, headers=hdrs(exact=3)))
    await app.arrivals.get()
    await apply(gate, 4)
    app.hold.set()
    resp = await task  # the server did not crash: the app's exception was contained
    assert resp.status_code == 200
    evs = events(resp.text)
    assert evs[-1] == "[DONE]"
    err = evs[-2]["error"]
    assert err["type"] == "stitch_version_not_ready" and err["reason"] == "version_changed"
    assert (err["serving"], err["wanted"], err["run"]) == (4, 3, RUN)
    # only what was generated before the apply went out; no "stitch" chunk
    assert [e["choices"][0]["delta"]["content"] for e in evs[:-2]] == ["a"]
    assert not any(isinstance(e, dict) and "stitch" in e for e in evs)
    # the app was told the client left, as its ASGI spec version says, and stopped generating
    if spec == "2.4":
        assert (app.stopped, app.disconnected) == (1, 0)  # its next send raised OSError
    else:
        assert (app.stopped, app.disconnected) == (0, 1)  # receive() answered http.disconnect
    assert app.finished == 0
    assert gate.in_flight == 0


async def test_exact_pin_on_the_outgoing_version_during_an_apply_is_refused():
    app, gate, client = make()
    gate.set_version(3)
    hold_apply, entered = asyncio.Event(), asyncio.Event()
    applier = asyncio.ensure_future(apply(gate, 4, hold=hold_apply, entered=entered))
    await entered.wait()
    resp = await client.post("/v1/completions", json={}, headers=hdrs(exact=3, wait=2))
    assert_not_ready(resp, reason="applying", serving=3, wanted=3, latest=4)
    # ... while one pinned on the target waits for the commit
    task = asyncio.ensure_future(client.post("/v1/completions", json={},
                                             headers=hdrs(exact=4, wait=2)))
    await asyncio.sleep(0.05)
    assert not task.done()
    hold_apply.set()
    await applier
    assert_versions(await task, 4, 4)


# ----- applies: drain mode -----


async def test_drain_waits_for_pinned_requests_and_refuses_new_ones():
    app, gate, client = make(VersionGate(RUN, mode="drain"))
    gate.set_version(3)
    pinned = asyncio.ensure_future(client.post("/v1/completions", json={"hold": True},
                                               headers=hdrs(exact=3)))
    await app.arrivals.get()
    entered = asyncio.Event()
    applier = asyncio.ensure_future(apply(gate, 4, entered=entered))
    await asyncio.sleep(0.05)
    assert not entered.is_set()  # draining: the pinned request is still in flight
    assert gate.state == "applying" and gate.status()["draining"] is True

    refused = await client.post("/v1/completions", json={}, headers=hdrs(exact=3))
    assert_not_ready(refused, reason="draining", serving=3, wanted=3, latest=4)
    assert refused.headers["retry-after"] == "1"
    unpinned = await client.post("/v1/completions", json={})
    assert_versions(unpinned, 3, 3)  # served normally while draining

    app.hold.set()
    resp = await pinned
    assert resp.status_code == 200
    assert_versions(resp, 3, 3)
    await asyncio.wait_for(applier, 2)
    assert entered.is_set() and gate.version == 4 and gate.state == "serving"


async def test_drain_timeout_bounds_the_wait_then_behaves_like_immediate():
    app, gate, client = make(VersionGate(RUN, mode="drain", drain_timeout=0.2))
    gate.set_version(3)
    pinned = asyncio.ensure_future(client.post("/v1/completions", json={"hold": True},
                                               headers=hdrs(exact=3)))
    await app.arrivals.get()
    t0 = time.monotonic()
    await asyncio.wait_for(apply(gate, 4), 2)
    assert 0.15 < time.monotonic() - t0 < 1.0
    assert gate.version == 4 and gate.drain_timeouts == 1
    app.hold.set()
    assert_not_ready(await pinned, reason="version_changed", serving=4, wanted=3, latest=4)


# ----- status -----


async def test_status_endpoint():
    app, gate, client = make(VersionGate(
        RUN, mode="drain", status_extra=lambda: {"fingerprint_ok": True, "patch_bytes": 42}))
    gate.set_version(3)
    gate.set_latest(5)
    resp = await client.get("/stitch/status")
    assert resp.status_code == 200
    s = resp.json()
    assert {k: s[k] for k in ("run", "version", "latest", "lag", "state", "mode")} == {
        "run": RUN, "version": 3, "latest": 5, "lag": 2, "state": "catching_up", "mode": "drain"}
    assert s["fingerprint_ok"] is True and s["patch_bytes"] == 42
    await apply(gate, 5)
    s = (await client.get("/stitch/status")).json()
    assert (s["version"], s["lag"], s["state"], s["applies"]) == (5, 0, "serving", 1)
    assert s["last_apply_seconds"] is not None


# ----- gate and protocol units -----


async def test_gate_admit_release_accounting_without_http():
    gate = VersionGate(RUN)
    with pytest.raises(NotReadyError) as ei:
        await gate.admit(None, None, 0)
    assert ei.value.reason == "not_ready" and ei.value.retry_after >= 1
    gate.set_version(1)
    t = await gate.admit(1, None, 0)
    assert gate.status()["pinned_in_flight"] == 1
    assert not gate.violated(t)
    await apply(gate, 2)
    assert gate.violated(t)
    assert gate.release(t) == (1, 2) == gate.release(t)  # idempotent
    assert gate.in_flight == 0 and gate.status()["pinned_in_flight"] == 0
    with pytest.raises(ValueError):
        await gate.admit(1, 1, 0)
    with pytest.raises(ValueError):
        VersionGate(RUN, mode="lazy")


async def test_concurrent_waiters_share_one_catch_up():
    calls = []

    async def catch_up(v: int, timeout: float) -> bool:
        calls.append(v)
        await asyncio.sleep(0.05)
        await apply(gate, v)
        return True

    gate = VersionGate(RUN, catch_up=catch_up)
    gate.set_version(1)
    tickets = await asyncio.gather(*(gate.admit(None, 3, 2) for _ in range(5)))
    assert calls == [3]
    assert {gate.release(t) for t in tickets} == {(3, 3)}


def test_parse_request():
    assert protocol.parse_request({"x-stitch-version": " 12 "}) == protocol.VersionRequest(12)
    r = protocol.parse_request([(b"x-stitch-min-version", b"3"), (b"x-stitch-wait", b"0.5")])
    assert (r.exact, r.minimum, r.wait, r.wanted, r.pinned) == (None, 3, 0.5, 3, False)
    assert protocol.parse_request({"X-Stitch-Wait": "1e9"}).wait == protocol.DEFAULT_MAX_WAIT
    assert protocol.parse_request({"X-Stitch-Wait": "50"}, max_wait=10).wait == 10
    assert protocol.parse_request({}) == protocol.VersionRequest()
    with pytest.raises(protocol.BadRequestError):
        protocol.parse_request([(b"x-stitch-version", b"1"), (b"x-stitch-version", b"2")])
    with pytest.raises(protocol.BadRequestError):
        protocol.parse_request({"X-Stitch-Wait": "inf"})


def test_cache_salt_and_client_models():
    assert protocol.cache_salt("r", 3) == "stitch:r:v3"
    assert protocol.cache_salt("r", 3, "mine") == "mine|stitch:r:v3"
    body = protocol.not_ready_body(run="r", serving=2, wanted=5, latest=4, reason="behind")
    err = protocol.parse_not_ready(body)
    assert (err.serving, err.wanted, err.latest, err.run, err.reason) == (2, 5, 4, "r", "behind")
    assert protocol.parse_not_ready({"error": {"type": "other"}}) is None
    assert protocol.parse_stitch({"choices": []}) is None


async def test_metrics_counts_through_the_gate():
    from stitch_core.serve import metrics as metrics_mod

    registry = None
    if metrics_mod.AVAILABLE:  # exercised in the engine venvs, which have prometheus_client
        import prometheus_client

        registry = prometheus_client.CollectorRegistry()
    m = Metrics(registry)
    Metrics(registry)  # a second one on the same registry reuses the collectors
    gate = VersionGate(RUN, metrics=m)
    assert m.run == RUN
    gate.set_version(1)
    gate.set_latest(3)
    await apply(gate, 2)
    with pytest.raises(NotReadyError):
        await gate.admit(5, None, 0)
    if metrics_mod.AVAILABLE:
        def value(name):
            return registry.get_sample_value(name, {"run": RUN})

        assert (value("stitch_version"), value("stitch_lag_versions")) == (2.0, 1.0)
        assert value("stitch_apply_seconds_count") == 1.0
        assert value("stitch_patch_bytes_total") == 1234.0
        assert value("stitch_not_ready_total") == 1.0
    else:
        assert m.enabled is False and Metrics(enabled=True).enabled is False
    assert gate.not_ready_count == 1
