"""The Stitch serving protocol: what a client asks for and what an engine answers. No I/O.

A client may pin the policy version a request is served from with one request header:

* ``X-Stitch-Version: N``      exactly version N;
* ``X-Stitch-Min-Version: N``  version N or newer;

and allow the engine to catch up first with ``X-Stitch-Wait: S`` (seconds, default 0, capped).
An engine that cannot serve the request answers HTTP 409 with :func:`not_ready_body` and a
``Retry-After`` header. Every answer of a completion endpoint names the versions that may have
produced its tokens (``X-Stitch-Version-Start`` / ``-End`` headers and the ``"stitch"`` body
field). The full specification is docs/protocol.md.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from stitch_core.errors import StitchError
from stitch_core.serve import spans
from stitch_core.serve.spans import Span
from stitch_core.settings import MAX_WAIT
from stitch_core.versions.state import EngineState, engine_state, lag  # noqa: F401 (re-exported)

# Request headers (HTTP header names are case-insensitive; ASGI gives them lower-case).
VERSION_HEADER = "X-Stitch-Version"
MIN_VERSION_HEADER = "X-Stitch-Min-Version"
WAIT_HEADER = "X-Stitch-Wait"
# Response headers.
VERSION_START_HEADER = "X-Stitch-Version-Start"
VERSION_END_HEADER = "X-Stitch-Version-End"
VERSION_SPANS_HEADER = "X-Stitch-Version-Spans"  # compact per-token spans (non-streamed answers)
RUN_HEADER = "X-Stitch-Run"
RETRY_AFTER_HEADER = "Retry-After"

RESPONSE_FIELD = "stitch"
"""JSON body field (and last SSE chunk field) carrying run / version_start / version_end, and
where the engine reports them the per-token ``version_spans`` (`stitch_core.serve.spans`)."""

NOT_READY_TYPE = "stitch_version_not_ready"
BAD_REQUEST_TYPE = "stitch_bad_request"

DEFAULT_PATHS: tuple[str, ...] = ("/v1/completions", "/v1/chat/completions")
STATUS_PATH = "/stitch/status"
DEFAULT_MAX_WAIT = MAX_WAIT  # STITCH_MAX_WAIT's default
SALT_PREFIX = "stitch"

Reason = Literal["not_ready", "behind", "passed", "draining", "applying", "version_changed",
                 "refused"]
"""Why a request was refused (the ``reason`` field of a 409 body):

* ``not_ready``        the engine holds no verified version yet;
* ``behind``           the engine is older than the request wants (and did not catch up in time);
* ``passed``           an exact version older than the one serving (engines never go back);
* ``draining``/``applying``  an exact pin on the outgoing version while an apply is under way;
* ``version_changed``  an exact-pinned request was in flight when the serving version changed;
* ``refused``          the engine refused the wanted version (e.g. not signed by a trusted key;
                       the message names the version and the key) and keeps serving the last
                       good one.
