"""Which routes of an engine's HTTP app generate from the weights, found in the app's own table.

An engine adapter does not list its engine's generating endpoints by hand (such a list goes stale
with the next release): at application start-up it walks the app's route table (`walk`: FastAPI /
Starlette routes, included routers and mounts) and classifies every route (`discover`), with a
fallback list for when the table cannot be read. What a `Route` says:

* `methods` / `path`: what it answers (a path may hold ``{params}``);
* `dialect`: the response shape its answers take, so the 409s, the stamps and the mid-stream
  errors look like the engine's own (``openai``: chat / completions and everything in their
  style; ``responses``: the OpenAI Responses API's typed SSE events; ``anthropic``: the Messages
  API's errors and named events);
* `salt`: whether its JSON body may carry ``cache_salt`` (its request model declares one);
* `control`: ``full`` (admitted through the gate, salted, stamped) or ``refuse`` (generates but
  cannot be stamped, e.g. a WebSocket: refused while the engine holds no proven version, passed
  through untouched otherwise).

The rule shared by the engines (`generating`): a route that takes a request by POST, PUT or PATCH
generates unless it is one of the engine's control or pre/post-processing endpoints (the engine
adapter says which by the engine's own metadata, e.g. the module its endpoint lives in or an
admin marker, plus the names in `NOT_GENERATING`); every WebSocket route counts as generating.
Unknown routes are thus version-controlled: the rule fails closed.

The engine's side only (its own HTTP routes: which are version-controlled, which refused while not
ready); the gateway's table of engines and the order it tries them in is
`stitch_core.serve.routing`.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import types
import typing
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

log = logging.getLogger("stitch.routes")

Dialect = Literal["openai", "responses", "anthropic"]
Control = Literal["full", "refuse"]
WEBSOCKET = "WEBSOCKET"  # the method a WebSocket route is filed under
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})

# endpoints that run no model on a prompt, by the name of their function: tokenizer round trips,
# prompt rendering, token counting, aborts and cancels, tool-call / reasoning parsers, sessions,
# model cards
NOT_GENERATING = re.compile(
    r"(?:^|_)(?:de)?(?:tokeni[sz]e|render)(?:_|$)|count_tokens|(?:^|_)(?:abort|cancel)(?:_|$)"
    r"|parse_function_call|separate_reasoning|(?:^|_)(?:open|close)_session|(?:^|_)show(?:_|$)")

_PARAM = re.compile(r"\{([^}:]+)(?::([^}]+))?\}")


@dataclass(frozen=True)
class Route:
    """A route under version control (see the module doc)."""

    path: str
    methods: frozenset[str] = frozenset({"POST"})
    dialect: Dialect = "openai"
    salt: bool = True
    control: Control = "full"
    name: str = ""

    def describe(self) -> dict[str, Any]:
        return {"path": self.path, "methods": sorted(self.methods), "control": self.control,
                "dialect": self.dialect, "salt": self.salt}


def _pattern(path: str) -> re.Pattern[str]:
    out, pos = [], 0
    for m in _PARAM.finditer(path):
        out.append(re.escape(path[pos:m.start()]))
        out.append(".*" if m.group(2) == "path" else "[^/]+")
        pos = m.end()
    out.append(re.escape(path[pos:]))
    return re.compile("".join(out) + r"\Z")


class RouteTable:
    """Routes looked up by (method, path); the first route given for a pair wins."""

    def __init__(self, routes: Iterable[Route] = ()):
        self.routes: tuple[Route, ...] = tuple(routes)
        self._exact: dict[tuple[str, str], Route] = {}
        self._templates: list[tuple[re.Pattern[str], Route]] = []
        for r in self.routes:
            if _PARAM.search(r.path):
                self._templates.append((_pattern(r.path), r))
            else:
                for m in r.methods:
                    self._exact.setdefault((m, r.path), r)

    def find(self, method: str, path: str) -> Route | None:
        r = self._exact.get((method, path))
        if r is not None:
            return r
        for pat, r in self._templates:
            if method in r.methods and pat.match(path):
                return r
        return None

    def __iter__(self) -> Iterator[Route]:
        return iter(self.routes)

    def __len__(self) -> int:
        return len(self.routes)


@dataclass(frozen=True)
class RouteInfo:
    """One route of an app's table, as `walk` found it."""

    path: str
    methods: frozenset[str]
    endpoint: Any = None
    websocket: bool = False
    body_models: tuple[Any, ...] = ()

    @property
    def module(self) -> str:
        return str(getattr(self.endpoint, "__module__", "") or "")

    @property
    def name(self) -> str:
        return str(getattr(self.endpoint, "__name__", "") or "")

    @property
    def model_names(self) -> tuple[str, ...]:
        return tuple(getattr(m, "__name__", str(m)) for m in self.body_models)

    def declares(self, field: str) -> bool:
        """Whether a request model of its body declares `field`."""
        return any(field in model_fields(m) for m in self.body_models)


