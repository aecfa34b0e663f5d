"""Per-token version spans on the SGLang session follower (conftest `follower`): SGLang's own
`meta_info.weight_versions` (the plugin labels SGLang's weight version with the Stitch version at
every apply, steps held) carried into the `stitch` field, across an apply that lands
mid-generation by construction (the test holds SGLang's steps while it publishes)."""

from __future__ import annotations

import json
import threading
import time

import httpx

from stitch_core.serve import protocol

LONG = 300


def _apply_mid_generation(server, trainer) -> int:
    with server.hold_steps():
        v = trainer.publish()
        server.wait_version(v, timeout=120)
    return v


class _Events:
    """An SSE stream read on a thread: its JSON events (parsed) as they come."""

    def __init__(self, server, path: str, body: dict):
        self.events: list = []
        self.error: BaseException | None = None

        def run() -> None:
            try:
                with httpx.Client(base_url=server.url, timeout=300,
                                  headers=server.http.headers) as c, \
                        c.stream("POST", path, json=body) as r:
                    assert r.status_code == 200, r.read()
                    for ln in r.iter_lines():
                        if ln.startswith("data: ") and ln != "data: [DONE]":
                            self.events.append(json.loads(ln[6:]))
            except BaseException as e:  # noqa: BLE001 - reported by the test
                self.error = e

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def wait_events(self, n: int, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while len(self.events) < n:
            assert self.thread.is_alive() and time.monotonic() < deadline, self.error
            time.sleep(0.02)

    def done(self) -> list:
        self.thread.join(300)
        assert self.error is None, self.error
        return self.events


def _theirs(weight_versions: list[dict]) -> list[list[int]]:
    return [[int(w["version"]), w["start"], w["end"] - 1] for w in weight_versions
            if w["end"] > w["start"]]


def test_native_stream_spans_are_sglangs_own(follower):
    """A native /generate stream across an apply: two spans (the old version, then the new),
    covering every token, equal to SGLang's own weight_versions of the same answer."""
    server, trainer = follower["server"], follower["trainer"]
    v0 = server.status()["version"]
    s = _Events(server, "/generate", {
        "text": "Once upon a time", "stream": True,
        "sampling_params": {"temperature": 0, "max_new_tokens": LONG, "ignore_eos": True}})
    s.wait_events(1)
    v1 = _apply_mid_generation(server, trainer)
    events = s.done()
    info = protocol.parse_stitch(events[-1])
    assert info is not None and info.version_spans is not None, events[-1]
    meta = events[-2]["meta_info"]
    assert [v for v, _, _ in info.version_spans] == [v0, v1], info
    assert info.version_spans[-1][2] == meta["completion_tokens"] - 1 == LONG - 1
    assert [list(s) for s in info.version_spans] == _theirs(meta["weight_versions"])
    assert info.version_start == v0 and info.version_end == v1


def test_openai_completion_has_spans_and_the_header(follower):
    """An OpenAI completion (not streamed) across an apply: body spans, the header form, and
    SGLang's own metadata agree."""
    server, trainer = follower["server"], follower["trainer"]
    v0 = server.status()["version"]
    r, v1 = server.across_an_apply(lambda: server.http.post("/v1/completions", json={
        "model": server.model, "prompt": "Once upon a time", "max_tokens": LONG,
        "temperature": 0, "ignore_eos": True}, timeout=300), trainer.publish)
    assert r.status_code == 200, r.text
    info = protocol.parse_stitch(r.json())
    assert info is not None and info.version_spans is not None, r.json()
    assert [v for v, _, _ in info.version_spans] == [v0, v1], info
    assert protocol.parse_version_spans(r.headers[protocol.VERSION_SPANS_HEADER]) == [
        info.version_spans]
    assert info.version_spans[-1][2] == r.json()["usage"]["completion_tokens"] - 1
