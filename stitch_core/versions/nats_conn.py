"""Connecting to NATS: every NATS connection Stitch opens goes through `connect(url)`.

It reads, from the environment:

    STITCH_NATS_CREDS      a credentials file (user JWT + nkey seed, as `nsc` writes it)
    STITCH_NATS_TLS_CA     a CA file (PEM): TLS, and only servers whose certificate it signed
    STITCH_NATS_TLS_CERT   a client certificate (PEM) for mutual TLS; needs STITCH_NATS_TLS_KEY
    STITCH_NATS_TLS_KEY    its private key (PEM)

With any of the TLS variables, or a `tls://` URL, the connection is TLS or nothing: a server
that does not offer TLS is refused before any credential is sent. docs/nats-security.md gives
the least-privilege account config (a follower needs only read rights and its heartbeats).
A request the server drops for lack of permission becomes a NatsPermissionError that names the
subject (`refusals`, `denied_since`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import ssl
import time
from collections import deque
from collections.abc import AsyncIterator
from pathlib import Path

import nats
import nats.errors
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

from stitch_core.errors import StitchError
from stitch_core.settings import PREFIX, Settings, env_name

log = logging.getLogger("stitch.announce")

# the variables of the NATS client's files (Settings fields, read when a client connects)
ENV_CREDS, ENV_TLS_CA, ENV_TLS_CERT, ENV_TLS_KEY = (
    env_name(f) for f in ("nats_creds", "nats_tls_ca", "nats_tls_cert", "nats_tls_key"))
PERMISSIONS_VIOLATION = "permissions violation"
JS = JetStreamContext | NATS


class NatsConfigError(StitchError, ValueError):
    """The NATS credentials or TLS settings ($STITCH_NATS_*) name a missing or unusable file, or
    are incomplete (a client certificate without its key)."""


class TLSRequiredError(StitchError, nats.errors.Error, ConnectionError):
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
async def refusals(x: JS, what: str) -> AsyncIterator[None]:
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


def creds_file() -> str | None:
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


async def connect(url: str, *, name: str = "stitch", connect_timeout: float = 5.0,
                  **opts) -> NATS:
    """Connect to `url` (nats:// or tls://; several comma-separated), failing within
    `connect_timeout` seconds instead of retrying for minutes (at once for a TLS or
    authorization failure); once connected it reconnects forever. Credentials and TLS come from
    $STITCH_NATS_CREDS and $STITCH_NATS_TLS_CA/_CERT/_KEY (see the module doc) unless `opts`
    give `user_credentials` / `tls`. Raises NatsConnectionError (a ConnectionError), or
    NatsConfigError for bad settings."""
    if "user_credentials" not in opts and (creds := creds_file()):
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

def jetstream(x: JS) -> JetStreamContext:
    """The JetStream context of a connection (a context is returned as it is)."""
    return x.jetstream() if isinstance(x, NATS) else x