def model_fields(model: Any) -> set[str]:
    """The fields a request model declares (pydantic model or dataclass)."""
    fields = getattr(model, "model_fields", None)
    if isinstance(fields, dict):
        return set(fields)
    if dataclasses.is_dataclass(model):
        return {f.name for f in dataclasses.fields(model)}
    return set()


def _flatten(t: Any) -> list[Any]:
    if t is None or t is type(None):
        return []
    if typing.get_origin(t) is typing.Annotated:
        return _flatten(typing.get_args(t)[0])
    args = typing.get_args(t)
    if args and typing.get_origin(t) in (typing.Union, types.UnionType):
        return [m for a in args for m in _flatten(a)]
    return [t]


def body_models(route: Any) -> tuple[Any, ...]:
    """The request models of a FastAPI route's body (union members each), () if none."""
    field = getattr(route, "body_field", None)
    if field is None:
        return ()
    info = getattr(field, "field_info", None)
    t = getattr(info, "annotation", None) or getattr(field, "type_", None)
    return tuple(_flatten(t))


def walk(app: Any) -> list[RouteInfo]:
    """Every route of `app` (a Starlette / FastAPI app or router), included routers and mounts
    entered, in the order the app matches them."""
    out: list[RouteInfo] = []
    routes = getattr(getattr(app, "router", None), "routes", None)
    _walk(routes if routes is not None else getattr(app, "routes", []), "", out, 0)
    return out


def _walk(routes: Iterable[Any], prefix: str, out: list[RouteInfo], depth: int) -> None:
    if depth > 8:
        return
    for r in routes:
        inner = getattr(r, "original_router", None)  # FastAPI's lazily included router
        if inner is not None:
            sub = getattr(getattr(r, "include_context", None), "prefix", "") or ""
            _walk(getattr(inner, "routes", []), prefix + sub, out, depth + 1)
            continue
        path = getattr(r, "path", None)
        if not isinstance(path, str):
            continue
        if type(r).__name__ == "Mount" or (getattr(r, "routes", None)
                                           and getattr(r, "endpoint", None) is None):
            _walk(getattr(r, "routes", None) or [], prefix + path, out, depth + 1)
            continue
        methods = getattr(r, "methods", None)
        ws = methods is None and "websocket" in type(r).__name__.lower()
        out.append(RouteInfo(prefix + path, frozenset(methods or ()),
                             getattr(r, "endpoint", None), ws, body_models(r)))


def dialect_of(info: RouteInfo) -> Dialect:
    """The response shape of a route, from its request model or path."""
    if info.path.startswith("/v1/messages") or any(n.startswith("Anthropic")
                                                   for n in info.model_names):
        return "anthropic"
    if info.path.startswith("/v1/responses") or "ResponsesRequest" in info.model_names:
        return "responses"
    return "openai"


def generating(info: RouteInfo, control_endpoint: Callable[[RouteInfo], bool]) -> Route | None:
    """The shared rule (module doc): `control_endpoint` is the engine's own word on which of its
    body-taking endpoints run no model."""
    if info.websocket:
        return Route(info.path, frozenset({WEBSOCKET}), "openai", False, "refuse", info.name)
    methods = info.methods & BODY_METHODS
    if not methods or NOT_GENERATING.search(info.name) or control_endpoint(info):
        return None
    return Route(info.path, frozenset(methods), dialect_of(info), info.declares("cache_salt"),
                 "full", info.name)


def discover(app: Any, classify: Callable[[RouteInfo], Route | None],
             fallback: Iterable[Route] = ()) -> list[Route]:
    """The version-controlled routes of `app`: those `classify` finds in its table, then the
    `fallback` routes for paths it did not (all of `fallback` if the table cannot be read)."""
    try:
        found = [r for info in walk(app) if (r := classify(info)) is not None]
    except Exception:
        log.exception("stitch: cannot read the app's route table; using the fallback list")
        found = []
    seen = {r.path for r in found}
    return [*found, *(r for r in fallback if r.path not in seen)]
