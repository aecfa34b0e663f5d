"""Announcements and heartbeats on NATS JetStream.

Per run, two streams (created on demand by `ensure_streams`):

    STITCH_<run>_VERSIONS  stitch.<run>.versions     one Announcement per published version
    STITCH_<run>_ENGINES   stitch.<run>.engines.<id> the last Heartbeat of each engine (1 h)

Functions take a nats-py connection (`NATS`) or its JetStream context; `connect(url)` makes one.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import inspect
import logging
import os
import re
from collections.abc import Awaitable, Callable
from typing import Literal

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext, api

from stitch_core.versions.manifest import Announcement, Heartbeat, check_run

log = logging.getLogger(__name__)

VERSIONS_MAX_AGE = 7 * 24 * 3600.0  # seconds
VERSIONS_MAX_MSGS = 100_000
ENGINES_MAX_AGE = 3600.0
_TOKEN_RE = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
_STREAM_IN_USE = 10058  # JSStreamNameExistErr: same name, other config

Callback = Callable[[Announcement], Awaitable[None] | None]
JS = JetStreamContext | NATS


def versions_subject(run: str) -> str:
    """The subject of `run`'s version announcements."""
    return f"stitch.{check_run(run)}.versions"


def engines_subject(run: str, engine: str = "*") -> str:
    """The heartbeat subject of `engine` in `run` (default ``*``: every engine)."""
    return f"stitch.{check_run(run)}.engines.{engine}"


def versions_stream(run: str) -> str:
    """The name of the JetStream stream of `run`'s announcements."""
    return f"STITCH_{check_run(run)}_VERSIONS"


def engines_stream(run: str) -> str:
    """The name of the JetStream stream of `run`'s engine heartbeats."""
    return f"STITCH_{check_run(run)}_ENGINES"


def engine_token(engine_id: str) -> str:
    """`engine_id` as one NATS subject token; changed ids get a hash suffix so they stay unique."""
    if _TOKEN_RE.match(engine_id):
        return engine_id
    digest = hashlib.sha1(engine_id.encode()).hexdigest()[:8]
    return f"{re.sub(r'[^A-Za-z0-9_-]', '_', engine_id)[:100]}-{digest}"


async def connect(url: str, *, name: str = "stitch", connect_timeout: float = 5.0,
                  **opts) -> NATS:
    """Connect to `url` (nats:// or tls://; several comma-separated), failing within
    `connect_timeout` seconds instead of retrying for minutes; once connected it reconnects
    forever. $STITCH_NATS_CREDS names a credentials file if the server needs one."""
    nc = NATS()
    errors: list[str] = []  # since the last (re)connect; only the first is a warning

    async def _error(e: Exception) -> None:
        errors.append(str(e) or type(e).__name__)
        log.log(logging.WARNING if len(errors) == 1 else logging.DEBUG, "NATS %s: %s", url,
                errors[-1])

    async def _disconnected() -> None:
        if not nc.is_closed:  # not our own close()
            log.warning("NATS %s: disconnected; reconnecting", url)

    async def _reconnected() -> None:
        errors.clear()
        log.info("NATS %s: reconnected", url)

    creds = os.environ.get("STITCH_NATS_CREDS")
    if creds and "user_credentials" not in opts:
        opts["user_credentials"] = creds
    opts = {"error_cb": _error, "disconnected_cb": _disconnected,
            "reconnected_cb": _reconnected, "max_reconnect_attempts": -1,
            "reconnect_time_wait": 1, "connect_timeout": max(1, int(connect_timeout)), **opts}
    try:
        await asyncio.wait_for(nc.connect(url.split(","), name=name, **opts), connect_timeout)
    except (TimeoutError, OSError, nats.errors.Error) as e:
        with contextlib.suppress(Exception):
            await nc.close()
        why = errors[-1] if errors else str(e) or type(e).__name__
        raise ConnectionError(f"cannot connect to NATS at {url}: {why}") from e
    errors.clear()
    return nc


def _js(x: JS) -> JetStreamContext:
    return x.jetstream() if isinstance(x, NATS) else x


async def _add_or_update(js: JetStreamContext, config: api.StreamConfig) -> None:
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
    """Create (or bring up to date) the VERSIONS and ENGINES streams of `run`. Idempotent."""
    js = _js(js)
    await _add_or_update(js, api.StreamConfig(
        name=versions_stream(run), subjects=[versions_subject(run)],
        description=f"stitch: versions announced for run {run}",
        retention=api.RetentionPolicy.LIMITS, storage=api.StorageType.FILE,
        max_msgs=VERSIONS_MAX_MSGS, max_age=VERSIONS_MAX_AGE, allow_direct=True))
    await _add_or_update(js, api.StreamConfig(
        name=engines_stream(run), subjects=[engines_subject(run)],
        description=f"stitch: last heartbeat of each engine following run {run}",
        retention=api.RetentionPolicy.LIMITS, storage=api.StorageType.FILE,
        max_msgs_per_subject=1, max_age=ENGINES_MAX_AGE, allow_direct=True))


async def announce(js: JS, ann: Announcement) -> int:
    """Publish `ann` on stitch.<run>.versions; returns once JetStream stored it (its sequence).
    Creates the run's streams if they do not exist yet."""
    js = _js(js)
    data = ann.model_dump_json().encode()
    subject = versions_subject(ann.run)
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

    async def _on_msg(msg: Msg) -> None:
        try:
            ann = Announcement.model_validate_json(msg.data)
        except ValueError as e:
            log.warning("skipping malformed announcement on %s: %s (%r)", msg.subject,
                        str(e).splitlines()[0], msg.data[:200])
            return
        if ann.run != run:
            log.warning("skipping announcement for run %r on %s", ann.run, msg.subject)
            return
        try:
            res = callback(ann)
            if inspect.isawaitable(res):
                await res
        except Exception:
            log.exception("announcement callback failed for %s version %d", run, ann.version)

    try:
        await js.stream_info(versions_stream(run))
    except nats.js.errors.NotFoundError:
        await ensure_streams(js, run)
    return await js.subscribe(versions_subject(run), cb=_on_msg, stream=versions_stream(run),
                              ordered_consumer=True, deliver_policy=policy,
                              idle_heartbeat=idle_heartbeat)


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
    try:
        await js_or_nc.publish(subject, data, stream=engines_stream(hb.run))
    except nats.js.errors.NoStreamResponseError:
        await ensure_streams(js_or_nc, hb.run)
        await js_or_nc.publish(subject, data, stream=engines_stream(hb.run))


async def fleet(js: JS, run: str) -> list[Heartbeat]:
    """The last heartbeat of every engine of `run` seen within the last hour, sorted by id.
    Reads the stream directly (no waiting for the next round of heartbeats)."""
    js = _js(js)
    stream = engines_stream(run)
    try:
        info = await js.stream_info(stream, subjects_filter=engines_subject(run))
    except nats.js.errors.NotFoundError:
        return []
    subjects = sorted((info.state.subjects or {}).keys())

    async def _last(subject: str) -> Heartbeat | None:
        try:
            msg = await js.get_last_msg(stream, subject)
        except nats.js.errors.NotFoundError:  # expired meanwhile
            return None
        try:
            return Heartbeat.model_validate_json(msg.data or b"")
        except ValueError as e:
            log.warning("skipping malformed heartbeat on %s: %s", subject, str(e).splitlines()[0])
            return None

    beats = await asyncio.gather(*(_last(s) for s in subjects))
    return sorted((b for b in beats if b is not None), key=lambda b: b.id)
