"""`stitch gateway` under attack: each finding of the adversarial review, tried for real.

Real nats-servers (the session one, and one with the least-privilege users of
docs/nats-security.md where the attack is about publish rights), the gateway under uvicorn, and
engines that are real HTTP servers: the fake engine of tests/test_gateway.py, or bare ASGI apps
(`Upstream`) that answer as a hostile or broken engine would, or play an internal service the
gateway must never reach. Raw sockets where httpx would normalise what the attack sends.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from argparse import Namespace

import httpx
import pytest

from stitch_core.serve import protocol
from stitch_core.serve.admission import UrlAllowList
from stitch_core.serve.gateway import Gateway
from stitch_core.versions.announce import publish_heartbeat
from stitch_core.versions.manifest import Heartbeat
from stitch_core.versions.nats_conn import connect
from stitch_core.versions.natsserver import NatsServer
from stitch_core.versions.streams import engines_stream, ensure_streams

from .test_gateway import Engine, _serve, _shutdown, body, fleet_of, until
from .test_nats_security import follower_rights
from .test_protocol import hdrs

FIXTURES = (fleet_of,)  # tests/test_gateway.py's fleet, imported for pytest to find

# ------------------------------------------------------------------ parts


class Upstream:
    """A bare HTTP app as an engine (or an internal service): `handler(self, scope, receive,
    send)` answers; every request is recorded (`hits`: method, raw target, headers) and every
    client disconnect it saw counted (`disconnects`)."""

    def __init__(self, handler) -> None:
        self.handler = handler
        self.hits: list[tuple[str, bytes, dict[bytes, bytes]]] = []
        self.disconnects = 0
        self.release = asyncio.Event()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        while (await receive()).get("more_body"):
            pass
        self.hits.append((scope["method"], scope["raw_path"], dict(scope["headers"])))
        await self.handler(self, scope, receive, send)

    async def start(self) -> Upstream:
        self.server, self.task, self.url = await _serve(self)
        return self

    async def stop(self) -> None:
        self.release.set()
        await _shutdown(self.server, self.task)


async def never_answer(self: Upstream, scope, receive, send) -> None:
    """Accept the request and never send a response head; note when the client goes."""
    while (await receive())["type"] != "http.disconnect":
        pass
    self.disconnects += 1


def answer(status: int, payload: bytes, headers=()):
    async def handler(self: Upstream, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), *headers]})
        await send({"type": "http.response.body", "body": payload})
    return handler


@contextlib.asynccontextmanager
async def upstreams(*handlers):
    ups = [await Upstream(h).start() for h in handlers]
    try:
        yield ups
    finally:
        for u in ups:
            await u.stop()


async def beat(nc, run: str, eid: str, url: str | None, version: int | None = 1,
               **kw) -> None:
    """A heartbeat on `eid`'s own subject, plain NATS (fire-and-forget, then flushed)."""
    await publish_heartbeat(nc, Heartbeat(id=eid, run=run, url=url, version=version,
                                          state="serving", time=time.time(), **kw))
    await nc.flush()


