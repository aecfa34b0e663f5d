"""Announcements and heartbeats on NATS JetStream.

Per run, two streams (created on demand by `ensure_streams`):

    STITCH_<run>_VERSIONS  stitch.<run>.versions     one Announcement per published version
    STITCH_<run>_ENGINES   stitch.<run>.engines.<id> the last Heartbeat of each engine (1 h)

and a third one that only `stitch gateway` creates (`ensure_gateways_stream`; followers never
touch it, so their read-only rights stay as they are):

    STITCH_<run>_GATEWAYS  stitch.<run>.gateways.<id> the last GatewayHeartbeat of each (1 h)

Functions take a nats-py connection (`NATS`) or its JetStream context; `connect(url)` makes one
(every NATS connection Stitch opens goes through it). It reads, from the environment:

    STITCH_NATS_CREDS      a credentials file (user JWT + nkey seed, as `nsc` writes it)
    STITCH_NATS_TLS_CA     a CA file (PEM): TLS, and only servers whose certificate it signed
    STITCH_NATS_TLS_CERT   a client certificate (PEM) for mutual TLS; needs STITCH_NATS_TLS_KEY
    STITCH_NATS_TLS_KEY    its private key (PEM)

With any of the TLS variables, or a `tls://` URL, the connection is TLS or nothing: a server
that does not offer TLS is refused before any credential is sent. docs/nats-security.md gives
the least-privilege account config (a follower needs only read rights and its heartbeats).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import inspect
import logging
import re
import ssl
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Literal, TypeVar

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext, api
from pydantic import BaseModel, ConfigDict

from stitch_core.errors import StitchError
from stitch_core.settings import PREFIX, Settings, env_name
from stitch_core.versions.manifest import (
    MAX_ANNOUNCEMENT_BYTES,
    Announcement,
    Heartbeat,
    check_run,
)

log = logging.getLogger("stitch.announce")

VERSIONS_MAX_AGE = 7 * 24 * 3600.0  # seconds
VERSIONS_MAX_MSGS = 100_000
ENGINES_MAX_AGE = 3600.0
MAX_HEARTBEAT_BYTES = 64 << 10  # a heartbeat is a few hundred bytes; readers refuse more
_TOKEN_RE = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
_STREAM_IN_USE = 10058  # JSStreamNameExistErr: same name, other config

# the variables of the NATS client's files (Settings fields, read when a client connects)
ENV_CREDS, ENV_TLS_CA, ENV_TLS_CERT, ENV_TLS_KEY = (
    env_name(f) for f in ("nats_creds", "nats_tls_ca", "nats_tls_cert", "nats_tls_key"))
PERMISSIONS_VIOLATION = "permissions violation"

Callback = Callable[[Announcement], Awaitable[None] | None]
_M = TypeVar("_M", bound=BaseModel)
JS = JetStreamContext | NATS


class NatsConfigError(StitchError, ValueError):
    """The NATS credentials or TLS settings ($STITCH_NATS_*) name a missing or unusable file, or
    are incomplete (a client certificate without its key)."""


class TLSRequiredError(nats.errors.Error):
    """TLS was asked for but the server offers only plain text."""


class _Client(NATS):
    """A nats-py client that refuses a plain-text connection when TLS was asked for (nats-py
    itself only upgrades when the server asks to), and remembers the server's permission
    violations (`denied`) so that a refused request can say so instead of timing out."""

    def __init__(self, tls_required: bool) -> None:
        super().__init__()
        self.tls_required = tls_required
        self.denied: deque[tuple[float, str]] = deque(maxlen=32)  # (monotonic time, message)

    def _connect_command(self) -> bytes:
        # the last step before CONNECT (and any credential in it) is written
        if self.tls_required and not self._server_info.get("tls_required"):
            raise TLSRequiredError(
                "the server does not offer TLS, but TLS was asked for (a tls:// URL or "
                f"${ENV_TLS_CA}/${ENV_TLS_CERT}); refusing to send credentials in plain text")
        return super()._connect_command()


class NatsConnectionError(StitchError, ConnectionError):
    """`connect` could not reach or log in to the NATS server (the reason in the message)."""


class NatsPermissionError(StitchError, PermissionError):
    """The NATS server refused a request: this user lacks the right (docs/nats-security.md)."""


def denied_since(nc: NATS | JetStreamContext | None, since: float) -> str | None:
    """The first permission violation the server reported on `nc` at or after `since`
    (`time.monotonic()`), if any: e.g. 'permissions violation for publish to "$kv.b.k"'."""
    if isinstance(nc, JetStreamContext):
        nc = getattr(nc, "_nc", None)
    for at, msg in getattr(nc, "denied", ()):
        if at >= since:
            return msg
    return None


@contextlib.asynccontextmanager
async def _refusals(x: JS, what: str) -> AsyncIterator[None]:
    """Turn a request the server dropped for lack of permission (it times out) into a
    NatsPermissionError that says which subject was refused."""
    t0 = time.monotonic()
    try:
        yield
    except nats.errors.Error as e:  # a timeout, mostly
        if (why := denied_since(x, t0)) is not None:
            raise NatsPermissionError(f"{what}: refused by the NATS server: {why} (this NATS "
                                      "user lacks the right; see docs/nats-security.md)") from e
        raise


def _pem_file(var: str) -> str | None:
    value = Settings.read(var.removeprefix(PREFIX).lower())
    if not value:
        return None
    path = Path(value).expanduser()
    if not path.is_file():
        raise NatsConfigError(f"${var}={value!r}: no such file")
    return str(path)


def _creds_file() -> str | None:
    """$STITCH_NATS_CREDS, checked: nats-py would loop forever on a file without a JWT."""
    creds = _pem_file(ENV_CREDS)
    if creds is None:
        return None
    try:
        text = Path(creds).read_bytes()
    except OSError as e:
        raise NatsConfigError(f"${ENV_CREDS}={creds!r}: cannot read it: {e}") from e
    if b"BEGIN NATS USER JWT" not in text or b"BEGIN USER NKEY SEED" not in text:
        raise NatsConfigError(f"${ENV_CREDS}={creds!r} is not a NATS credentials file (a user "
                              "JWT and its nkey seed, as `nsc generate creds` writes it)")
    try:
        import nkeys  # noqa: F401 - nats-py signs the server's nonce with it
    except ImportError as e:
        raise NatsConfigError(f"${ENV_CREDS} needs the nkeys package: pip install "
                              "'nats-py[nkeys]'") from e
    return creds


def tls_context() -> ssl.SSLContext | None:
    """The client TLS context that $STITCH_NATS_TLS_CA / _CERT / _KEY describe (None if none is
    set). With a CA file only servers whose certificate it signed are trusted (not the system's
    CAs); without one, the system's CAs. CERT and KEY go together: mutual TLS."""
    ca, cert, key = (_pem_file(v) for v in (ENV_TLS_CA, ENV_TLS_CERT, ENV_TLS_KEY))
    if (cert is None) != (key is None):
        have, missing = (ENV_TLS_CERT, ENV_TLS_KEY) if cert else (ENV_TLS_KEY, ENV_TLS_CERT)
        raise NatsConfigError(f"${have} is set but ${missing} is not: a client certificate "
                              "needs its private key (set both, or neither)")
    if ca is None and cert is None:
        return None
    try:
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca)
    except (ssl.SSLError, ValueError) as e:
        raise NatsConfigError(f"${ENV_TLS_CA}={ca!r} is not a usable CA file (PEM): {e}") from e
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if cert is not None:
        try:
            ctx.load_cert_chain(cert, key)
        except (ssl.SSLError, ValueError) as e:
            raise NatsConfigError(f"${ENV_TLS_CERT}={cert!r} and ${ENV_TLS_KEY}={key!r} are not "
                                  f"a usable certificate and key (PEM, matching): {e}") from e
    return ctx


