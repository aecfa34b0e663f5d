"""Per-token version spans: the form, the compact header form, and how the middleware writes what
an engine plugin records (`stitch_core.serve.spans`). The engines' own reports are checked against
real vLLM in tests/engines/test_version_spans_vllm.py (on the session follower)."""

from __future__ import annotations

import json

import httpx
import pytest

from stitch_core.serve import protocol, spans
from stitch_core.serve.asgi import StitchASGI
from stitch_core.serve.gate import VersionGate
from stitch_core.serve.spans import SpansError, SpanSink

RUN = "spans-run"


def test_check_accepts_contiguous_ascending_spans_only():
    assert spans.check([[3, 0, 4], [5, 5, 9]], 10) == [(3, 0, 4), (5, 5, 9)]
    assert spans.check([], 0) == []
    for bad in ([[3, 1, 4]],               # does not start at token 0
                [[3, 0, 4], [4, 6, 9]],    # a gap
                [[3, 0, 4], [4, 4, 9]],    # an overlap
                [[4, 0, 4], [3, 5, 9]],    # a version going back
                [[3, 0, 4], [3, 5, 9]],    # one version twice
                [[3, 0]], [[3, 0, "4"]], [[True, 0, 1]], [[-1, 0, 1]]):
        with pytest.raises(SpansError):
            spans.check(bad)
    with pytest.raises(SpansError, match="cover 10 tokens"):
        spans.check([[3, 0, 9]], 12)


def test_engine_labels_become_inclusive_spans():
    # vLLM and SGLang report (label, start, end-exclusive); empty spans drop, neighbours merge
    assert spans.from_engine([("7", 0, 3), ("8", 3, 3), ("8", 3, 10)]) == [(7, 0, 2), (8, 3, 9)]
    assert spans.from_engine([("7", 0, 3), ("7", 3, 5)]) == [(7, 0, 4)]
    with pytest.raises(SpansError, match="not a Stitch version"):
        spans.from_engine([("default", 0, 3)])


def test_compact_form_round_trips_and_refuses_junk():
    outputs = [[(3, 0, 4), (5, 5, 9)], [(3, 0, 0)]]
    text = spans.compact(outputs)
    assert text == "3:0-4,5:5-9;3:0-0"
    assert spans.parse_compact(text) == outputs
    assert protocol.parse_version_spans(text) == outputs
    for bad in ("3:0-4,x:5-9", "3:1-4", "3:0-4,2:5-9", "3-0:4", "3:0-4," * 2000):
        with pytest.raises(SpansError):
            spans.parse_compact(bad)


def test_token_versions_per_token():
    assert spans.token_versions([(3, 0, 1), (5, 2, 4)]) == [3, 3, 5, 5, 5]
    info = protocol.StitchInfo.model_validate(protocol.stitch_field(
        RUN, 3, 5, [[(3, 0, 1), (5, 2, 4)]]))
    assert info.version_spans == [(3, 0, 1), (5, 2, 4)]
    assert info.token_versions() == [3, 3, 5, 5, 5]
    assert info.token_versions(1) is None
    assert protocol.StitchInfo(run=RUN, version_start=1, version_end=1).token_versions() is None


def recording_app(reports: list[tuple[int, int, list[tuple[str, int, int]]]], *,
                  stream: bool = False):
    """An engine-like app that records `reports` into the current request's sink, as an engine
    plugin does while generating, then answers (JSON, or SSE)."""

    async def app(scope, receive, send):
        while (await receive()).get("more_body"):
            pass
        sink = spans.current()
        assert sink is not None  # the middleware put one in this request's context
        for request, index, labels in reports:
            sink.record(request, index, labels)
        if stream:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream")]})
            for c in (b'data: {"id": "c1", "choices": [{"text": "a"}]}\n\n', b"data: [DONE]\n\n"):
                await send({"type": "http.response.body", "body": c, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        body = json.dumps({"id": "c1", "choices": [{"text": "ab"}]}).encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})

    return app


async def post(app, gate: VersionGate, headers: dict | None = None) -> httpx.Response:
    mw = StitchASGI(app, gate)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=mw),
                                 base_url="http://engine") as c:
        return await c.post("/v1/completions", json={"prompt": "x"}, headers=headers or {})