async def raw_http(url: str, request: bytes, *, read: bool = True) -> bytes:
    """`request` as it is, on a fresh connection to the gateway at `url`; the answer's bytes."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(request)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), 20) if read else b""
    finally:
        writer.close()


@contextlib.asynccontextmanager
async def gateway(nats_url: str, run: str, **kw):
    gw = Gateway(run, nats_url, heartbeat_interval=0.2, **kw)
    server, task, url = await _serve(gw)
    try:
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            yield gw, client
    finally:
        await _shutdown(server, task)


# ------------------------------------------------------------------ heartbeat identity

RUN = "atk"


@pytest.fixture
def locked_nats(tmp_path):
    """A nats-server whose `eng-a` user has the documented follower rights (publish on
    stitch.atk.engines.eng-a only) and whose `admin` may do anything; yields (admin URL,
    eng-a URL)."""
    users = [{"user": "admin", "password": "admin-pw"},
             {"user": "eng-a", "password": "eng-a-pw",
              "permissions": follower_rights(RUN, "stitch", "eng-a")}]
    conf = tmp_path / "nats.conf"
    conf.write_text("accounts {\n  STITCH {\n    jetstream: enabled\n"
                    f"    users: {json.dumps(users)}\n  }}\n}}\n")
    with NatsServer(tmp_path / "store", port=0, config=conf) as server:
        at = server.url.removeprefix("nats://")
        yield f"nats://admin:admin-pw@{at}", f"nats://eng-a:eng-a-pw@{at}"


async def spoof(eng_a_url: str, attacker: str) -> None:
    """What eng-a's user may publish, on its one subject: a heartbeat claiming to be eng-b
    (newer than anything eng-b will ever send), and one as itself from far in the future."""
    nc = await connect(eng_a_url)
    try:
        js = nc.jetstream()
        for eid in ("eng-a", "eng-b"):  # the last one stays in the stream
            hb = Heartbeat(id=eid, run=RUN, url=attacker, version=9, state="serving",
                           time=time.time() + 1e6)
            await js.publish(f"stitch.{RUN}.engines.eng-a", hb.model_dump_json().encode(),
                             stream=engines_stream(RUN))
    finally:
        await nc.close()


@contextlib.asynccontextmanager
async def victim(admin_url: str):
    """eng-b (a real engine at v1, beating as the admin) and the attacker's HTTP server."""
    nc = await connect(admin_url)
    await ensure_streams(nc.jetstream(), RUN)
    await nc.close()
    eng_b = await Engine(RUN, "eng-b", 1).start(admin_url)
    await eng_b.beat()
    try:
        async with upstreams(answer(200, b'{"stolen": true}')) as (attacker,):
            yield eng_b, attacker
    finally:
        await eng_b.stop()


async def all_to_eng_b(client: httpx.AsyncClient, attacker: Upstream, eng_b: Engine) -> None:
    for _ in range(3):
        r = await client.post("/v1/completions", json=body(),
                              headers={"Authorization": "Bearer engine-key"})
        assert r.status_code == 200 and r.headers["x-stitch-engine"] == "eng-b", r.text
    assert attacker.hits == [] and len(eng_b.app.received) >= 3


async def test_spoofed_id_from_another_engines_subject_is_refused(locked_nats):
    admin_url, eng_a_url = locked_nats
    async with victim(admin_url) as (eng_b, attacker), gateway(admin_url, RUN) as (gw, client):
        await until(lambda: "eng-b" in gw.table.engines)
        await spoof(eng_a_url, attacker.url)
        await until(lambda: gw.rejected >= 2)  # eng-b's id on eng-a's subject; eng-a's clock
        assert set(gw.table.engines) == {"eng-b"}
        assert gw.table.engines["eng-b"].hb.url == eng_b.url
        await all_to_eng_b(client, attacker, eng_b)
        # eng-b's own heartbeats still count (nothing "newer" was believed)
        eng_b.gate.set_version(2)
        await eng_b.beat()
        await until(lambda: gw.table.engines["eng-b"].hb.version == 2)
        r = await client.post("/v1/completions", json=body(), headers=hdrs(exact=2))
        assert r.status_code == 200 and r.headers["x-stitch-engine"] == "eng-b"
        assert attacker.hits == []


async def test_a_restarted_gateway_refuses_the_stored_spoof(locked_nats, caplog):
    admin_url, eng_a_url = locked_nats
    async with victim(admin_url) as (eng_b, attacker):
        await spoof(eng_a_url, attacker.url)  # kept by JetStream (last one of the subject)
        for _ in range(2):  # a gateway (re)started after the attack reads it back
            caplog.clear()
            with caplog.at_level(logging.WARNING):
                async with gateway(admin_url, RUN) as (gw, client):
                    assert set(gw.table.engines) == {"eng-b"}
                    assert gw.table.engines["eng-b"].hb.url == eng_b.url
                    await all_to_eng_b(client, attacker, eng_b)
            assert "speaks only for its own subject" in caplog.text


def test_stitch_status_shows_only_heartbeats_on_their_own_subject(locked_nats, capsys):
    from stitch_core.cli.versions import cmd_status

    admin_url, eng_a_url = locked_nats

    async def setup() -> None:
        nc = await connect(admin_url)
        try:
            await ensure_streams(nc.jetstream(), RUN)
            await publish_heartbeat(nc.jetstream(), Heartbeat(
                id="eng-b", run=RUN, url="http://eng-b:8000", version=1, state="serving",
                time=time.time()))
        finally:
            await nc.close()
        await spoof(eng_a_url, "http://attacker:1")

    asyncio.run(setup())
    assert cmd_status(Namespace(nats=admin_url, run=RUN, json=True)) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [(e["id"], e["url"]) for e in doc["engines"]] == [("eng-b", "http://eng-b:8000")]
    assert 0 <= doc["engines"][0]["last_seen_seconds"] < 60  # the server's time, not the claim