def _hint(why: str) -> str:
    """A short hint for the connection errors people hit when setting up TLS and credentials."""
    low = why.lower()
    if "certificate verify failed" in low:
        return (f"{why} (the server's certificate is not signed by a trusted CA: set "
                f"${ENV_TLS_CA} to the CA file that signed it)")
    if "certificate required" in low or "handshake failure" in low or "bad certificate" in low \
            or "unknown ca" in low:
        return (f"{why} (the server wants a client certificate it trusts: set "
                f"${ENV_TLS_CERT} and ${ENV_TLS_KEY})")
    if "authorization" in low:
        return (f"{why} (the server knows no such user or refused its credentials: check "
                f"${ENV_CREDS}, or which user the client certificate maps to)")
    return why


def _fatal(e: Exception) -> bool:
    """Errors that retrying the same settings cannot fix (fail the first connect at once)."""
    return isinstance(e, ssl.SSLError | ssl.CertificateError | nats.errors.AuthorizationError
                      | TLSRequiredError) or "authorization violation" in str(e).lower()


def versions_subject(run: str) -> str:
    """The subject of `run`'s version announcements."""
    return f"stitch.{check_run(run)}.versions"


def engines_subject(run: str, engine: str = "*") -> str:
    """The heartbeat subject of `engine` in `run` (default ``*``: every engine)."""
    return f"stitch.{check_run(run)}.engines.{engine}"


