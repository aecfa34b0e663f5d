"""Per-token version spans: which policy version sampled each output token of an answer.

The engine is the witness. vLLM (>= 0.32) and SGLang (>= 0.5.23) label every engine step's
outputs with a weight-version string and report, per finished output, the spans of output tokens
each label sampled. The engine plugins set that label to the Stitch version at every apply while
engine steps are held (`stitch_core.node.EngineFollower.after_apply`), so a label change falls
exactly on the first engine step that ran on the new weights. The plugin records the engine's spans
for each output of a request into the request's `SpanSink` (put in the request's context by
`stitch_core.serve.asgi`, found with `current()`), and `stitch_core.serve.stamping` writes them
into the answer.

Form (docs/protocol.md): ``[[version, first_token, last_token], ...]`` per output, indices into
the output's generated tokens, inclusive, contiguous from 0, versions strictly ascending (engines
never go back). The compact form (``X-Stitch-Version-Spans``) is ``12:0-99,13:100-299``; several
outputs (``n > 1``, several prompts) are ``;``-separated in output index order.
"""

from __future__ import annotations

import contextvars
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from stitch_core.errors import StitchError

log = logging.getLogger("stitch.spans")

Span = tuple[int, int, int]
"""(version, first output-token index, last output-token index), inclusive."""

MAX_COMPACT = 8192  # characters of a compact form a client parses (a header is never longer)


class SpansError(StitchError, ValueError):
    """Version spans that are not well formed (gaps, overlaps, versions going back, no number)."""


def check(spans: Sequence[Sequence[int]], n_tokens: int | None = None) -> list[Span]:
    """`spans` as a list of `Span`, or SpansError: contiguous from token 0, non-empty, versions
    strictly ascending, and covering exactly `n_tokens` tokens when given."""
    out: list[Span] = []
    nxt = 0
    for s in spans:
        if len(s) != 3 or not all(isinstance(x, int) and not isinstance(x, bool) for x in s):
            raise SpansError(f"a span is [version, first, last] of integers, got {s!r}")
        v, first, last = (int(x) for x in s)
        if first != nxt or last < first:
            raise SpansError(f"span {list(s)} does not continue at token {nxt}")
        if out and v <= out[-1][0]:
            raise SpansError(f"span {list(s)}: versions must ascend (after v{out[-1][0]})")
        if v < 0:
            raise SpansError(f"span {list(s)}: negative version")
        out.append((v, first, last))
        nxt = last + 1
    if n_tokens is not None and nxt != n_tokens:
        raise SpansError(f"spans cover {nxt} tokens, the output has {n_tokens}")
    return out


def from_engine(labels: Iterable[tuple[str, int, int]]) -> list[Span]:
    """Spans from an engine's ``(label, start, end)`` triples (end exclusive, as vLLM and SGLang
    report them; empty ones dropped, neighbours with one label merged). SpansError when a label
    is not a Stitch version number (e.g. the engine's ``"default"``: tokens sampled before the
    plugin labelled the weights)."""
    merged: list[list[int]] = []
    for label, start, end in labels:
        try:
            v = int(str(label))
        except ValueError:
            raise SpansError(f"weight version label {label!r} is not a Stitch version") from None
        if end <= start:
            continue
        if merged and merged[-1][0] == v and merged[-1][2] == start - 1:
            merged[-1][2] = end - 1
        else:
            merged.append([v, int(start), int(end) - 1])
    return check(merged)


def compact(outputs: Sequence[Sequence[Span]]) -> str:
    """The ``X-Stitch-Version-Spans`` form of one span list per output."""
    return ";".join(",".join(f"{v}:{a}-{b}" for v, a, b in spans) for spans in outputs)


