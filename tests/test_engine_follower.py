"""stitch_core.node (the server-side follower every engine plugin uses) on the toy TP engine.

A trainer publishes to a board; a `FollowerMiddleware` around a small OpenAI-like ASGI app starts an
`EngineFollower` whose RPC reaches two in-process `RankReplica`s; requests go through the real
middleware. vLLM runs the same classes (tests/vllm); here nothing but the engine is simulated.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import torch

from stitch_core.engine import rpc
from stitch_core.engine.replica import RankReplica
from stitch_core.node import EngineFollower, FollowerMiddleware, Settings, current
from stitch_core.versions.board import LocalBoard
from stitch_core.versions.materialize import pull
from stitch_dev.toy_engine import HFToy, ToyEngine, train
from stitch_trainer.publisher import Publisher

RUN = "toyserve"


class ToyFollower(EngineFollower):
    engine_name = "toy"

    def __init__(self, settings, model_dir, replicas):
        super().__init__(settings, model_dir)
        self.replicas = replicas
        self.calls: list[str] = []

    async def rpc(self, req):
        self.calls.append(type(req).__name__.lower())
        req = rpc.decode(rpc.encode(req))  # as through the engine's RPC
        return [rpc.decode(rpc.encode(r.handle(req))) for r in self.replicas]

    async def pause(self):
        self.calls.append("pause")

    async def resume(self):
        self.calls.append("resume")

    async def after_apply(self, version):
        self.calls.append(f"after_apply:{version}")


async def completions(scope, receive, send):
    """A minimal OpenAI-like app: echoes the request body's cache_salt."""
    body = b""
    while True:
        msg = await receive()
        body += msg.get("body", b"")
        if not msg.get("more_body"):
            break
    out = json.dumps({"object": "text_completion", "choices": [{"text": "hi"}],
                      "salt": json.loads(body).get("cache_salt")}).encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": out})


async def test_engine_follower_serves_versions_through_the_middleware(tmp_path):
    torch.manual_seed(0)
    model = HFToy()
    board = tmp_path / "board"
    pub = Publisher(str(board), RUN, "bf16")
    pub.publish(0, model).result()
    await pull(LocalBoard(board), RUN, 0, tmp_path / "v0", tmp_path / "cache", quiet=True)
    views = {}
    for v, m in enumerate(train(model, 3), start=1):
        pub.publish(v, m).result()
        views[v] = {k: t.detach().to(torch.bfloat16) for k, t in m.state_dict().items()}
    pub.close()

    engines = [ToyEngine(r, 2) for r in range(2)]
    from safetensors.torch import load_file

    for e in engines:
        e.load_weights(iter(load_file(tmp_path / "v0" / "model.safetensors").items()))
    settings = Settings.from_env({"STITCH_BOARD": str(board), "STITCH_RECONCILE_INTERVAL": "0.2",
                                  "STITCH_CACHE_DIR": str(tmp_path / "ecache"),
                                  "STITCH_LOADER_FALLBACK": "1"})  # the toy's scaled tensor
    follower = ToyFollower(settings, tmp_path / "v0", [RankReplica(e) for e in engines])

    class Middleware(FollowerMiddleware):
        def make_follower(self, app):
            return follower

    mw = Middleware(completions)
    await mw.startup(None)
    assert current() is follower
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=mw),
                                     base_url="http://t") as c:
            r = await c.post("/v1/completions", json={"prompt": "x"},
                             headers={"X-Stitch-Min-Version": "3", "X-Stitch-Wait": "30"})
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["stitch"] == {"run": RUN, "version_start": 3, "version_end": 3}
            assert body["salt"] == f"stitch:{RUN}:v3"
            st = (await c.get("/stitch/status")).json()
            assert st["engine"] == "toy" and st["ranks"] == 2 and st["version"] == 3
            assert st["fingerprint_check"]["ok"] is True
            assert (await c.post("/stitch/verify")).json()["ok"] is True
        fresh = [ToyEngine(r, 2) for r in range(2)]
        for e in fresh:
            e.load_weights(iter(views[3].items()))
        for a, b in zip(engines, fresh, strict=True):
            for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
                assert torch.equal(p.view(torch.uint8), q.view(torch.uint8)), n
        # steps held around every write; the engine told its version while still held
        i = follower.calls.index("write")
        assert follower.calls[i - 1] == "pause"
        assert follower.calls[i + 1:i + 4] == ["load", "after_apply:1", "resume"]  # fallback
    finally:
        await mw.shutdown()
        await asyncio.sleep(0)
    assert current() is None


async def test_a_follower_that_cannot_start_refuses_requests():
    """No silent serving: if the follower cannot start, gated requests get 409, not the engine."""

    class Broken(FollowerMiddleware):
        def make_follower(self, app):
            raise RuntimeError("no run configured")

    mw = Broken(completions)
    await mw.startup(None)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=mw),
                                     base_url="http://t") as c:
            r = await c.post("/v1/completions", json={"prompt": "x"})
            assert r.status_code == 409
            assert r.json()["error"]["type"] == "stitch_version_not_ready"
            assert (await c.get("/stitch/status")).status_code == 503
    finally:
        await mw.shutdown()