async def test_heartbeat_floods_keep_the_table_bounded(fleet_of, nc):
    gw, client, _ = await fleet_of([], max_engines=8)
    run = fleet_of.run
    # one subject, 5000 ids: each speaks for another subject, all refused
    for i in range(5000):
        await nc.publish(f"stitch.{run}.engines.flood", Heartbeat(
            id=f"x{i}", run=run, url="http://127.0.0.1:1", version=1, state="serving",
            time=time.time()).model_dump_json().encode())
    await nc.flush()
    await until(lambda: gw.rejected >= 5000, 30)
    assert gw.table.engines == {}
    # distinct subjects (as a user with stitch.<run>.engines.* could): the cap holds
    for i in range(20):
        await beat(nc, run, f"eng-{i:02d}", "http://127.0.0.1:1")
    await until(lambda: "eng-19" in gw.table.engines)
    st = (await client.get("/stitch/gateway")).json()
    assert len(st["engines"]) == 8 and st["max_engines"] == 8
    assert {f"eng-{i}" for i in range(12, 20)} <= {e["id"] for e in st["engines"]}
    assert st["engines_evicted_total"] >= 12 and st["heartbeats_rejected_total"] >= 5000
    assert len((await client.get("/metrics")).content) < 20_000


# ------------------------------------------------------------------ heartbeat URLs

async def test_malformed_and_unsafe_engine_urls_are_rejected_at_admission(fleet_of, nc):
    gw, client, _ = await fleet_of([])
    run = fleet_of.run
    bad = ["http://[::1", "http://u:p@127.0.0.1:1", "ftp://127.0.0.1:1", "http://h:1/?x=1",
           "http://h:1/#f", "http:///x", "http://h:99999"]
    for i, url in enumerate(bad):
        await beat(nc, run, f"bad-{i}", url)
    await until(lambda: gw.rejected >= len(bad))
    assert gw.table.engines == {}
    r = await client.post("/v1/completions", json=body())
    assert r.status_code == 503 and protocol.parse_not_ready(r.json()).reason == "not_ready"
    assert gw.status().in_flight == 0


async def test_engine_url_allow_list(nats_server, nc):
    run = "gwallow"
    allow = UrlAllowList.parse(["10.0.0.0/8", "*.engines.internal,127.0.0.1"])
    assert allow.allows("10.1.2.3") and allow.allows("a.engines.internal")
    assert not allow.allows("engines.internal") and not allow.allows("127.0.0.2")
    eng = await Engine(run, "eng-a", 1).start(nats_server.url)
    try:
        async with gateway(nats_server.url, run, engine_url_allow=["10.0.0.0/8"]) as (gw, c):
            await eng.beat()
            await until(lambda: gw.rejected >= 1)
            assert gw.table.engines == {}
            assert (await c.post("/v1/completions", json=body())).status_code == 503
            assert eng.app.received == []
        async with gateway(nats_server.url, run, engine_url_allow=["10.0.0.0/8,127.0.0.1"]
                           ) as (gw, c):
            await eng.beat()
            await until(lambda: "eng-a" in gw.table.engines)
            assert (await c.post("/v1/completions", json=body())).status_code == 200
    finally:
        await eng.stop()


# ------------------------------------------------------------------ the proxy

async def test_request_targets_not_in_origin_form_are_refused(fleet_of):
    gw, client, (a,) = await fleet_of([("eng-a", 1)])
    async with upstreams(answer(200, b'{"secret": "s3cret"}')) as (secret,):
        at = secret.url.removeprefix("http://")
        for target in (f"@{at}/admin/secrets", f"http://{at}/admin/secrets", at, "*"):
            out = await raw_http(gw.base_url, f"GET {target} HTTP/1.1\r\nHost: gw\r\n"
                                 "Connection: close\r\n\r\n".encode())
            assert out.startswith(b"HTTP/1.1 400"), (target, out[:300])
            assert b"s3cret" not in out
        # a path that looks like a host stays a path, at the engine
        out = await raw_http(gw.base_url, f"GET //{at}/admin/secrets HTTP/1.1\r\nHost: gw\r\n"
                             "Connection: close\r\n\r\n".encode())
        assert b"s3cret" not in out and b"x-stitch-engine: eng-a" in out.lower()
        assert secret.hits == []
    assert gw.status().in_flight == 0


