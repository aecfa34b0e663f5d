"""The JetStream streams of a run, their subjects, and their administration.

Per run, two streams (created on demand by `ensure_streams`):

    STITCH_<run>_VERSIONS  stitch.<run>.versions     one Announcement per published version
    STITCH_<run>_ENGINES   stitch.<run>.engines.<id> the last Heartbeat of each engine (1 h)

and a third one that only `stitch gateway` creates (`ensure_gateways_stream`; followers never
touch it, so their read-only rights stay as they are):

    STITCH_<run>_GATEWAYS  stitch.<run>.gateways.<id> the last GatewayHeartbeat of each (1 h)

Functions take a nats-py connection or its JetStream context (`stitch_core.versions.nats_conn`);
the messages on these streams are `stitch_core.versions.announce`'s.
"""

from __future__ import annotations

import hashlib
import logging
import re

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext, api

from stitch_core.versions.manifest import check_run
from stitch_core.versions.nats_conn import JS, jetstream, refusals

log = logging.getLogger("stitch.announce")

VERSIONS_MAX_AGE = 7 * 24 * 3600.0  # seconds
VERSIONS_MAX_MSGS = 100_000
ENGINES_MAX_AGE = 3600.0
_TOKEN_RE = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
_STREAM_IN_USE = 10058  # JSStreamNameExistErr: same name, other config


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
    js = jetstream(js)
    async with refusals(js, f"creating the streams of run {run}"):
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



async def ensure_gateways_stream(js: JS, run: str) -> None:
    """Create (or bring up to date) `run`'s GATEWAYS stream (needs its STREAM.CREATE right once;
    only INFO when it exists as wanted)."""
    js = jetstream(js)
    async with refusals(js, f"creating the gateway stream of run {run}"):
        await _add_or_update(js, _last_of_each_stream(
            gateways_stream(run), gateways_subject(run),
            f"stitch: last heartbeat of each gateway of run {run}"))