async def test_json_answer_carries_the_spans_and_the_header():
    gate = VersionGate(RUN)
    gate.set_version(4)
    # admitted at 4; the engine says its tokens came from 4 then 5 (an apply landed mid-way)
    async def app(scope, receive, send):
        async with gate.applying(5) as h:
            h.commit()
        await recording_app([(0, 0, [("4", 0, 3), ("5", 3, 8)])])(scope, receive, send)

    r = await post(app, gate)
    assert r.status_code == 200
    st = r.json()["stitch"]
    assert st["version_spans"] == [[4, 0, 2], [5, 3, 7]]
    assert st["choice_version_spans"] == [[[4, 0, 2], [5, 3, 7]]]
    assert st["version_start"] == 4 and st["version_end"] == 5
    assert r.headers["x-stitch-version-spans"] == "4:0-2,5:3-7"
    assert protocol.parse_version_spans(r.headers["x-stitch-version-spans"]) == [
        [(4, 0, 2), (5, 3, 7)]]


async def test_start_is_the_first_tokens_version_not_the_admission():
    # admitted at 4, queued; the apply to 5 landed before its first token: one span of 5
    gate = VersionGate(RUN)
    gate.set_version(4)

    async def app(scope, receive, send):
        async with gate.applying(5) as h:
            h.commit()
        await recording_app([(0, 0, [("5", 0, 6)])])(scope, receive, send)

    st = (await post(app, gate)).json()["stitch"]
    assert st["version_spans"] == [[5, 0, 5]]
    assert st["version_start"] == st["version_end"] == 5


async def test_several_outputs_are_listed_per_choice():
    gate = VersionGate(RUN)
    gate.set_version(4)
    app = recording_app([(1, 0, [("4", 0, 2)]), (0, 1, [("4", 0, 5)]), (0, 0, [("4", 0, 1)])])
    r = await post(app, gate)
    st = r.json()["stitch"]
    assert "version_spans" not in st  # one list per choice: prompt 0 (n=2), then prompt 1
    assert st["choice_version_spans"] == [[[4, 0, 0]], [[4, 0, 4]], [[4, 0, 1]]]
    assert r.headers["x-stitch-version-spans"] == "4:0-0;4:0-4;4:0-1"


async def test_streamed_answer_has_the_spans_in_its_stitch_chunk():
    gate = VersionGate(RUN)
    gate.set_version(4)
    r = await post(recording_app([(0, 0, [("4", 0, 9)])], stream=True), gate)
    events = [json.loads(ln[6:]) for ln in r.text.splitlines()
              if ln.startswith("data: {")]
    assert events[-1]["stitch"]["version_spans"] == [[4, 0, 8]]
    assert "x-stitch-version-spans" not in r.headers  # the headers left before the tokens


async def test_reports_that_do_not_check_leave_start_and_end_only():
    gate = VersionGate(RUN)
    gate.set_version(4)
    cases = [
        [(0, 0, [("default", 0, 3)])],    # tokens the plugin never labelled
        [(0, 0, [("9", 0, 3)])],          # a version the gate never served to this request
        [(0, 0, [("5", 0, 3), ("4", 3, 5)])],  # going back
    ]
    for reports in cases:
        r = await post(recording_app(reports), gate)
        st = r.json()["stitch"]
        assert "version_spans" not in st and "choice_version_spans" not in st, reports
        assert st["version_start"] == st["version_end"] == 4
        assert "x-stitch-version-spans" not in r.headers


async def test_no_report_no_spans():
    gate = VersionGate(RUN)
    gate.set_version(4)
    st = (await post(recording_app([]), gate)).json()["stitch"]
    assert st == {"run": RUN, "version_start": 4, "version_end": 4}


def test_sink_outside_a_request_is_none():
    assert spans.current() is None
    sink = SpanSink()
    token = spans.bind(sink)
    try:
        assert spans.current() is sink
    finally:
        spans.unbind(token)
    assert spans.current() is None


async def test_record_into_sinks_wraps_an_engine_generator_once():
    class Engine:
        async def generate(self, n):
            for i in range(n):
                yield {"i": i, "done": i == n - 1}

    def reports(out):
        if out["done"]:
            yield 0, [("7", 0, out["i"] + 1)]

    eng = Engine()
    assert spans.record_into_sinks(eng, "generate", reports)
    assert spans.record_into_sinks(eng, "generate", reports)  # idempotent
    assert not spans.record_into_sinks(eng, "absent", reports)
    assert [o["i"] async for o in eng.generate(2)] == [0, 1]  # no request: untouched
    sink = SpanSink()
    token = spans.bind(sink)
    try:
        assert [o["i"] async for o in eng.generate(3)] == [0, 1, 2]
        assert [o["i"] async for o in eng.generate(1)] == [0]
    finally:
        spans.unbind(token)
    assert sink.spans() == [[(7, 0, 2)], [(7, 0, 0)]]  # two engine requests, in call order