async def test_a_never_answering_engine_times_out_and_the_next_one_answers(fleet_of, nc):
    gw, client, (b,) = await fleet_of([("eng-b", 1)], upstream_timeout=1.0)
    run = fleet_of.run
    async with upstreams(never_answer) as (hole,):
        await beat(nc, run, "eng-a", hole.url)  # tried first: same load and version, id
        await until(lambda: "eng-a" in gw.table.engines)
        t0 = time.monotonic()
        r = await client.post("/v1/completions", json=body())
        assert r.status_code == 200 and r.headers["x-stitch-engine"] == "eng-b", r.text
        assert time.monotonic() - t0 < 10  # the 1 s head timeout, not forever
        assert len(hole.hits) == 1
        await until(lambda: hole.disconnects == 1)  # the gateway closed that connection
        st = gw.status()
        assert st.in_flight == 0 and st.timeouts_total == 1 and st.retries_total == 1
        assert all(row.in_flight == 0 for row in st.engines)
        # the hole alone: a 504 from the gateway
        gw.table.engines.pop("eng-b")
        r = await client.post("/v1/completions", json=body())
        assert r.status_code == 504 and r.json()["error"]["type"] == "stitch_gateway_timeout"
        await until(lambda: hole.disconnects == 2)
        assert gw.status().in_flight == 0


async def test_a_stale_engine_with_requests_in_flight_is_dropped(fleet_of, nc):
    gw, client, _ = await fleet_of([], ttl=0.3, upstream_timeout=0)
    async with upstreams(never_answer) as (hole,):
        async def beating() -> None:
            while True:
                await beat(nc, fleet_of.run, "eng-a", hole.url)
                await asyncio.sleep(0.05)

        beats = asyncio.create_task(beating())
        await until(lambda: "eng-a" in gw.table.engines)
        held = asyncio.create_task(client.post("/v1/completions", json=body()))
        await until(lambda: gw.status().in_flight == 1 and len(hole.hits) == 1)
        beats.cancel()
        await until(lambda: not gw.status().engines[0].routable)  # it stopped beating
        await until(lambda: "eng-a" not in gw.table.engines)  # pruned though in flight
        held.cancel()  # the client gives up: upstream closed, nothing left in flight
        with contextlib.suppress(asyncio.CancelledError):
            await held
        await until(lambda: hole.disconnects == 1 and gw.status().in_flight == 0)


async def test_a_client_that_leaves_while_waiting_never_reaches_an_engine(fleet_of):
    gw, client, (a,) = await fleet_of([("eng-a", 1)])
    payload = json.dumps(body()).encode()
    host, port = gw.base_url.removeprefix("http://").split(":")
    _, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json"
                 b"\r\nX-Stitch-Min-Version: 2\r\nX-Stitch-Wait: 30\r\nContent-Length: "
                 + str(len(payload)).encode() + b"\r\n\r\n" + payload)
    await writer.drain()
    await until(lambda: gw.status().waited_total == 1)
    writer.close()  # the client leaves during the wait
    await until(lambda: gw.status().in_flight == 0)
    a.gate.set_version(2)
    await a.beat()
    await until(lambda: gw.table.engines["eng-a"].hb.version == 2)
    await asyncio.sleep(0.3)
    assert a.app.received == []  # its generation never ran


async def test_a_client_that_leaves_closes_the_upstream_request(fleet_of, nc):
    gw, client, (a,) = await fleet_of([("eng-a", 3)])
    # mid-stream: the engine's stream sees the disconnect
    async with client.stream("POST", "/v1/chat/completions", json=body(stream=True, hold=True),
                             headers=hdrs(exact=3)) as r:
        assert b'"a"' in await asyncio.wait_for(r.aiter_raw().__anext__(), 10)
    # the gateway let go, and closed its connection to the engine, which then goes on
    await until(lambda: gw.status().in_flight == 0 and not a.server.server_state.connections)
    a.app.hold.set()
    await until(lambda: a.app.disconnected + a.app.stopped == 1)  # and stops generating
    # before the response head: the engine's connection is closed too
    gw.table.engines.pop("eng-a")
    async with upstreams(never_answer) as (hole,):
        await beat(nc, fleet_of.run, "eng-h", hole.url)
        await until(lambda: "eng-h" in gw.table.engines)
        held = asyncio.create_task(client.post("/v1/completions", json=body()))
        await until(lambda: len(hole.hits) == 1)
        held.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await held
        await until(lambda: hole.disconnects == 1 and gw.status().in_flight == 0)


