"""Per-token version spans on the vLLM session follower (conftest `follower`: TP=1, CPU), across
applies mid-generation.

Real parts: nats-server, a board directory, a tiny Qwen2 trained with AdamW in this process, the
Publisher, `stitch pull`, a vLLM OpenAI server with the plugin, and a plain vLLM engine (`LLM`, one
subprocess) loaded from `stitch pull` snapshots of each version for the regeneration proof (started
on the first, the others by vLLM's own in-place reload). The applies
land mid-generation by construction: the test holds the engine's steps (vLLM's RL route
`POST /pause?mode=keep`) while it publishes, so the request cannot finish first; the plugin's
own pause/resume around the apply lets it go on.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
import threading
import time

import httpx
import pytest

from stitch_core.serve import protocol
from stitch_core.serve.spans import token_versions
from stitch_core.versions.board import LocalBoard
from stitch_core.versions.materialize import pull
from stitch_dev.engines import VllmServer as Server
from stitch_dev.engines import adapter
from stitch_dev.procs import vllm_env
from stitch_dev.trainer import AdamWTrainer

PROMPT = [11, 42, 7, 99, 23, 5]  # token ids: both engines see exactly these
# generated tokens of the long request: the second hold must land after the first apply and
# before the end, while the engine runs at full speed again (a few ms a token on this model)
N = 360


@pytest.fixture()
def stack(engine, follower):
    """The session follower (its API key on every request) and its run."""
    return follower


class Stream:
    """A streamed completion read on a thread: its tokens and logprobs as they come."""

    def __init__(self, server: Server, body: dict, headers: dict | None = None):
        self.server, self.body, self.headers = server, body, headers or {}
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.events: list[dict] = []
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            with httpx.Client(base_url=self.server.url, timeout=300,
                              headers=self.server.http.headers) as c, \
                    c.stream("POST", "/v1/completions", json=self.body,
                             headers=self.headers) as r:
                assert r.status_code == 200, r.read()
                for ln in r.iter_lines():
                    if not ln.startswith("data: ") or ln == "data: [DONE]":
                        continue
                    ev = json.loads(ln[6:])
                    self.events.append(ev)
                    for ch in ev.get("choices", []):
                        lp = ch.get("logprobs") or {}
                        self.tokens += [int(t.split(":")[1]) for t in lp.get("tokens", [])]
                        self.logprobs += lp.get("token_logprobs", [])
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e

    def wait_tokens(self, n: int, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while len(self.tokens) < n:
            assert self.thread.is_alive(), (self.error, len(self.tokens))
            assert time.monotonic() < deadline, f"{len(self.tokens)} tokens after {timeout}s"
            time.sleep(0.02)

    def result(self) -> protocol.StitchInfo:
        self.thread.join(300)
        assert self.error is None, self.error
        info = protocol.parse_stitch(self.events[-1])
        assert info is not None, self.events[-1]
        return info


def long_body(model: str, **kw) -> dict:
    return {"model": model, "prompt": PROMPT, "max_tokens": N, "temperature": 0.0,
            "ignore_eos": True, "logprobs": 1, "return_tokens_as_token_ids": True,
            "stream": True, **kw}


def apply_mid_generation(server: Server, trainer: AdamWTrainer, done: float | None = None
                         ) -> int | None:
    """Publish the next version while the engine's steps are held; return it once applied. With
    `done` (the server's finished count before the request was sent): only when the request is
    seen unfinished under the hold, else None (nothing published)."""
    with server.hold_steps():
        if done is not None and not server.unfinished_under_hold(done):
            return None
        v = trainer.publish()
        # polled closely: once applied, the engine generates again (the plugin's own resume)
        server.wait_version(v, timeout=120, poll=0.01)
    return v


def stream_across_two_applies(server: Server, trainer: AdamWTrainer, attempts: int = 5
                              ) -> tuple[Stream, int, int, int]:
    """A long stream with two versions applied while it generates, each while the stream is
    seen unfinished under the hold. When it finished first (a busy host), it is sent again, at
    most `attempts` times. (stream, version before, first applied, second applied)."""
    for _ in range(attempts):
        v0 = server.status()["version"]
        done = server.metric(server.FINISHED)
        s = Stream(server, long_body(server.model))
        s.wait_tokens(1)
        v1 = apply_mid_generation(server, trainer, done)
        if v1 is not None and len(s.tokens) < N:
            s.wait_tokens(len(s.tokens) + 1)  # generating again, on v1
            v2 = apply_mid_generation(server, trainer, done)
            if v2 is not None:
                return s, v0, v1, v2
        s.result()
    raise AssertionError(f"the stream finished before a hold in {attempts} attempts")


FRESH = textwrap.dedent("""
    import json, sys
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    jobs, out, max_len = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    res = []
    llm = LLM(model=jobs[0][0], dtype="bfloat16", max_model_len=max_len, enforce_eager=True,
              seed=0, max_num_seqs=4, generation_config="vllm")
    for i, (d, items) in enumerate(jobs):
        if i:  # vLLM's own in-place reload (stitch_dev.engines.vllm_fresh_outputs)
            llm.collective_rpc("reload_weights", kwargs={"weights_path": d})
            llm.reset_prefix_cache()
        for prompt, n in items:
            sp = SamplingParams(temperature=0.0, max_tokens=n, logprobs=0, ignore_eos=True)
            c = llm.generate([TokensPrompt(prompt_token_ids=prompt)], sp,
                             use_tqdm=False)[0].outputs[0]
            res.append({"tokens": list(c.token_ids),
                        "logprobs": [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]})
    llm.llm_engine.engine_core.shutdown()
    json.dump(res, open(out, "w"))
""")


def regenerate(root, jobs: list[tuple[str, list[tuple[list[int], int]]]],
               max_model_len: int) -> list[dict]:
    """Greedy tokens and their logprobs of a plain engine at each version: for each (model dir,
    [(prompt ids, n)]), the engine at that directory's weights (started on the first, later ones
    by vLLM's own reload); the answers in that order, flat."""
    out = root / "fresh.json"
    env = vllm_env(os.environ, 1)  # the server's CPU settings (threads decide reduction orders)
    subprocess.run([sys.executable, "-c", FRESH, json.dumps(jobs), str(out),
                    str(max_model_len)], check=True, env=env, timeout=900)
    return json.loads(out.read_text())


def test_spans_mark_the_engine_steps_where_each_apply_took_effect(stack):
    """A stream of N tokens runs across two applies: its spans name three versions and cover
    every token; each span's tokens and their logprobs are what a fresh engine at that span's
    version generates from the same prefix, bit for bit, and the first token of each new span is
    given another logprob by the previous version (the apply recomputes the running requests' KV
    on the new weights: STITCH_KV_AFTER_APPLY=recompute, the default)."""
    server, trainer, root, run = stack["server"], stack["trainer"], stack["root"], stack["run"]
    s, v0, v1, v2 = stream_across_two_applies(server, trainer)
    info = s.result()
    assert len(s.tokens) == N and len(s.logprobs) == N
    spans = info.version_spans
    assert spans is not None, info
    assert [v for v, _, _ in spans] == [v0, v1, v2], spans
    assert spans[0][1] == 0 and spans[-1][2] == N - 1
    assert info.version_start == v0 and info.version_end == v2
    assert info.choice_version_spans == [spans]
    versions = token_versions(spans)
    assert versions.count(v1) == spans[1][2] - spans[1][1] + 1

    # regenerate each span from a fresh engine at its version, prompt = PROMPT + tokens before it;
    # and each boundary token from the previous version too (it must differ there)
    dirs = {}
    for v in (v0, v1, v2):
        dirs[v] = root / f"fresh-v{v}"
        asyncio.run(pull(LocalBoard(root / "board"), run, v, dirs[v], root / "cache", quiet=True))
    wanted = [(str(dirs[v]), PROMPT + s.tokens[:a], b - a + 1) for v, a, b in spans]
    wanted += [(str(dirs[spans[k - 1][0]]), PROMPT + s.tokens[:spans[k][1]], 1) for k in (1, 2)]
    by_dir: dict[str, list] = {}  # one engine per version, every prompt of that version on it
    for d, prompt, n in wanted:
        by_dir.setdefault(d, []).append((prompt, n))
    # the follower's context length: the same attention blocks, the same reduction orders
    flat = iter(regenerate(root, list(by_dir.items()),
                           adapter("vllm").follower_kw["max_model_len"]))
    answers = {d: [next(flat) for _ in items] for d, items in by_dir.items()}
    fresh = [answers[d].pop(0) for d, _, _ in wanted]
    for (v, a, b), got in zip(spans, fresh, strict=False):
        want = list(zip(s.tokens[a:b + 1], s.logprobs[a:b + 1], strict=True))
        have = list(zip(got["tokens"], got["logprobs"], strict=True))
        first = next((i for i, (x, y) in enumerate(zip(want, have, strict=False)) if x != y),
                     len(want) if len(want) != len(have) else None)
        assert first is None, (f"span v{v} [{a}, {b}] differs from token {a + first}: engine "
                               f"{want[first:first + 3]}, fresh {have[first:first + 3]}")
    for k, got in zip((1, 2), fresh[3:], strict=True):
        a = spans[k][1]
        assert got["logprobs"][0] != s.logprobs[a], (
            f"token {a} is as likely under v{spans[k - 1][0]}: the boundary proves nothing")


LONG = 400  # tokens of the requests an apply lands in by way of a companion stream


def across_an_apply(server: Server, trainer: AdamWTrainer, path: str,
                    body: dict) -> tuple[httpx.Response, int]:
    """POST `body` (not streamed) to `path` with the next version applied mid-generation
    (stitch_dev.engines.EngineServer.across_an_apply). Returns the answer and the version."""
    return server.across_an_apply(
        lambda: httpx.post(f"{server.url}{path}", json=body, timeout=300,
                           headers=server.http.headers), trainer.publish)


def test_non_streamed_answer_has_the_header_form(stack):
    """A non-streamed answer across an apply: the X-Stitch-Version-Spans header says what the body
    says; a pinned request never sees a second version."""
    server, trainer = stack["server"], stack["trainer"]
    v0 = server.status()["version"]
    r, v1 = across_an_apply(server, trainer, "/v1/completions", {
        **long_body(server.model), "max_tokens": LONG, "stream": False})
    assert r.status_code == 200, r.text
    info = protocol.parse_stitch(r.json())
    assert info is not None and info.version_spans is not None
    assert [v for v, _, _ in info.version_spans] == [v0, v1], info
    header = protocol.parse_version_spans(r.headers[protocol.VERSION_SPANS_HEADER])
    assert header == [info.version_spans]
    assert info.version_spans[-1][2] == r.json()["usage"]["completion_tokens"] - 1 == LONG - 1
    # pinned to the serving version, no apply: one span of that version
    r = server.complete("Hello", {"X-Stitch-Version": str(v1)}, max_tokens=5)
    assert r.status_code == 200, r.text
    assert r.json()["stitch"]["version_spans"] == [[v1, 0, 4]]


def test_spans_agree_with_vllms_own_weight_versions(stack):
    """vLLM's token-in-token-out route returns the engine's own `weight_versions`: the Stitch
    field says the same, token for token, across an apply."""
    server, trainer = stack["server"], stack["trainer"]
    r, _ = across_an_apply(server, trainer, "/inference/v1/generate", {
        "model": server.model, "token_ids": PROMPT,
        "sampling_params": {"max_tokens": LONG, "temperature": 0.0, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    body = r.json()
    theirs = [[int(w["version"]), w["start"], w["end"] - 1]
              for w in body["choices"][0]["weight_versions"]]
    assert len(theirs) == 2, theirs
    assert body["stitch"]["version_spans"] == theirs
    assert theirs[-1][2] == len(body["choices"][0]["token_ids"]) - 1