def parse_compact(text: str) -> list[list[Span]]:
    """One checked span list per output from the ``X-Stitch-Version-Spans`` form."""
    if len(text) > MAX_COMPACT:
        raise SpansError(f"version spans longer than {MAX_COMPACT} characters")
    outputs: list[list[Span]] = []
    for part in text.strip().split(";"):
        spans = []
        for item in filter(None, (p.strip() for p in part.split(","))):
            try:
                v, _, rng = item.partition(":")
                a, _, b = rng.partition("-")
                spans.append((int(v), int(a), int(b)))
            except ValueError:
                raise SpansError(f"not a version span: {item!r}") from None
        outputs.append(check(spans))
    return outputs


def token_versions(spans: Sequence[Span]) -> list[int]:
    """The version of each output token (what a trainer's per-token loss weighs)."""
    out: list[int] = []
    for v, a, b in check(spans):
        out.extend([v] * (b - a + 1))
    return out


class SpanSink:
    """The spans an engine reported for the outputs of one request.

    An answer's outputs are numbered the way OpenAI's ``choices`` are: prompt by prompt (one
    engine request each, in the order the server submits them: `open_request`), then output by
    output within a prompt (``n``)."""

    def __init__(self) -> None:
        self.outputs: dict[tuple[int, int], list[Span]] = {}
        self.requests = 0
        self.error: str | None = None  # an engine report that did not check

    def open_request(self) -> int:
        """Number the next engine request of this answer (0, 1, ...)."""
        self.requests += 1
        return self.requests - 1

    def record(self, request: int, index: int, labels: Iterable[tuple[str, int, int]],
               n_tokens: int | None = None) -> None:
        """The engine's spans (label, start, end-exclusive) for output `index` of engine request
        `request`."""
        try:
            spans = from_engine(labels)
            if n_tokens is not None:
                check(spans, n_tokens)
        except SpansError as e:
            self.error = f"request {request} output {index}: {e}"
            log.warning("stitch: engine version spans not used: %s", self.error)
            return
        self.outputs[(int(request), int(index))] = spans

    def spans(self) -> list[list[Span]] | None:
        """One span list per output in choice order; None when the engine reported none, or a
        report did not check (the answer then names its versions by start and end only)."""
        if not self.outputs or self.error is not None:
            return None
        return [self.outputs[k] for k in sorted(self.outputs)]


Reports = Callable[[Any], Iterable[tuple[int, Iterable[tuple[str, int, int]]]]]
"""An engine's outputs item -> (output index, (label, start, end-exclusive) spans) of each
finished output in it (none while it generates)."""


def record_into_sinks(obj: Any, attr: str, reports: Reports) -> bool:
    """Wrap the async-generator method `attr` of the engine object `obj` on the instance: each
    call made while a Stitch-admitted request is served (`current()`) numbers an engine request
    of that answer and records what `reports` finds in each item it yields. The engines have no
    output hook an in-process plugin could register instead. False when `obj` has no `attr`."""
    inner = getattr(obj, attr, None)
    if inner is None:
        return False
    if getattr(inner, "_stitch_spans", False):
        return True

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        sink = current()
        outputs = inner(*args, **kwargs)
        return outputs if sink is None else _recording(outputs, sink, sink.open_request(), reports)

    wrapped._stitch_spans = True  # type: ignore[attr-defined]
    setattr(obj, attr, wrapped)
    return True


async def _recording(outputs: Any, sink: SpanSink, request: int, reports: Reports) -> Any:
    try:
        async for out in outputs:
            for index, labels in reports(out):
                sink.record(request, index, labels)
            yield out
    finally:
        await outputs.aclose()


_CURRENT: contextvars.ContextVar[SpanSink | None] = contextvars.ContextVar(
    "stitch_span_sink", default=None)


def current() -> SpanSink | None:
    """The sink of the request being served in this context (None outside one)."""
    return _CURRENT.get()


def bind(sink: SpanSink | None) -> contextvars.Token:
    """Make `sink` the current request's (`unbind` with the token returned)."""
    return _CURRENT.set(sink)


def unbind(token: contextvars.Token) -> None:
    _CURRENT.reset(token)
