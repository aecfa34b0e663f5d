"""Per-token version spans on the SGLang session follower (conftest `follower`): SGLang's own
`meta_info.weight_versions` (the plugin labels SGLang's weight version with the Stitch version at
every apply, steps held) carried into the `stitch` field, across an apply that lands
mid-generation by construction (the test holds SGLang's steps while it publishes); and, with the
KV recomputed after the apply (STITCH_KV_AFTER_APPLY=recompute, the default: SGLang's retract
pause, then a radix-cache flush), each span's tokens and logprobs regenerated bit for bit by a
plain SGLang engine (no plugin) at that span's version: started on the first version, the next
loaded by SGLang's own loader (`/update_weights_from_disk`, cache flushed), one start for both.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid

import httpx

from stitch_core.serve import protocol
from stitch_core.versions.board import LocalBoard
from stitch_core.versions.materialize import pull
from stitch_dev.engines import SglangServer

LONG = 300


def _stream_across_an_apply(server, trainer, path: str, body: dict,
                            attempts: int = 3) -> tuple[list, int]:
    """A streamed request with the next version applied while it generates: once its first
    event is in, SGLang's steps are held and, if the request is seen unfinished under the hold,
    the version is published. When it finished first (a busy host: one pause call against
    hundreds of steps), it is sent again, at most `attempts` times. (events, version)."""
    for _ in range(attempts):
        done = server.metric(server.FINISHED)
        s = _Events(server, path, body)
        s.wait_events(1)
        v = None
        with server.hold_steps():
            if server.unfinished_under_hold(done):
                v = trainer.publish()
                server.wait_version(v, timeout=120)
        events = s.done()
        if v is not None:
            return events, v
    raise AssertionError(f"the stream finished before the hold in {attempts} attempts")


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
    events, v1 = _stream_across_an_apply(server, trainer, "/generate", {
        "text": "Once upon a time", "stream": True,
        "sampling_params": {"temperature": 0, "max_new_tokens": LONG, "ignore_eos": True}})
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


PROMPT = [11, 42, 7, 99, 23, 5]  # token ids
N = 160


def _generate_ids(server, prompt: list[int], n: int) -> dict:
    """Greedy /generate from token ids, with logprobs; a fresh cache_salt, so no radix reuse."""
    r = server.http.post("/generate", timeout=300, json={
        "input_ids": prompt, "return_logprob": True, "cache_salt": uuid.uuid4().hex,
        "sampling_params": {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    return r.json()


def _tokens(body: dict) -> list[tuple[int, float]]:
    return [(int(t), float(lp)) for lp, t, *_ in body["meta_info"]["output_token_logprobs"]]


def test_spans_regenerate_bit_exact_from_fresh_engines(follower, tmp_path):
    """An apply lands mid-generation: the answer's spans name v0 then v1; the tokens (and their
    logprobs) of each span are what a plain SGLang engine at that span's version generates
    from the same prefix, bit for bit, and the first token of the v1 span has another logprob
    under v0 (so the boundary is where the new weights took effect, KV included)."""
    server, trainer, root, run = (follower[k] for k in ("server", "trainer", "root", "run"))
    v0 = server.status()["version"]
    r, v1 = server.across_an_apply(lambda: server.http.post("/generate", timeout=300, json={
        "input_ids": PROMPT, "return_logprob": True,
        "sampling_params": {"temperature": 0, "max_new_tokens": N, "ignore_eos": True}}),
        trainer.publish)
    assert r.status_code == 200, r.text
    body = r.json()
    got = _tokens(body)
    info = protocol.parse_stitch(body)
    assert info is not None and info.version_spans is not None, body
    spans = info.version_spans
    assert [v for v, _, _ in spans] == [v0, v1] and spans[-1][2] == N - 1 == len(got) - 1, spans
    a = spans[1][1]
    ids = [t for t, _ in got]

    # the reference: a plain SGLang engine (no plugin) started on v0; v1 loaded by SGLang's own
    # loader (/update_weights_from_disk, cache flushed), one start for both versions
    fresh = {}
    dirs = {v: tmp_path / f"v{v}" for v in (v0, v1)}
    for v, d in dirs.items():
        asyncio.run(pull(LocalBoard(root / "board"), run, v, d, tmp_path / "cache", quiet=True))
    eng = SglangServer(dirs[v0], tmp_path / "fresh.log", plain=True)
    try:
        eng.wait_healthy()
        for v, jobs in ((v0, [(PROMPT, a), (PROMPT + ids[:a], 1)]),
                        (v1, [(PROMPT + ids[:a], N - a)])):
            if v != v0:
                eng.load_weights(dirs[v])
            fresh[v] = [_tokens(_generate_ids(eng, p, n)) for p, n in jobs]
    finally:
        eng.stop()
    for name, want, have in (("v0 span", got[:a], fresh[v0][0]),
                             ("v1 span", got[a:], fresh[v1][0])):
        first = next((i for i, (x, y) in enumerate(zip(want, have, strict=True)) if x != y),
                     None)
        assert first is None, (f"{name} differs at its token {first}: follower "
                               f"{want[first:first + 3]}, fresh {have[first:first + 3]}")
    assert fresh[v0][1][0][1] != got[a][1], f"token {a} is as likely under v{v0}"