def _refusal(**fields) -> bytes:
    return json.dumps({"error": {"type": protocol.NOT_READY_TYPE, **fields}}).encode()


async def test_a_large_409_is_streamed_not_buffered_as_a_refusal(fleet_of, nc):
    gw, client, (b,) = await fleet_of([("eng-b", 1)])
    big = _refusal(message="x" * (2 << 20), serving=1, wanted=1, latest=1, run=fleet_of.run)

    async def huge_409(self: Upstream, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 409,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": big[:1 << 20], "more_body": True})
        await self.release.wait()  # the rest only once the client has the first MiB
        await send({"type": "http.response.body", "body": big[1 << 20:]})

    async with upstreams(huge_409) as (eng_a,):
        await beat(nc, fleet_of.run, "eng-a", eng_a.url)
        await until(lambda: "eng-a" in gw.table.engines)
        async with client.stream("POST", "/v1/completions", json=body()) as r:
            assert r.status_code == 409 and r.headers["x-stitch-engine"] == "eng-a"
            got = b""
            async for chunk in r.aiter_raw():
                got += chunk
                if len(got) >= 1 << 20:
                    eng_a.release.set()  # it came through before the engine sent the rest
            assert got == big
    assert b.app.received == [] and gw.status().in_flight == 0


async def test_a_malformed_409_skips_that_engine(fleet_of, nc):
    gw, client, (b,) = await fleet_of([("eng-b", 1)])
    async with upstreams(answer(409, _refusal(message="no fields"))) as (eng_a,):
        await beat(nc, fleet_of.run, "eng-a", eng_a.url)
        await until(lambda: "eng-a" in gw.table.engines)
        r = await client.post("/v1/completions", json=body())
        assert r.status_code == 200 and r.headers["x-stitch-engine"] == "eng-b", r.text
        assert len(eng_a.hits) == 1
        st = gw.status()
        assert st.in_flight == 0 and {e.id: e.errors_total for e in st.engines}["eng-a"] == 1


async def test_hop_by_hop_headers_are_dropped_both_ways(fleet_of, nc):
    gw, client, _ = await fleet_of([])
    hdr = [(b"connection", b"X-Private, keep-alive"), (b"x-private", b"upstream-only"),
           (b"keep-alive", b"timeout=5"), (b"x-kept", b"1")]
    async with upstreams(answer(200, b"{}", hdr)) as (eng,):
        await beat(nc, fleet_of.run, "eng-a", eng.url)
        await until(lambda: "eng-a" in gw.table.engines)
        out = await raw_http(gw.base_url, b"GET /v1/models HTTP/1.1\r\nHost: gw\r\n"
                             b"Connection: close, X-Secret\r\nX-Secret: s3cret\r\n"
                             b"Proxy-Authorization: Basic eA==\r\nTE: trailers\r\n"
                             b"Upgrade: h2c\r\nX-Ok: yes\r\n\r\n")
        sent = eng.hits[0][2]
        assert b"x-secret" not in sent and b"proxy-authorization" not in sent
        assert b"te" not in sent and b"upgrade" not in sent and sent[b"x-ok"] == b"yes"
        head = out.split(b"\r\n\r\n")[0].lower()
        assert head.startswith(b"http/1.1 200") and b"x-kept: 1" in head
        assert b"x-private" not in head and b"keep-alive: timeout" not in head


async def test_status_and_metrics_behind_an_api_key(fleet_of):
    gw, client, (a,) = await fleet_of([("eng-a", 1)], api_key="gw-k3y")
    for path in ("/stitch/gateway", "/metrics"):
        assert (await client.get(path)).status_code == 401
        r = await client.get(path, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer")
        assert (await client.get(path, headers={"Authorization": "Bearer gw-k3y"})
                ).status_code == 200
    r = await client.get("/stitch/gateway", headers={"Authorization": "Bearer gw-k3y"})
    assert r.json()["api_key_required"] is True
    assert (await client.get("/health")).status_code == 200
    # the engines' own routes are not the gateway's to lock
    r = await client.post("/v1/completions", json=body(),
                          headers={"Authorization": "Bearer engine-key"})
    assert r.status_code == 200 and r.headers["x-stitch-engine"] == "eng-a"
