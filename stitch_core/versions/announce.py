"""Announcements and heartbeats on NATS JetStream: publishing and reading the messages.

A version is announced on stitch.<run>.versions (`announce`, `subscribe_versions`,
`last_announcement`); each engine keeps its last heartbeat on stitch.<run>.engines.<id>
(`publish_heartbeat`, `fleet`) and each gateway on stitch.<run>.gateways.<id>
(`publish_gateway_heartbeat`, `gateways`). A heartbeat speaks only for its own subject
(`speaks_for`). The streams and subjects are `stitch_core.versions.streams`'; connections
(credentials, TLS) `stitch_core.versions.nats_conn`'s; the messages themselves are models of
`stitch_core.versions.manifest`.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

import nats.js.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext, api
from pydantic import BaseModel

from stitch_core.versions.manifest import (
    MAX_ANNOUNCEMENT_BYTES,
    Announcement,
    GatewayHeartbeat,
    Heartbeat,
    check_run,
)
from stitch_core.versions.nats_conn import JS, jetstream, refusals
from stitch_core.versions.streams import (
    engine_token,
    engines_stream,
    engines_subject,
    ensure_streams,
    gateways_stream,
    gateways_subject,
    versions_stream,
    versions_subject,
)

log = logging.getLogger("stitch.announce")

MAX_HEARTBEAT_BYTES = 64 << 10  # a heartbeat is a few hundred bytes; readers refuse more

Callback = Callable[[Announcement], Awaitable[None] | None]
_M = TypeVar("_M", bound=BaseModel)


async def announce(js: JS, ann: Announcement) -> int:
    """Publish `ann` on stitch.<run>.versions; returns once JetStream stored it (its sequence).
    Creates the run's streams if they do not exist yet."""
    js = jetstream(js)
    data = ann.model_dump_json().encode()
    subject = versions_subject(ann.run)
    async with refusals(js, f"announcing {ann.run} version {ann.version}"):
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
    js = jetstream(js)
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

    async with refusals(js, f"subscribing to the announcements of run {run}"):
        try:
            await js.stream_info(versions_stream(run))
        except nats.js.errors.NotFoundError:
            await ensure_streams(js, run)
        return await js.subscribe(versions_subject(run), cb=_on_msg,
                                  stream=versions_stream(run), ordered_consumer=True,
                                  deliver_policy=policy, idle_heartbeat=idle_heartbeat)


async def last_announcement(js: JS, run: str) -> Announcement | None:
    """The most recent announcement of `run` (None if none or the stream does not exist)."""
    js = jetstream(js)
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
    async with refusals(js_or_nc, f"publishing the heartbeat of {hb.id} on {subject}"):
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
    return await _last_of_each(jetstream(js), engines_stream(run), engines_subject(run), Heartbeat,
                               run, "engines")


async def fleet(js: JS, run: str) -> list[Heartbeat]:
    """The last heartbeat of every engine of `run` seen within the last hour, sorted by id.
    Reads the stream directly (no waiting for the next round of heartbeats); see
    `fleet_stored`."""
    return [s.hb for s in await fleet_stored(js, run)]


async def publish_gateway_heartbeat(js: JS, hb: GatewayHeartbeat) -> None:
    """Publish `hb` on stitch.<run>.gateways.<id> (JetStream: waits for the ack)."""
    js = jetstream(js)
    subject = gateways_subject(hb.run, engine_token(hb.id))
    async with refusals(js, f"publishing the heartbeat of gateway {hb.id} on {subject}"):
        await js.publish(subject, hb.model_dump_json().encode(), stream=gateways_stream(hb.run))


async def gateways(js: JS, run: str) -> list[GatewayHeartbeat]:
    """The last heartbeat of every gateway of `run` seen within the last hour, sorted by id
    ([] when no gateway ever ran: no stream)."""
    return [s.hb for s in await _last_of_each(jetstream(js), gateways_stream(run),
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