"""


class BadRequestError(StitchError, ValueError):
    """Malformed Stitch request headers (answered with HTTP 400)."""


@dataclass(frozen=True)
class VersionRequest:
    """What a request asks for: at most one of `exact` / `minimum`, and how long it may wait."""

    exact: int | None = None
    minimum: int | None = None
    wait: float = 0.0

    @property
    def pinned(self) -> bool:
        return self.exact is not None

    @property
    def wanted(self) -> int | None:
        return self.exact if self.exact is not None else self.minimum


HeaderSource = Mapping[str, str] | Iterable[tuple[bytes, bytes]] | Iterable[tuple[str, str]]


def _header_values(headers: HeaderSource, name: str) -> list[str]:
    lname = name.lower()
    items = headers.items() if isinstance(headers, Mapping) else headers
    out = []
    for k, v in items:
        ks = k.decode("latin-1") if isinstance(k, bytes) else k
        if ks.lower() == lname:
            out.append(v.decode("latin-1") if isinstance(v, bytes) else v)
    return out


def _one(headers: HeaderSource, name: str) -> str | None:
    values = {v.strip() for v in _header_values(headers, name)}
    if len(values) > 1:
        raise BadRequestError(f"{name} given more than once with different values")
    return values.pop() if values else None


MAX_VERSION_DIGITS = 19  # versions are below 2**63


def _shown(value: str) -> str:
    """A header value as an error message quotes it: repr, cut to 40 characters."""
    r = repr(value)
    return r if len(r) <= 40 else r[:37] + "..."


def parse_version(value: str, name: str = VERSION_HEADER) -> int:
    """A version number: a non-negative decimal integer below 2**63 (at most 19 digits; longer
    is a 400, never a server error)."""
    s = value.strip()
    if not s.isascii() or not s.isdigit() or len(s) > MAX_VERSION_DIGITS or int(s) >= 2**63:
        raise BadRequestError(
            f"{name} must be a non-negative integer below 2**63, got {_shown(value)}")
    return int(s)


def parse_wait(value: str, max_wait: float = DEFAULT_MAX_WAIT) -> float:
    """Seconds a request may wait: a finite non-negative number, capped at `max_wait`."""
    try:
        wait = float(value.strip())
    except ValueError:
        raise BadRequestError(f"{WAIT_HEADER} must be a number of seconds, got {_shown(value)}") \
            from None
    if not math.isfinite(wait) or wait < 0:
        raise BadRequestError(f"{WAIT_HEADER} must be a finite non-negative number, got "
                         f"{_shown(value)}")
    return min(wait, max_wait)


def parse_request(headers: HeaderSource, max_wait: float = DEFAULT_MAX_WAIT) -> VersionRequest:
    """Read the Stitch request headers (a mapping, or ASGI's list of (bytes, bytes) pairs).

    Raises :class:`BadRequestError` for both version headers at once, a non-integer or negative
    version, a malformed or negative wait, or a header repeated with different values.
    """
    headers = list(headers.items()) if isinstance(headers, Mapping) else list(headers)
    exact_s = _one(headers, VERSION_HEADER)
    min_s = _one(headers, MIN_VERSION_HEADER)
    wait_s = _one(headers, WAIT_HEADER)
    if exact_s is not None and min_s is not None:
        raise BadRequestError(f"give {VERSION_HEADER} or {MIN_VERSION_HEADER}, not both")
    exact = parse_version(exact_s, VERSION_HEADER) if exact_s is not None else None
    minimum = parse_version(min_s, MIN_VERSION_HEADER) if min_s is not None else None
    wait = parse_wait(wait_s, max_wait) if wait_s is not None else 0.0
    return VersionRequest(exact=exact, minimum=minimum, wait=wait)


def satisfies(version: int | None, exact: int | None, minimum: int | None) -> bool:
    """Whether serving `version` gives a request what it asked for."""
    if version is None:
        return False
    if exact is not None:
        return version == exact
    if minimum is not None:
        return version >= minimum
    return True


def error_body(type_: str, message: str, **fields: Any) -> dict:
    """A JSON error body: ``{"error": {"type": type_, "message": message, **fields}}``."""
    return {"error": {"type": type_, "message": message, **fields}}


def bad_request_body(message: str) -> dict:
    """The body of an HTTP 400: malformed Stitch request headers."""
    return error_body(BAD_REQUEST_TYPE, message)


def not_ready_body(*, run: str, serving: int | None, wanted: int | None, latest: int | None,
                   reason: Reason, message: str | None = None) -> dict:
    """The body of an HTTP 409: the engine cannot serve the version the request wants."""
    if message is None:
        message = describe(reason, serving=serving, wanted=wanted, latest=latest)
    return error_body(NOT_READY_TYPE, message, serving=serving, wanted=wanted, latest=latest,
                      run=run, reason=reason)


def describe(reason: Reason, *, serving: int | None, wanted: int | None,
             latest: int | None) -> str:
    """The message of a 409 body: why the request was refused (`reason`), in words."""
    if reason == "not_ready":
        return "this engine holds no verified policy version yet"
    if reason == "behind":
        return (f"this engine serves version {serving} (latest published {latest}); "
                f"the request wants {wanted}")
    if reason == "passed":
        return (f"version {wanted} is no longer served here (serving {serving}); "
                "engines never go back")
    if reason == "refused":
        return f"version {wanted} was refused by this engine (serving {serving})"
    if reason in ("draining", "applying"):
        return (f"version {wanted} is being replaced by a newer one on this engine; "
                "retry with a newer version")
    return (f"the serving version changed from {wanted} while the request was in flight; "
            "its output was discarded")


def stitch_field(run: str, version_start: int | None, version_end: int | None,
                 outputs: list[list[Span]] | None = None) -> dict:
    """The ``"stitch"`` response field; with the engine's spans (one list per output),
    ``choice_version_spans`` and, for an answer of one output, ``version_spans``."""
    out: dict[str, Any] = {"run": run, "version_start": version_start,
                           "version_end": version_end}
    if outputs is not None:
        if len(outputs) == 1:
            out["version_spans"] = [list(s) for s in outputs[0]]
        out["choice_version_spans"] = [[list(s) for s in o] for o in outputs]
    return out


def response_headers(run: str, version_start: int | None, version_end: int | None,
                     outputs: list[list[Span]] | None = None) -> list[tuple[bytes, bytes]]:
    """The Stitch response headers as ASGI (name, value) pairs (the compact spans when given
    and short enough for a header)."""
    out = [(RUN_HEADER.lower().encode(), run.encode("latin-1", "replace"))]
    if version_start is not None:
        out.append((VERSION_START_HEADER.lower().encode(), str(version_start).encode()))
    if version_end is not None:
        out.append((VERSION_END_HEADER.lower().encode(), str(version_end).encode()))
    if outputs is not None:
        text = spans.compact(outputs)
        if len(text) <= spans.MAX_COMPACT:
            out.append((VERSION_SPANS_HEADER.lower().encode(), text.encode()))
    return out


def cache_salt(run: str, version: int | None, user: str | None = None) -> str:
    """Prefix-cache salt isolating a request served from `version` of `run`.

    A user's own salt is kept in front: ``"<user>|stitch:<run>:v<version>"``.
    """
    salt = f"{SALT_PREFIX}:{run}:v{version}"
    return f"{user}|{salt}" if user else salt


# Client side: pydantic models of what an engine answers.


class StitchInfo(BaseModel):
    """The ``"stitch"`` field of a completion answer."""

    model_config = ConfigDict(extra="allow")
    run: str
    version_start: int | None
    version_end: int | None
    version_spans: list[tuple[int, int, int]] | None = None
    choice_version_spans: list[list[tuple[int, int, int]]] | None = None

    @property
    def single_version(self) -> bool:
        """Whether every token came from one version."""
        return self.version_start is not None and self.version_start == self.version_end

    def token_versions(self, choice: int = 0) -> list[int] | None:
        """The version that sampled each output token of choice `choice` (None when the engine
        did not report spans)."""
        outputs = self.choice_version_spans
        if outputs is None and self.version_spans is not None:
            outputs = [self.version_spans]
        if outputs is None or choice >= len(outputs):
            return None
        return spans.token_versions(outputs[choice])


def parse_version_spans(value: str) -> list[list[Span]]:
    """The ``X-Stitch-Version-Spans`` header: one checked span list per output (SpansError)."""
    return spans.parse_compact(value)


class NotReadyBody(BaseModel):
    """The ``"error"`` object of an HTTP 409 (or of an SSE error event) from a Stitch engine."""

    model_config = ConfigDict(extra="allow")
    type: Literal["stitch_version_not_ready"]
    message: str
    serving: int | None
    wanted: int | None
    latest: int | None
    run: str
    reason: str | None = None


def parse_stitch(body: Mapping[str, Any]) -> StitchInfo | None:
    """The ``"stitch"`` field of a JSON answer or SSE chunk, if present."""
    field = body.get(RESPONSE_FIELD)
    return StitchInfo.model_validate(field) if isinstance(field, Mapping) else None


def parse_not_ready(body: Mapping[str, Any]) -> NotReadyBody | None:
    """The 409 error of a JSON answer or SSE error event, if it is one."""
    err = body.get("error")
    if isinstance(err, Mapping) and err.get("type") == NOT_READY_TYPE:
        return NotReadyBody.model_validate(err)
    return None


# Client side: routed experts (routing replay, R3) and the versions that produced them.
# docs/rl.md "Routing replay (R3)". Row p of a payload is position `first_position + p`; a
# position is computed first by the forward that samples the token after it, so its row belongs
# to output token `max(0, position - prompt_len + 1)` and to that token's version.

NPY_MAGIC = b"\x93NUMPY"


class RoutedExpertsError(StitchError, ValueError):
    """A routed-experts payload that cannot be decoded or aligned."""


def decode_routed_experts(value: str, layers: int | None = None,
                          top_k: int | None = None) -> Any:
    """An engine's base64 routed-experts payload as a numpy int array ``(rows, layers, top_k)``.

    vLLM (``choices[i].routed_experts``): base64 of ``.npy`` bytes, which carry their own shape.
    SGLang (``meta_info.routed_experts``): base64 of raw int32, reshaped with `layers` and
    `top_k` (both required for it; SGLang's model config: ``num_hidden_layers``,
    ``num_experts_per_tok``)."""
    import base64
    import io

    import numpy as np

    try:
        raw = base64.b64decode(value, validate=True)
    except (ValueError, TypeError) as e:
        raise RoutedExpertsError(f"routed experts: not base64 ({e})") from None
    if raw.startswith(NPY_MAGIC):
        arr = np.load(io.BytesIO(raw), allow_pickle=False)
        if arr.ndim != 3 or (layers is not None and arr.shape[1] != layers) or (
                top_k is not None and arr.shape[2] != top_k):
            raise RoutedExpertsError(f"routed experts: shape {arr.shape}, expected "
                                     f"(rows, {layers}, {top_k})")
        return arr
    if layers is None or top_k is None:
        raise RoutedExpertsError("routed experts: raw int32 (SGLang) needs layers and top_k")
    if layers <= 0 or top_k <= 0 or len(raw) % (4 * layers * top_k):
        raise RoutedExpertsError(f"routed experts: {len(raw)} bytes are no whole rows of "
                                 f"{layers} x {top_k} int32")
    return np.frombuffer(raw, dtype="<i4").reshape(-1, layers, top_k)


def routing_row_token(position: int, prompt_len: int) -> int:
    """The output token whose sampling forward computes `position` first: the prompt's
    positions and its last one are forwarded by the prefill that samples token 0."""
    if position < 0 or prompt_len <= 0:
        raise RoutedExpertsError(f"position {position}, prompt of {prompt_len} tokens")
    return max(0, position - prompt_len + 1)


def routing_versions(version_spans: Iterable[Iterable[int]], prompt_len: int, rows: int,
                     first_position: int = 0) -> list[int]:
    """The version whose forward produced each of `rows` routing rows (row i: position
    ``first_position + i``; SGLang's ``routed_experts_start_len``), from the output's
    ``version_spans``. A payload of a finished output has ``prompt_len + tokens - 1 -
    first_position`` rows; more than the spans cover raises."""
    tv = spans.token_versions([tuple(s) for s in version_spans])  # type: ignore[misc]
    out = []
    for i in range(rows):
        j = routing_row_token(first_position + i, prompt_len)
        if j >= len(tv):
            raise RoutedExpertsError(f"routing row {i} (position {first_position + i}) belongs "
                                     f"to token {j}; the spans cover {len(tv)} tokens")
        out.append(tv[j])
    return out


def routing_spans(version_spans: Iterable[Iterable[int]], prompt_len: int,
                  first_position: int = 0) -> list[Span]:
    """Per span, the routing rows it owns: ``(version, first_row, last_row)`` (rows counted from
    `first_position`); spans that own no row (before `first_position`) are left out."""
    out: list[Span] = []
    for v, a, b in spans.check([tuple(s) for s in version_spans]):  # type: ignore[misc]
        lo = 0 if a == 0 else prompt_len - 1 + a
        hi = prompt_len - 1 + b
        lo, hi = max(lo, first_position) - first_position, hi - first_position
        if hi >= lo:
            out.append((v, lo, hi))
    return out
