"""`stitch gateway` against a real nats-server and real engines over HTTP: small ASGI apps behind
the real StitchASGI middleware and VersionGate, served by uvicorn, publishing real Heartbeats.
The gateway itself runs under uvicorn too; every request goes through sockets."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import httpx
import pytest
import uvicorn

from stitch_core.serve import protocol
from stitch_core.serve.asgi import StitchASGI
from stitch_core.serve.gate import VersionGate
from stitch_core.serve.gateway import Gateway
from stitch_core.serve.routing import GatewayStatus
from stitch_core.versions.announce import gateways, publish_heartbeat
from stitch_core.versions.follower import Follower
from stitch_core.versions.manifest import Heartbeat
from stitch_core.versions.memory_replica import MemoryReplica
from stitch_core.versions.nats_conn import connect
from stitch_core.versions.streams import ensure_streams
from stitch_dev.ports import free_port

from .test_follow_nats import Trainer
from .test_protocol import FakeOpenAI, events, hdrs


async def _serve(app) -> tuple[uvicorn.Server, asyncio.Task, str]:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="on",
                                           log_level="warning"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.01)
    return server, task, f"http://127.0.0.1:{port}"


async def _shutdown(server: uvicorn.Server, task: asyncio.Task) -> None:
    server.should_exit = True
    done, _ = await asyncio.wait({task}, timeout=10)
    if not done:  # connections still open after 10 s (a slow machine): close them now
        server.force_exit = True
    await asyncio.wait_for(task, 20)


class Engine:
    """A fake engine over HTTP: FakeOpenAI behind StitchASGI + VersionGate, beating on NATS."""

    def __init__(self, run: str, eid: str, version: int | None, region: str | None = None):
        self.run, self.id, self.region = run, eid, region
        self.app = FakeOpenAI()
        self.gate = VersionGate(run)
        if version is not None:
            self.gate.set_version(version)
        self.claim: int | None = None  # a version to claim in heartbeats instead of the gate's

    async def start(self, nats_url: str) -> Engine:
        self.server, self.task, self.url = await _serve(StitchASGI(self.app, self.gate))
        self.nc = await connect(nats_url)
        self.js = self.nc.jetstream()
        await ensure_streams(self.js, self.run)  # as a follower does before its heartbeats
        return self

    async def beat(self, load: int | None = None) -> None:
        v = self.claim if self.claim is not None else self.gate.version
        await publish_heartbeat(self.js, Heartbeat(
            id=self.id, run=self.run, url=self.url, version=v, latest=self.gate.latest,
            state=protocol.engine_state(False, v, self.gate.latest), region=self.region,
            load=self.gate.in_flight if load is None else load, time=time.time()))

    async def stop(self) -> None:
        if self.server is not None:
            await self.nc.close()
            await _shutdown(self.server, self.task)
            self.server = None


@pytest.fixture
async def fleet_of(nats_server, request):
    """fleet_of(engines, **gateway options) -> (gateway, its HTTP client); all stopped after."""
    run = f"gw{abs(hash(request.node.name)) % 10**8}"
    made: list = []

    async def make(specs: list[tuple], **kw) -> tuple[Gateway, httpx.AsyncClient, list[Engine]]:
        engines = [await Engine(run, *s).start(nats_server.url) for s in specs]
        made.extend(("engine", e) for e in engines)
        for e in engines:
            await e.beat()
        gw = Gateway(run, nats_server.url, heartbeat_interval=0.2, **kw)
        server, task, url = await _serve(gw)
        client = httpx.AsyncClient(base_url=url, timeout=30)
        made.append(("gateway", (server, task, client)))
        gw.base_url = url
        return gw, client, engines

    make.run = run
    yield make
    for kind, x in reversed(made):
        if kind == "engine":
            await x.stop()
        else:
            await x[2].aclose()
            await _shutdown(x[0], x[1])


def body(**kw) -> dict:
    return {"model": "fake", "prompt": "hi", **kw}


async def until(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


async def test_routes_by_version_headers_and_keeps_the_stamps(fleet_of):
    gw, client, (a, b) = await fleet_of([("eng-a", 1), ("eng-b", 2)])
    r = await client.post("/v1/completions", json=body(), headers=hdrs(minimum=2))
    assert r.status_code == 200, r.text
    assert r.headers["x-stitch-engine"] == "eng-b"
    assert r.headers["x-stitch-version-start"] == r.headers["x-stitch-version-end"] == "2"
    assert r.headers["x-stitch-run"] == fleet_of.run
    assert r.json()["stitch"] == {"run": fleet_of.run, "version_start": 2, "version_end": 2}
    assert r.json()["echo"]["cache_salt"] == f"stitch:{fleet_of.run}:v2"  # the engine salted it
    r = await client.post("/v1/completions", json=body(), headers=hdrs(exact=1))
    assert r.status_code == 200 and r.headers["x-stitch-engine"] == "eng-a"
    assert r.json()["stitch"]["version_start"] == 1
    # unpinned: any engine; newest first when equally loaded
    r = await client.post("/v1/completions", json=body())
    assert r.status_code == 200 and r.headers["x-stitch-engine"] == "eng-b"
    # malformed headers: 400 from the gateway itself, as an engine would answer
    r = await client.post("/v1/completions", json=body(), headers={"X-Stitch-Version": "x"})
    assert r.status_code == 400 and r.json()["error"]["type"] == protocol.BAD_REQUEST_TYPE
    # other paths go through as they are
    r = await client.get("/v1/models")
    assert r.status_code == 200 and r.json()["data"] == [{"id": "fake"}]


async def test_least_loaded_first_own_in_flight_and_heartbeat_load(fleet_of):
    gw, client, (a, b) = await fleet_of([("eng-a", 1), ("eng-b", 1)])
    # a request held in flight through the gateway on one engine: the next goes to the other
    held = asyncio.create_task(client.post("/v1/completions", json=body(hold=True)))
    await until(lambda: a.gate.in_flight + b.gate.in_flight == 1)
    busy, idle = (a, b) if a.gate.in_flight else (b, a)
    for _ in range(3):
        r = await client.post("/v1/completions", json=body())
        assert r.headers["x-stitch-engine"] == idle.id
    busy.app.hold.set()
    assert (await held).headers["x-stitch-engine"] == busy.id
    busy.app.hold.clear()
    # load the gateway does not see: requests sent to eng-a directly, told by its heartbeat
    direct = httpx.AsyncClient(base_url=a.url, timeout=30)
    try:
        side = [asyncio.create_task(direct.post("/v1/completions", json=body(hold=True)))
                for _ in range(2)]
        await until(lambda: a.gate.in_flight == 2)
        await a.beat()  # load=2, from its gate
        await until(lambda: gw.table.engines["eng-a"].hb.load == 2)
        for _ in range(3):
            r = await client.post("/v1/completions", json=body())
            assert r.headers["x-stitch-engine"] == "eng-b"
        a.app.hold.set()
        await asyncio.gather(*side)
    finally:
        await direct.aclose()
    await a.beat()
    await until(lambda: gw.table.engines["eng-a"].hb.load == 0)
    rows = {r.id: r for r in gw.status().engines}
    assert rows["eng-a"].load == 0 and rows["eng-a"].in_flight == 0


async def test_same_region_first(fleet_of):
    gw, client, (a, b) = await fleet_of([("eng-a", 1, "eu"), ("eng-b", 1, "us")], region="us")
    for _ in range(4):
        r = await client.post("/v1/completions", json=body())
        assert r.headers["x-stitch-engine"] == "eng-b"
    # even when busier than the other region's engine
    await b.beat(load=5)
    await until(lambda: gw.table.engines["eng-b"].hb.load == 5)
    r = await client.post("/v1/completions", json=body())
    assert r.headers["x-stitch-engine"] == "eng-b"
    # but only if it can serve the version: eng-a then, whatever its region
    a.gate.set_version(2)
    await a.beat()
    await until(lambda: gw.table.engines["eng-a"].hb.version == 2)
    r = await client.post("/v1/completions", json=body(), headers=hdrs(minimum=2))
    assert r.headers["x-stitch-engine"] == "eng-a"


async def test_a_409_is_retried_at_another_engine(fleet_of):
    gw, client, (a, b) = await fleet_of([("eng-a", 1, "us"), ("eng-b", 2, "eu")], region="us")
    a.claim = 2  # its heartbeat says v2 (as a stale one may), its gate serves v1
    await a.beat()
    await until(lambda: gw.table.engines["eng-a"].hb.version == 2)
    r = await client.post("/v1/completions", json=body(), headers=hdrs(minimum=2))
    assert r.status_code == 200, r.text
    assert r.headers["x-stitch-engine"] == "eng-b" and r.json()["stitch"]["version_start"] == 2
    assert len(a.app.received) == 0 and len(b.app.received) == 1
    st = gw.status()
    assert st.retries_total == 1
    assert {r.id: r.refused_total for r in st.engines} == {"eng-a": 1, "eng-b": 0}
    # no other engine: the engine's own 409 comes back as it said it
    await b.stop()
    gw.table.engines.pop("eng-b")
    r = await client.post("/v1/completions", json=body(), headers=hdrs(minimum=2))
    assert r.status_code == 409 and r.headers["x-stitch-engine"] == "eng-a"
    err = protocol.parse_not_ready(r.json())
    assert err is not None and err.reason == "behind" and err.serving == 1
    assert r.headers["retry-after"]


async def test_wait_for_a_heartbeat_then_serve_or_time_out(fleet_of):
    gw, client, (a,) = await fleet_of([("eng-a", 1)])
    t0 = time.monotonic()
    waiting = asyncio.create_task(client.post("/v1/completions", json=body(),
                                              headers=hdrs(minimum=2, wait=20)))
    await asyncio.sleep(0.5)
    assert not waiting.done()
    a.gate.set_version(2)
    await a.beat()
    r = await waiting
    assert r.status_code == 200, r.text
    assert r.json()["stitch"]["version_start"] == 2 and time.monotonic() - t0 < 10
    assert gw.status().waited_total == 1
    # nothing reaches v3 within the wait: the gateway's own 409, in the engines' shape
    t0 = time.monotonic()
    r = await client.post("/v1/completions", json=body(), headers=hdrs(minimum=3, wait=1))
    took = time.monotonic() - t0
    assert r.status_code == 409 and 0.9 < took < 5, (r.text, took)
    err = protocol.parse_not_ready(r.json())
    assert err is not None and err.reason == "behind" and err.wanted == 3 and err.serving == 2
    assert r.headers["retry-after"] == "1" and r.headers["x-stitch-run"] == fleet_of.run
    assert "x-stitch-engine" not in r.headers and len(a.app.received) == 1
    # an exact version every engine has passed: refused at once, whatever the wait
    t0 = time.monotonic()
    r = await client.post("/v1/completions", json=body(), headers=hdrs(exact=1, wait=5))
    assert r.status_code == 409 and time.monotonic() - t0 < 1
    assert protocol.parse_not_ready(r.json()).reason == "passed"
    assert gw.status().refused_total == 2


async def test_no_engine_is_503_and_a_late_engine_is_waited_for(fleet_of, nats_server):
    gw, client, _ = await fleet_of([])
    r = await client.post("/v1/completions", json=body())
    assert r.status_code == 503
    assert protocol.parse_not_ready(r.json()).reason == "not_ready"
    assert (await client.get("/health")).status_code == 503
    waiting = asyncio.create_task(client.post("/v1/completions", json=body(),
                                              headers=hdrs(wait=20)))
    await asyncio.sleep(0.3)
    e = await Engine(fleet_of.run, "eng-late", 4).start(nats_server.url)
    try:
        await e.beat()
        r = await waiting
        assert r.status_code == 200 and r.headers["x-stitch-engine"] == "eng-late"
        assert (await client.get("/health")).json() == {"engines": 1}
    finally:
        await e.stop()


async def test_sse_streams_through_chunk_by_chunk(fleet_of):
    gw, client, (a,) = await fleet_of([("eng-a", 3)])
    async with client.stream("POST", "/v1/chat/completions", json=body(stream=True, hold=True),
                             headers=hdrs(exact=3)) as r:
        assert r.status_code == 200
        assert r.headers["x-stitch-engine"] == "eng-a"
        assert r.headers["x-stitch-version-start"] == "3"
        assert r.headers["content-type"].startswith("text/event-stream")
        chunks = r.aiter_raw()
        first = await asyncio.wait_for(chunks.__anext__(), 10)
        # the engine is still holding the rest: the first chunk came through on its own
        assert b'"a"' in first and not a.app.hold.is_set()
        assert gw.status().in_flight == 1
        a.app.hold.set()
        rest = b"".join([c async for c in chunks])
    evs = events((first + rest).decode())
    assert [e["choices"][0]["delta"]["content"] for e in evs[:3]] == ["a", "b", "c"]
    assert evs[3]["stitch"] == {"run": fleet_of.run, "version_start": 3, "version_end": 3}
    assert evs[-1] == "[DONE]"


async def test_stale_and_dead_engines_are_dropped(fleet_of):
    gw, client, (a, b) = await fleet_of([("eng-a", 1), ("eng-b", 1)], ttl=1.0)
    await until(lambda: len(gw.table.live()) == 2)
    # eng-b reports a dead follower: dropped at once
    await publish_heartbeat(b.js, Heartbeat(
        id="eng-b", run=fleet_of.run, url=b.url, version=1, state="serving", health="dead",
        time=time.time()))
    await until(lambda: len(gw.table.live()) == 1)
    for _ in range(3):
        assert (await client.post("/v1/completions", json=body())).headers[
            "x-stitch-engine"] == "eng-a"
    # eng-a stops beating: gone after the TTL
    await asyncio.sleep(1.3)
    r = await client.post("/v1/completions", json=body())
    assert r.status_code == 503, r.text
    assert not any(row.routable for row in gw.status().engines)
    await a.beat()  # back
    await until(lambda: len(gw.table.live()) == 1)
    assert (await client.post("/v1/completions", json=body())).status_code == 200


async def test_status_metrics_and_stitch_status(fleet_of, nats_server):
    gw, client, (a, b) = await fleet_of([("eng-a", 1, "eu"), ("eng-b", 2, "us")],
                                        region="eu", gateway_id="gw-1")
    for h in (hdrs(exact=1), hdrs(exact=2), hdrs(minimum=2)):
        assert (await client.post("/v1/completions", json=body(), headers=h)).status_code == 200
    st = GatewayStatus.model_validate((await client.get("/stitch/gateway")).json())
    assert st.id == "gw-1" and st.region == "eu" and st.routable == 2 and st.versions == [1, 2]
    assert st.requests_total == 3 and st.nats_connected
    rows = {r.id: r for r in st.engines}
    assert rows["eng-a"].requests_total == 1 and rows["eng-b"].requests_total == 2
    assert rows["eng-a"].url == a.url and rows["eng-b"].region == "us"
    m = await client.get("/metrics")
    assert m.status_code == 200 and m.headers["content-type"].startswith("text/plain")
    lines = m.text.splitlines()
    run = fleet_of.run
    assert f'stitch_gateway_engines{{run="{run}"}} 2' in lines
    assert f'stitch_gateway_engine_version{{run="{run}",engine="eng-b"}} 2' in lines
    assert f'stitch_gateway_engine_requests_total{{run="{run}",engine="eng-b"}} 2' in lines
    assert "# TYPE stitch_gateway_requests_total counter" in lines
    # its heartbeat: on NATS and in `stitch status`
    js = a.js

    async def beat() -> list:
        return [g for g in await gateways(js, run) if g.requests_total == 3]

    deadline = time.monotonic() + 10
    while not (found := await beat()):
        assert time.monotonic() < deadline
        await asyncio.sleep(0.1)
    assert found[0].id == "gw-1" and found[0].engines == 2 and found[0].versions == [1, 2]
    out = await asyncio.to_thread(subprocess.run, [
        sys.executable, "-m", "stitch_core.cli", "status", "--nats", nats_server.url, "--run",
        run, "--json"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert [e["id"] for e in doc["engines"]] == ["eng-a", "eng-b"]
    assert doc["engines"][0]["load"] == 0
    assert [g["id"] for g in doc["gateways"]] == ["gw-1"]


    async def beating() -> None:  # as followers do: the CLI's start-up may outlast the TTL
        while True:
            for e in (a, b):
                await e.beat()
            await asyncio.sleep(0.3)

    beats = asyncio.create_task(beating())
    try:
        await asyncio.sleep(0.5)  # a gateway heartbeat or two
        out = await asyncio.to_thread(subprocess.run, [
            sys.executable, "-m", "stitch_core.cli", "status", "--nats", nats_server.url, "--run",
            run], capture_output=True, text=True)
    finally:
        beats.cancel()
    assert out.returncode == 0 and "gw-1" in out.stdout and "1,2" in out.stdout, out.stdout


async def test_follower_heartbeats_carry_the_load(nats_server, tmp_path):
    run = "gwload"
    t = Trainer(str(tmp_path / "board"), run, nats_server.url)
    try:
        await asyncio.to_thread(t.step)
        load = {"n": 3}
        f = Follower(str(tmp_path / "board"), run, MemoryReplica(), nats=nats_server.url,
                     cache_dir=tmp_path / "c", heartbeat_interval=0.1, engine_id="eng-l",
                     load=lambda: load["n"])
        gw = Gateway(run, nats_server.url)
        await f.start()
        await gw.start()
        try:
            assert await f.wait_for(0, 20)
            await until(lambda: "eng-l" in gw.table.engines
                        and gw.table.engines["eng-l"].hb.load == 3)
            load["n"] = 0
            await until(lambda: gw.table.engines["eng-l"].hb.load == 0)
            assert gw.table.engines["eng-l"].hb.version == 0
        finally:
            await gw.stop()
            await f.stop()
    finally:
        t.pub.close()
