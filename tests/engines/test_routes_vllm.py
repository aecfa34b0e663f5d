"""vLLM's routes: every route of vLLM that generates is version-controlled, and only past vLLM's
own API-key check. vLLM's real app (built in this process, no engine): the routes Stitch finds in
its route table (the RL / dev routes of VLLM_SERVER_DEV_MODE included, and left alone), and the
order of the key check and admission in vLLM's real middleware stack. The data of test_routes.py
for vLLM (a real server holding no version; `--api-key`, `--enable-scale-out`): what generates,
a body for each route. The served side runs on the follower (test_server_vllm.py).
"""

from __future__ import annotations

import time

import httpx

import stitch_core.node as node
from stitch_core.serve import protocol, route_table
from stitch_core.serve.gate import VersionGate
from stitch_vllm.server import FALLBACK, StitchMiddleware, classify

from .test_routes import KEY, RUN

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

# test_routes.py's server: its flags, the paths its not-ready check streams, the path of its
# key check
NEVER_KW = {"max_model_len": 512, "extra": ["--enable-scale-out"]}
STREAMED = ("/v1/responses", "/v1/messages", "/v1/completions")
STATUS_ANON = 503  # /stitch/status without the key: open, read-only (no version yet)
KEYED = "/v1/responses"


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


def not_ready_extras(never) -> None:
    """Nothing beyond test_routes.py's checks."""


def tokenized(r) -> None:
    assert r.status_code == 200 and r.json()["tokens"]
