"""vLLM's own scenarios on the session follower (conftest `follower`), after test_server.py's:
every generating route of vLLM 0.32 pinned and stamped, and an engine behind catching up through
one squashed span (kept last: it moves the trainer to another publisher)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from stitch_core.format import fingerprint as fpr
from stitch_core.versions.board import LocalBoard
from stitch_core.versions.materialize import pull
from stitch_core.versions.store import read_manifest
from stitch_dev.engines import PROMPTS

from ..engine_common import Stamp, sse_events
from .test_routes_vllm import bodies
from .test_server import pinned_and_stamped, verify_takes_the_key


def test_every_generating_route_is_pinned_and_stamped(follower):
    """The Responses and Anthropic Messages APIs, token-in-token-out generate, batch chat,
    generative scoring and SageMaker's /invocations: 409 pinned to a version the engine does not
    hold (in each API's error shape), stamped when served (headers and the JSON field; a stream's
    last event in its dialect); vLLM's key check first."""
    server, run = follower["server"], follower["run"]
    v = server.status()["version"]
    stamp = Stamp(run, v)
    anon = httpx.Client(base_url=server.url, timeout=120)
    for path, body in bodies(server.model).items():
        # without the key: vLLM's 401 where vLLM guards the path, else as vLLM would (admitted)
        pinned_and_stamped(server, anon, path, body, v, stamp,
                           401 if path.startswith(("/v1", "/inference")) else 200)
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
    verify_takes_the_key(server, anon)
    anon.close()


@pytest.mark.follower_late(2)
def test_an_engine_behind_catches_up_through_one_span(follower):
    """Kept last, after the forged version (conftest `follower_late`: it moves the trainer to
    another publisher). Four versions are published on a
    copy of the board and squashed there (`stitch squash`'s Squasher), then appear on the
    engine's board at once: `latest` jumps by four. The engine plans one span from its version,
    applies it in one pause, and serves exactly the newest version."""
    import shutil

    from safetensors.torch import load_file

    from stitch_core.versions.manifest import Latest
    from stitch_core.versions.squash import Squasher
    from stitch_core.versions.store import read_span
    from stitch_trainer import Publisher

    server, trainer, root, run = (follower[k] for k in ("server", "trainer", "root", "run"))
    held = server.status()["version"]
    staging = root / "staging"
    shutil.copytree(root / "board", staging)
    # the version the engine holds, as the board has it (earlier tests put versions on the
    # board that the trainer's own state never held: the forged one's repair)
    asyncio.run(pull(LocalBoard(root / "board"), run, held, root / "held", root / "cache",
                     quiet=True))
    view = {k: v for f in sorted((root / "held").glob("*.safetensors"))
            for k, v in load_file(f).items()}
    trainer.pub.close()
    trainer.pub = Publisher(str(staging), run, "bf16")
    trainer.pub.resume_from(held, view, fpr.state_fingerprints(view))
    new = [trainer.publish() for _ in range(4)]
    target = new[-1]
    assert new == list(range(held + 1, held + 5))
    sq = Squasher(LocalBoard(staging), run, root / "squash-cache", horizon=8)
    while asyncio.run(sq.step()) is not None:
        pass
    span = asyncio.run(read_span(LocalBoard(staging), run, target, held))
    assert span is not None and span.changed_elements > 0
    for v in new:  # objects, then manifests, then latest: as a publisher stores them
        d = f"{run}/versions/{v:06d}"
        (root / "board" / d).mkdir(parents=True)
        files = sorted((staging / d).iterdir(), key=lambda p: p.name.endswith(".json"))
        for f in files:
            shutil.copy2(f, root / "board" / d / f.name)
    latest = Latest.model_validate_json((staging / run / "latest").read_text())
    asyncio.run(LocalBoard(root / "board").move_latest(run, held, latest))
    before = server.status()["patch_bytes_total"]
    r = server.complete(PROMPTS[0], {"X-Stitch-Version": str(target), "X-Stitch-Wait": "120"})
    assert r.status_code == 200, r.text
    assert r.headers["X-Stitch-Version-Start"] == str(target)
    st = server.wait_applied(target, timeout=60)
    assert st["version"] == target and st["state"] == "serving"
    assert st["patch_bytes_total"] - before == span.bytes  # the span alone, not the chain
    assert st["last_apply"]["changed"] == span.changed_elements
    log = server.tail(100000)
    assert f"now at {run} v{target} (span from {held}," in log, log[-3000:]
    assert f"now at {run} v{held + 1} " not in log
    m = asyncio.run(read_manifest(LocalBoard(root / "board"), run, target))
    assert m.fingerprints == fpr.state_fingerprints(trainer.view())
    check = server.http.post("/stitch/verify").json()
    assert check["ok"] is True