def gateways_subject(run: str, gateway: str = "*") -> str:
    """The heartbeat subject of `gateway` (`stitch gateway`) in `run` (default ``*``: all)."""
    return f"stitch.{check_run(run)}.gateways.{gateway}"


def versions_stream(run: str) -> str:
    """The name of the JetStream stream of `run`'s announcements."""
    return f"STITCH_{check_run(run)}_VERSIONS"


def engines_stream(run: str) -> str:
    """The name of the JetStream stream of `run`'s engine heartbeats."""
    return f"STITCH_{check_run(run)}_ENGINES"


def gateways_stream(run: str) -> str:
    """The name of the JetStream stream of `run`'s gateway heartbeats (made by the gateways)."""
    return f"STITCH_{check_run(run)}_GATEWAYS"


def engine_token(engine_id: str) -> str:
    """`engine_id` as one NATS subject token; changed ids get a hash suffix so they stay unique."""
    if _TOKEN_RE.match(engine_id):
        return engine_id
    digest = hashlib.sha1(engine_id.encode()).hexdigest()[:8]
    return f"{re.sub(r'[^A-Za-z0-9_-]', '_', engine_id)[:100]}-{digest}"


async def connect(url: str, *, name: str = "stitch", connect_timeout: float = 5.0,
                  **opts) -> NATS:
    """Connect to `url` (nats:// or tls://; several comma-separated), failing within
    `connect_timeout` seconds instead of retrying for minutes (at once for a TLS or
    authorization failure); once connected it reconnects forever. Credentials and TLS come from
    $STITCH_NATS_CREDS and $STITCH_NATS_TLS_CA/_CERT/_KEY (see the module doc) unless `opts`
    give `user_credentials` / `tls`. Raises NatsConnectionError (a ConnectionError), or
    NatsConfigError for bad settings."""
    if "user_credentials" not in opts and (creds := _creds_file()):
        opts["user_credentials"] = creds
    if "tls" not in opts and (ctx := tls_context()) is not None:
        opts["tls"] = ctx
    servers = url.split(",")
    nc = _Client(tls_required="tls" in opts or any(
        s.strip().lower().startswith("tls://") for s in servers))
    errors: list[str] = []  # since the last (re)connect; only the first is a warning
    fatal = asyncio.Event()
    reason: list[str] = []  # a first-connect error that retrying cannot fix (its message)
    shown = _redact(url)

    async def _error(e: Exception) -> None:
        text = str(e) or type(e).__name__
        if PERMISSIONS_VIOLATION in text.lower():  # the connection stays up
            nc.denied.append((time.monotonic(), text.removeprefix("nats: ")))
            log.warning("NATS %s: %s", shown, text)
            return
        errors.append(_hint(text))
        if _fatal(e) and not nc.is_connected and not fatal.is_set():
            reason.append(errors[-1])  # the reason, whatever later attempts say
            fatal.set()
        log.log(logging.WARNING if len(errors) == 1 else logging.DEBUG, "NATS %s: %s", shown,
                errors[-1])

    async def _disconnected() -> None:
        if not nc.is_closed:  # not our own close()
            log.warning("NATS %s: disconnected; reconnecting", shown)

    async def _reconnected() -> None:
        errors.clear()
        log.info("NATS %s: reconnected", shown)

    opts = {"error_cb": _error, "disconnected_cb": _disconnected,
            "reconnected_cb": _reconnected, "max_reconnect_attempts": -1,
            "reconnect_time_wait": 1, "connect_timeout": max(1, int(connect_timeout)), **opts}
    task = asyncio.ensure_future(nc.connect(servers, name=name, **opts))
    gave_up = asyncio.ensure_future(fatal.wait())
    try:
        await asyncio.wait({task, gave_up}, timeout=connect_timeout,
                           return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # we were cancelled: so is the connect
        task.cancel()
        raise
    finally:
        gave_up.cancel()
    if task.done() and not task.cancelled() and task.exception() is None:
        errors.clear()
        return nc
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    e = None if task.cancelled() else task.exception()
    with contextlib.suppress(Exception):
        await nc.close()
    if e is not None and not isinstance(e, OSError | nats.errors.Error | TimeoutError):
        raise e
    if reason:
        why = reason[0]
    elif errors:
        why = errors[-1]
    else:
        why = _hint(str(e)) if e else f"no answer within {connect_timeout:g} s"
    raise NatsConnectionError(f"cannot connect to NATS at {shown}: {why}") from e


def _redact(url: str) -> str:
    """`url` without passwords or tokens (user:pass@ -> user:***@)."""
    return re.sub(r"(?<=://)([^:@/,]*)(:[^@/,]*)?@", lambda m: f"{m.group(1)}:***@"
                  if m.group(2) else "***@", url)


def _js(x: JS) -> JetStreamContext:
    return x.jetstream() if isinstance(x, NATS) else x


_COMPARED = ("subjects", "retention", "storage", "max_msgs", "max_msgs_per_subject", "max_age",
             "allow_direct", "description")


def _up_to_date(have: api.StreamConfig, want: api.StreamConfig) -> bool:
    return all(getattr(want, f) is None or getattr(have, f) == getattr(want, f)
               for f in _COMPARED)


async def _add_or_update(js: JetStreamContext, config: api.StreamConfig) -> None:
    # Look before writing: a stream that exists as wanted needs nothing, so a client with read
    # rights only (a follower: $JS.API.STREAM.INFO, no STREAM.CREATE/UPDATE) gets through.
    try:
        info = await js.stream_info(config.name)
    except nats.js.errors.NotFoundError:
        info = None
    if info is not None:
        if _up_to_date(info.config, config):
            return
        try:
            await js.update_stream(config)
        except (nats.js.errors.APIError, nats.errors.TimeoutError) as e:  # a limit the server
            # will not change, or no right to change it (timeout: the request was dropped)
            log.warning("stream %s exists with another config that cannot be updated: %s",
                        config.name, e)
        return
    try:
        await js.add_stream(config)
    except nats.js.errors.BadRequestError as e:
        if e.err_code != _STREAM_IN_USE:
            raise
        try:
            await js.update_stream(config)
        except nats.js.errors.APIError as e2:  # e.g. a limit the server will not change
            log.warning("stream %s exists with another config that cannot be updated: %s",
                        config.name, e2)


async def ensure_streams(js: JS, run: str) -> None:
    """Create (or bring up to date) the VERSIONS and ENGINES streams of `run`. Idempotent; on
    streams that are already as wanted it only reads their info (no admin rights needed)."""
    js = _js(js)
    async with _refusals(js, f"creating the streams of run {run}"):
        await _ensure_streams(js, run)


async def _ensure_streams(js: JetStreamContext, run: str) -> None:
    await _add_or_update(js, api.StreamConfig(
        name=versions_stream(run), subjects=[versions_subject(run)],
        description=f"stitch: versions announced for run {run}",
        retention=api.RetentionPolicy.LIMITS, storage=api.StorageType.FILE,
        max_msgs=VERSIONS_MAX_MSGS, max_age=VERSIONS_MAX_AGE, allow_direct=True))
    await _add_or_update(js, _last_of_each_stream(
        engines_stream(run), engines_subject(run),
        f"stitch: last heartbeat of each engine following run {run}"))


def _last_of_each_stream(name: str, subjects: str, description: str) -> api.StreamConfig:
    """A heartbeat stream: the last message of each subject, for ENGINES_MAX_AGE."""
    return api.StreamConfig(
        name=name, subjects=[subjects], description=description,
        retention=api.RetentionPolicy.LIMITS, storage=api.StorageType.FILE,
        max_msgs_per_subject=1, max_age=ENGINES_MAX_AGE, allow_direct=True)


async def announce(js: JS, ann: Announcement) -> int:
    """Publish `ann` on stitch.<run>.versions; returns once JetStream stored it (its sequence).
    Creates the run's streams if they do not exist yet."""
    js = _js(js)
    data = ann.model_dump_json().encode()
    subject = versions_subject(ann.run)
    async with _refusals(js, f"announcing {ann.run} version {ann.version}"):
        try:
            ack = await js.publish(subject, data, stream=versions_stream(ann.run))
        except nats.js.errors.NoStreamResponseError:
            await ensure_streams(js, ann.run)
            ack = await js.publish(subject, data, stream=versions_stream(ann.run))
    log.info("announced %s version %d (stream seq %d)", ann.run, ann.version, ack.seq)
    return ack.seq


async def subscribe_versions(js: JS, run: str, callback: Callback, *,
                             deliver: Literal["last", "all", "new"] = "last",
                             idle_heartbeat: float = 5.0) -> JetStreamContext.PushSubscription:
    """Call `callback(Announcement)` for the announcements of `run`, in order.

    deliver="last": the most recent announcement (if any) first, then every new one; "all": the
    whole retained history; "new": only future ones. An ordered (ephemeral, flow-controlled)
    consumer: it re-creates itself after gaps, or when the server has been silent for two
    `idle_heartbeat`s (e.g. restarted), starting after the last message seen. Malformed
    messages and callback errors are logged and skipped. The callback may be sync or async; it
    runs one message at a time. Call `.unsubscribe()` on the result to stop.
    """
    js = _js(js)
    policy = {"last": api.DeliverPolicy.LAST, "all": api.DeliverPolicy.ALL,
              "new": api.DeliverPolicy.NEW}[deliver]

    skipped = 0

    def skip(why: str, *args: Any) -> None:  # logged at powers of two and every 1000th only
        nonlocal skipped
        skipped += 1
        if skipped & (skipped - 1) == 0 or skipped % 1000 == 0:
            log.warning("skipping " + why + " (%d skipped so far)", *args, skipped)

    async def _on_msg(msg: Msg) -> None:
        if len(msg.data) > MAX_ANNOUNCEMENT_BYTES:
            skip("oversized announcement on %s: %d bytes (limit %d)", msg.subject,
                 len(msg.data), MAX_ANNOUNCEMENT_BYTES)
            return
        try:
            ann = Announcement.model_validate_json(msg.data)
        except ValueError as e:
            skip("malformed announcement on %s: %s (%r)", msg.subject, str(e).splitlines()[0],
                 msg.data[:200])
            return
        if ann.run != run:
            skip("announcement for run %r on %s", ann.run, msg.subject)
            return
        try:
            res = callback(ann)
            if inspect.isawaitable(res):
                await res
        except Exception:
            log.exception("announcement callback failed for %s version %d", run, ann.version)

    async with _refusals(js, f"subscribing to the announcements of run {run}"):
        try:
            await js.stream_info(versions_stream(run))
        except nats.js.errors.NotFoundError:
            await ensure_streams(js, run)
        return await js.subscribe(versions_subject(run), cb=_on_msg,
                                  stream=versions_stream(run), ordered_consumer=True,
                                  deliver_policy=policy, idle_heartbeat=idle_heartbeat)


async def last_announcement(js: JS, run: str) -> Announcement | None:
    """The most recent announcement of `run` (None if none or the stream does not exist)."""
    js = _js(js)
    try:
        msg = await js.get_last_msg(versions_stream(run), versions_subject(run))
    except nats.js.errors.NotFoundError:
        return None
    try:
        return Announcement.model_validate_json(msg.data or b"")
    except ValueError:
        log.warning("last announcement of %s is malformed", run)
        return None


async def publish_heartbeat(js_or_nc: JS, hb: Heartbeat) -> None:
    """Publish `hb` on stitch.<run>.engines.<id>. With a JetStream context it waits for the ack
    (creating the streams if needed); with a plain connection it is fire-and-forget."""
    subject = engines_subject(hb.run, engine_token(hb.id))
    data = hb.model_dump_json().encode()
    if isinstance(js_or_nc, NATS):
        await js_or_nc.publish(subject, data)
        return
    async with _refusals(js_or_nc, f"publishing the heartbeat of {hb.id} on {subject}"):
        try:
            await js_or_nc.publish(subject, data, stream=engines_stream(hb.run))
        except nats.js.errors.NoStreamResponseError:
            await ensure_streams(js_or_nc, hb.run)
            await js_or_nc.publish(subject, data, stream=engines_stream(hb.run))


def speaks_for(run: str, subject: str, engine_id: str, kind: str = "engines") -> bool:
    """Whether a heartbeat claiming `engine_id` may have arrived on `subject`: only on its own
    subject (stitch.<run>.<kind>.<engine_token(id)>). NATS permissions bind a publisher to
    subjects, not to what its messages say, so this is what makes a per-engine publish right
    mean "can speak only for itself" (docs/nats-security.md)."""
    return subject == f"stitch.{check_run(run)}.{kind}.{engine_token(engine_id)}"


@dataclass(frozen=True)
class Stored(Generic[_M]):
    """A heartbeat as the stream keeps it: with the subject it arrived on and what the server
    assigned (stream sequence, time stored: epoch seconds), which a reader can trust more than
    the `time` the sender claims."""

    hb: _M
    subject: str
    seq: int
    stored: float


async def fleet_stored(js: JS, run: str) -> list[Stored[Heartbeat]]:
    """The last heartbeat of every engine of `run` seen within the last hour, sorted by id, each
    with its subject, stream sequence and server time. Heartbeats whose id does not map to the
    subject they were published on (`speaks_for`) are logged and left out."""
    return await _last_of_each(_js(js), engines_stream(run), engines_subject(run), Heartbeat,
                               run, "engines")


async def fleet(js: JS, run: str) -> list[Heartbeat]:
    """The last heartbeat of every engine of `run` seen within the last hour, sorted by id.
    Reads the stream directly (no waiting for the next round of heartbeats); see
    `fleet_stored`."""
    return [s.hb for s in await fleet_stored(js, run)]


class GatewayHeartbeat(BaseModel):
    """Published by `stitch gateway` on `stitch.<run>.gateways.<id>` (`stitch status` shows it)."""

    model_config = ConfigDict(extra="ignore")
    id: str
    run: str
    url: str | None = None
    region: str | None = None
    engines: int = 0  # engines it routes to now (fresh heartbeat, serving, not dead)
    versions: list[int] = []  # the versions those engines serve, ascending, distinct
    in_flight: int = 0
    requests_total: int = 0
    time: float


async def ensure_gateways_stream(js: JS, run: str) -> None:
    """Create (or bring up to date) `run`'s GATEWAYS stream (needs its STREAM.CREATE right once;
    only INFO when it exists as wanted)."""
    js = _js(js)
    async with _refusals(js, f"creating the gateway stream of run {run}"):
        await _add_or_update(js, _last_of_each_stream(
            gateways_stream(run), gateways_subject(run),
            f"stitch: last heartbeat of each gateway of run {run}"))


async def publish_gateway_heartbeat(js: JS, hb: GatewayHeartbeat) -> None:
    """Publish `hb` on stitch.<run>.gateways.<id> (JetStream: waits for the ack)."""
    js = _js(js)
    subject = gateways_subject(hb.run, engine_token(hb.id))
    async with _refusals(js, f"publishing the heartbeat of gateway {hb.id} on {subject}"):
        await js.publish(subject, hb.model_dump_json().encode(), stream=gateways_stream(hb.run))


async def gateways(js: JS, run: str) -> list[GatewayHeartbeat]:
    """The last heartbeat of every gateway of `run` seen within the last hour, sorted by id
    ([] when no gateway ever ran: no stream)."""
    return [s.hb for s in await _last_of_each(_js(js), gateways_stream(run),
                                              gateways_subject(run), GatewayHeartbeat, run,
                                              "gateways")]


async def _last_of_each(js: JetStreamContext, stream: str, subjects: str, model: type[_M],
                        run: str, kind: str) -> list[Stored[_M]]:
    """The last message of each subject of `stream` matching `subjects`, parsed as `model`,
    sorted by id. Oversized, malformed, other runs' and ids that do not match their subject
    (`speaks_for`) are logged and skipped; at most 64 reads at a time."""
    try:
        info = await js.stream_info(stream, subjects_filter=subjects)
    except nats.js.errors.NotFoundError:
        return []
    reads = asyncio.Semaphore(64)

    async def _last(subject: str) -> Stored[_M] | None:
        try:
            async with reads:
                msg = await js.get_last_msg(stream, subject)
        except nats.js.errors.NotFoundError:  # expired meanwhile
            return None
        subject = msg.subject or subject
        data = msg.data or b""
        if len(data) > MAX_HEARTBEAT_BYTES:
            log.warning("skipping oversized heartbeat on %s: %d bytes", subject, len(data))
            return None
        try:
            hb = model.model_validate_json(data)
        except ValueError as e:
            log.warning("skipping malformed heartbeat on %s: %s", subject, str(e).splitlines()[0])
            return None
        hid, hrun = getattr(hb, "id", ""), getattr(hb, "run", "")
        if hrun != run or not speaks_for(run, subject, hid, kind):
            log.warning("skipping heartbeat on %s claiming id %r of run %r: a heartbeat speaks "
                        "only for its own subject", subject, hid, hrun)
            return None
        stored = msg.time.timestamp() if msg.time is not None else time.time()
        return Stored(hb, subject, msg.seq or 0, stored)

    beats = await asyncio.gather(*(_last(s) for s in sorted((info.state.subjects or {}).keys())))
    return sorted((b for b in beats if b is not None), key=lambda b: getattr(b.hb, "id", ""))
